"""Checkpoints: a shard's partitions on disk, written atomically, the last K kept.

Layout under the data directory::

    DIR/<shard id>/ckpt-<unix time ns, 20 digits>/
        MANIFEST          msgpack {"shard", "time", "partitions": [[p, epoch, seq], ...]}
        p00042.gbs        one file per partition: a STATE message (header + tensor frames)

A partition file is ``MAGIC``, the header's length (uint32, little endian), the msgpack header
(the same STATE header a primary sends a standby catching up: per block its layout, optimizer,
version and optimizer-state names) and the tensor frames back to back, each as long as its
descriptor's ``n`` says, each checked against its xxh3 checksum on load.

A checkpoint is written into ``ckpt-...tmp``, every file fsynced, then the directory renamed
to its final name and the parent fsynced: a crash leaves either the whole checkpoint or a
``.tmp`` directory that readers ignore (and the next write removes); a write that fails
removes its own ``.tmp``.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import struct
import time
from dataclasses import dataclass

import msgpack

from gradbus.codecs import messages, wire
from gradbus.codecs.errors import Code, WireError

log = logging.getLogger("gradbus.shard")

MAGIC = b"GBSTATE1"
PREFIX = "ckpt-"
MANIFEST = "MANIFEST"


@dataclass(frozen=True)
class Checkpoint:
    path: str
    shard: str
    time: float                   # wall-clock seconds
    partitions: tuple             # ((p, epoch, seq), ...)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, chunks) -> None:
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())


def write(root: str, shard_id: str, states: list[list], keep: int = 3,
          now: float | None = None) -> Checkpoint:
    """Write one checkpoint of ``states`` (STATE messages: header frame, tensor frames) and
    keep the newest ``keep`` checkpoints of this shard. A write that fails (a full disk, say)
    removes what it wrote before raising, and every write first removes the ``.tmp``
    leftovers of earlier ones that were interrupted: failures never pile up on disk."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    now = time.time() if now is None else now
    base = os.path.join(root, shard_id)
    os.makedirs(base, exist_ok=True)
    _sweep(base)
    name = f"{PREFIX}{int(now * 1e9):020d}"
    tmp = os.path.join(base, name + ".tmp")
    try:
        parts = _write_tmp(tmp, shard_id, states, now)
        final = os.path.join(base, name)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(base)
    for old in list_for(root, shard_id)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, shard_id, now, tuple(sorted(parts)))


def _sweep(base: str) -> None:
    """Remove the ``.tmp`` directories of interrupted writes under ``base``."""
    for entry in os.listdir(base):
        if entry.startswith(PREFIX) and entry.endswith(".tmp"):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


def _write_tmp(tmp: str, shard_id: str, states: list[list], now: float) -> list:
    """Every file of a checkpoint into the new directory ``tmp``, fsynced; its partitions."""
    os.makedirs(tmp)
    parts = []
    for msg in states:
        header = bytes(msg[0])
        h = msgpack.unpackb(header)
        if wire.has_refs(h.get("t")):    # a file holds the bytes, never shared-memory refs
            raise ValueError(f"the state of partition {h['p']} references shared memory")
        parts.append((h["p"], h["epoch"], h["seq"]))
        _write_file(os.path.join(tmp, f"p{h['p']:05d}.gbs"),
                    [MAGIC, struct.pack("<I", len(header)), header,
                     *(memoryview(f) for f in msg[1:])])
    _write_file(os.path.join(tmp, MANIFEST), [msgpack.packb(
        {"shard": shard_id, "time": now, "partitions": sorted(parts)})])
    _fsync_dir(tmp)
    return parts


class DamagedCheckpoint(WireError):
    """A checkpoint that cannot be used as it is; the message names the file and what is
    wrong with it, and ``path`` is the file."""

    def __init__(self, path: str, what: str, code: Code = Code.BAD_FRAME):
        super().__init__(code, f"{path}: {what}")
        self.path, self.what = path, what


