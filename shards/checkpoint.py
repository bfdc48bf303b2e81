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

import os
import shutil
import struct
import time
from dataclasses import dataclass

import msgpack

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError

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
        parts.append((h["p"], h["epoch"], h["seq"]))
        _write_file(os.path.join(tmp, f"p{h['p']:05d}.gbs"),
                    [MAGIC, struct.pack("<I", len(header)), header,
                     *(memoryview(f) for f in msg[1:])])
    _write_file(os.path.join(tmp, MANIFEST), [msgpack.packb(
        {"shard": shard_id, "time": now, "partitions": sorted(parts)})])
    _fsync_dir(tmp)
    return parts


def _read_manifest(path: str) -> Checkpoint | None:
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            m = msgpack.unpackb(f.read(), max_bin_len=0, max_ext_len=0)
        return Checkpoint(path, str(m["shard"]), float(m["time"]),
                          tuple(tuple(int(v) for v in x) for x in m["partitions"]))
    except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException):
        return None


def list_for(root: str, shard_id: str) -> list[Checkpoint]:
    """This shard's complete checkpoints, oldest first."""
    base = os.path.join(root, shard_id)
    if not os.path.isdir(base):
        return []
    out = []
    for entry in sorted(os.listdir(base)):
        if entry.startswith(PREFIX) and not entry.endswith(".tmp"):
            ck = _read_manifest(os.path.join(base, entry))
            if ck is not None:
                out.append(ck)
    return sorted(out, key=lambda c: c.time)


def shards_in(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if list_for(root, d))


def newest(root: str, shard_id: str, at: float | None = None) -> Checkpoint | None:
    """The newest checkpoint of a shard taken at or before wall-clock time ``at``."""
    cks = [c for c in list_for(root, shard_id) if at is None or c.time <= at]
    return cks[-1] if cks else None


def load(ck: Checkpoint, max_tensor_bytes: int = wire.MAX_TENSOR_BYTES) -> list[tuple]:
    """The checkpoint's partitions as ``(header dict, descs, frames)``, every header, length
    and checksum validated (a damaged file raises WireError naming it)."""
    out = []
    for p, _, _ in ck.partitions:
        path = os.path.join(ck.path, f"p{p:05d}.gbs")
        with open(path, "rb") as f:
            data = f.read()
        if data[:len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
            raise WireError(Code.BAD_FRAME, f"{path}: not a gradbus state file")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        h = wire.unpack_header(data[start:start + hlen], frozenset({wire.STATE}))
        pos, frames = start + hlen, []
        for d in h.get("t", []):
            n = d.get("n") if isinstance(d, dict) else None
            if not isinstance(n, int) or n < 0 or pos + n > len(data):
                raise WireError(Code.BAD_FRAME, f"{path}: truncated")
            frames.append(memoryview(data)[pos:pos + n])
            pos += n
        if pos != len(data):
            raise WireError(Code.BAD_FRAME, f"{path}: {len(data) - pos} trailing bytes")
        descs = wire.parse_tensors(h, frames, max_tensor_bytes)
        for d, fr in zip(descs, frames):
            wire.decode_tensor(d, fr, max_tensor_bytes)   # checksums, before anything is used
        out.append((h, descs, frames))
    return out
