"""The broker's optional append-only update log: every sequenced batch part, as sent to shards.

With a checkpoint of a partition at seq S, the log's records of that partition after S rebuild
it exactly (a shard with no standby), and those up to a wall-clock time T give the state as of
T (point-in-time restore, exact to the update).

Files: ``DIR/seg-<n, 12 digits>.log``, a new segment once one passes ``segment_bytes``. A record
is ``MAGIC``, the length of the rest (uint32), its CRC-32 (uint32), then a msgpack header
``{"p", "seq", "epoch", "time", "e": entries, "t": tensor descriptors}`` followed by the tensor
frames its entries name (``"i"`` indexes them, as in a BATCH). A torn record at the end of the
last segment (a crash mid-write) is ignored on reading.

fsync policies: ``always`` (before the batch goes to the shards, so an acknowledged push is on
disk), ``interval`` (at most once a second: a crash may lose the last second of the log, never
the shards' state), ``never`` (the OS decides). The broker core decides when to fsync (on its
injected clock) and asks the loop to; this module only writes, syncs and reads.
"""
from __future__ import annotations

import os
import struct
import zlib

import msgpack

from gradbus.codecs import wire

MAGIC = b"GBLG"
FSYNC_POLICIES = ("always", "interval", "never")
SEGMENT_BYTES = 256 << 20
_HEAD = struct.Struct("<4sII")


class UpdateLog:
    def __init__(self, directory: str, fsync: str = "interval", segment_bytes: int = SEGMENT_BYTES):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        os.makedirs(directory, exist_ok=True)
        self.dir, self.fsync, self.segment_bytes = directory, fsync, segment_bytes
        segs = self.segments()
        self._n = int(os.path.basename(segs[-1])[4:16]) + 1 if segs else 0
        self._f = None
        self._size = 0
        self._dirty = False
        self.records = 0
        self.bytes = 0

    def segments(self) -> list[str]:
        return sorted(os.path.join(self.dir, f) for f in os.listdir(self.dir)
                      if f.startswith("seg-") and f.endswith(".log"))

    def _open(self) -> None:
        if self._f is not None:
            self._f.close()
        path = os.path.join(self.dir, f"seg-{self._n:012d}.log")
        self._n += 1
        self._f = open(path, "ab")
        self._size = 0

    def append(self, parts: list[dict], t_list: list, frames: list, now: float) -> None:
        """Log each part of one BATCH (header parts, descriptors, frames, wall-clock time)."""
        for part in parts:
            descs, bufs, ents = [], [], []
            for ent in part["e"]:
                e = dict(ent)
                if "i" in e:
                    i = e["i"]
                    e["i"] = len(bufs)
                    descs.append(t_list[i])
                    bufs.append(frames[i])
                ents.append(e)
            head = msgpack.packb({"p": part["p"], "seq": part["seq"], "epoch": part["epoch"],
                                  "time": now, "e": ents, "t": descs}, use_bin_type=True)
            body_len = 4 + len(head) + sum(wire.frame_len(b) for b in bufs)
            crc = zlib.crc32(head)
            for b in bufs:
                crc = zlib.crc32(wire.frame_buffer(b), crc)
            if self._f is None or self._size > self.segment_bytes:
                self._open()
            self._f.write(_HEAD.pack(MAGIC, body_len, crc))
            self._f.write(struct.pack("<I", len(head)))
            self._f.write(head)
            for b in bufs:
                self._f.write(wire.frame_buffer(b))
            self._size += _HEAD.size + body_len
            self.records += 1
            self.bytes += _HEAD.size + body_len
        self._dirty = True

    def sync(self) -> None:
        """Write out and fsync what was appended."""
        if self._f is not None and self._dirty:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._dirty = False

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None


def read(directory: str):
    """Every intact record, in log order: ``(header dict, [frame bytes])``."""
    if not os.path.isdir(directory):
        return
    for path in sorted(os.path.join(directory, f) for f in os.listdir(directory)
                       if f.startswith("seg-") and f.endswith(".log")):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _HEAD.size <= len(data):
            magic, body_len, crc = _HEAD.unpack_from(data, pos)
            start, end = pos + _HEAD.size, pos + _HEAD.size + body_len
            if magic != MAGIC or end > len(data):
                break                                  # a torn tail
            body = memoryview(data)[start:end]
            (hlen,) = struct.unpack_from("<I", body, 0)
            head = bytes(body[4:4 + hlen])
            c = zlib.crc32(head)
            c = zlib.crc32(body[4 + hlen:], c)
            if c != crc:
                break
            h = msgpack.unpackb(head, raw=False)
            pos_f, frames = 4 + hlen, []
            for d in h["t"]:
                frames.append(bytes(body[pos_f:pos_f + d["n"]]))
                pos_f += d["n"]
            for d, fr in zip(h["t"], frames):       # checked like any tensor frame on the wire
                if wire.checksum(fr) != d["x"]:
                    raise ValueError(f"{path}: checksum mismatch in partition {h['p']} seq "
                                     f"{h['seq']}")
            yield h, frames
            pos = end


class LogIndex:
    """Records by partition, read once: what a restarted or restoring broker replays."""

    def __init__(self, directory: str):
        self.by_p: dict[int, list] = {}
        for h, frames in read(directory):
            self.by_p.setdefault(h["p"], []).append((h, frames))

    def after(self, p: int, seq: int, until: float | None = None) -> list:
        """Records of ``p`` with seq above ``seq`` (and time at or before ``until``), in seq
        order, the last copy of each seq (a broker restarted from this log may have written
        a seq again)."""
        out = {}
        for h, frames in self.by_p.get(p, ()):
            if h["seq"] > seq and (until is None or h["time"] <= until):
                out[h["seq"]] = (h, frames)
        return [out[s] for s in sorted(out)]