def read_manifest(path: str) -> Checkpoint:
    """The checkpoint directory ``path``'s MANIFEST, validated; raises
    :class:`DamagedCheckpoint` naming it when it is missing, unreadable or not a manifest."""
    mpath = os.path.join(path, MANIFEST)
    raw = _read(mpath, "the manifest of a complete checkpoint")
    try:
        m = msgpack.unpackb(raw, max_bin_len=0, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise DamagedCheckpoint(mpath, f"is not a msgpack manifest ({type(e).__name__})") from None
    ok = (isinstance(m, dict) and isinstance(m.get("shard"), str)
          and isinstance(m.get("time"), (int, float)) and not isinstance(m.get("time"), bool)
          and math.isfinite(m["time"]) and isinstance(m.get("partitions"), list)
          and all(isinstance(x, list) and len(x) == 3
                  and all(type(v) is int and v >= 0 for v in x) for x in m["partitions"]))
    if not ok:
        raise DamagedCheckpoint(mpath, "is not a gradbus manifest (wants shard, time and "
                                       "partitions [[p, epoch, seq], ...])")
    parts = tuple(tuple(x) for x in m["partitions"])
    if len({x[0] for x in parts}) != len(parts):
        raise DamagedCheckpoint(mpath, "lists a partition twice")
    return Checkpoint(path, m["shard"], float(m["time"]), parts)


def _read(path: str, what: str) -> bytes:
    """The bytes of a checkpoint's file ``path``, or :class:`DamagedCheckpoint` saying that
    ``what`` cannot be read, and why."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DamagedCheckpoint(path, f"{what} cannot be read ({e.strerror or e})") from None


def _entries(root: str, shard_id: str) -> list[tuple[float, str]]:
    """``(time from the name, path)`` of every finished checkpoint directory of a shard,
    damaged or not, oldest first (``.tmp`` directories of unfinished writes are not)."""
    base = os.path.join(root, shard_id)
    if not os.path.isdir(base):
        return []
    out = []
    for entry in os.listdir(base):
        stamp = entry[len(PREFIX):]
        if entry.startswith(PREFIX) and stamp.isdigit():
            out.append((int(stamp) / 1e9, os.path.join(base, entry)))
    return sorted(out)


def list_for(root: str, shard_id: str) -> list[Checkpoint]:
    """This shard's complete checkpoints whose manifest reads, oldest first (see
    :func:`newest` for the ones that do not)."""
    out = []
    for _, path in _entries(root, shard_id):
        try:
            out.append(read_manifest(path))
        except DamagedCheckpoint:
            pass
    return sorted(out, key=lambda c: c.time)


def shards_in(root: str) -> list[str]:
    """The shard ids with at least one finished checkpoint (damaged ones count: restoring
    them says what is wrong instead of leaving the shard out)."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if _entries(root, d))


def newest(root: str, shard_id: str, at: float | None = None,
           fallback: bool = False) -> Checkpoint | None:
    """The newest checkpoint of a shard taken at or before wall-clock time ``at``.

    A damaged one there (its manifest does not read) raises :class:`DamagedCheckpoint`: the
    state is never taken silently from an older checkpoint than the one asked for. With
    ``fallback``, every candidate is also loaded in full, and a damaged one is skipped for the
    next older with a warning naming it and what is wrong."""
    for stamp, path in reversed(_entries(root, shard_id)):
        try:
            ck = read_manifest(path)
            if at is not None and ck.time > at:
                continue
            if fallback:
                load(ck)
            return ck
        except DamagedCheckpoint as e:
            if at is not None and stamp > at:
                continue
            if not fallback:
                raise DamagedCheckpoint(e.path, f"{e.what}; refusing to restore an older "
                                                f"checkpoint of {shard_id} instead unless "
                                                f"told to fall back", e.code) from None
            log.warning("checkpoint %s is damaged (%s): falling back to an older one of %s",
                        path, e.args[0], shard_id)
    return None


def load(ck: Checkpoint, max_tensor_bytes: int = wire.MAX_TENSOR_BYTES) -> list[tuple]:
    """The checkpoint's partitions as ``(header dict, descs, frames)``: every file the
    manifest lists must be there, hold that partition at the manifest's (epoch, seq), and
    pass every header, length and checksum check; anything else raises
    :class:`DamagedCheckpoint` naming the file and what is wrong."""
    out = []
    for p, epoch, seq in ck.partitions:
        path = os.path.join(ck.path, f"p{p:05d}.gbs")
        data = _read(path, f"partition {p}, listed in the MANIFEST,")
        if data[:len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
            raise DamagedCheckpoint(path, "not a gradbus state file")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        try:
            h = messages.unpack(data[start:start + hlen], frozenset({wire.STATE}))
        except WireError as e:
            raise DamagedCheckpoint(path, f"damaged header ({e})", e.code) from None
        held = (h.p, h.epoch, h.seq)
        if held != (p, epoch, seq):
            raise DamagedCheckpoint(path, f"holds partition {held[0]} at (epoch, seq) = "
                                          f"{held[1:]} where the MANIFEST says partition {p} at "
                                          f"{(epoch, seq)}: a file from another checkpoint")
        pos, frames = start + hlen, []
        for d in h.t:
            n = d.get("n") if isinstance(d, dict) else None
            if not isinstance(n, int) or n < 0 or pos + n > len(data):
                raise DamagedCheckpoint(path, "truncated")
            frames.append(memoryview(data)[pos:pos + n])
            pos += n
        if pos != len(data):
            raise DamagedCheckpoint(path, f"{len(data) - pos} trailing bytes")
        try:
            descs = h.descs(frames, max_tensor_bytes)
            for d, fr in zip(descs, frames):
                wire.decode_tensor(d, fr, max_tensor_bytes)   # checksums, before anything is used
        except WireError as e:
            raise DamagedCheckpoint(path, f"damaged tensor ({e})", e.code) from None
        out.append((h, descs, frames))
    return out
