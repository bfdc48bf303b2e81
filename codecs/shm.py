"""Shared-memory segments for tensor bytes between processes on one host.

A segment is a file in the shared-memory directory (``/dev/shm``, or ``$GRADBUS_SHM_DIR``),
created ``O_EXCL`` with mode 0600, its pages reserved up front (``posix_fallocate``: a full
``/dev/shm`` is an error at creation, never a SIGBUS later) and mapped. Its name says whose it
is::

    gradbus-<cluster>-<role><pid>-<pidns>-<n>

``cluster`` is 8 hex digits of the broker's address (:func:`cluster_tag`), ``role`` ``w``
(a client's push ring), ``s`` (a shard's weights board) or ``b`` (the broker's probe, which
peers open to prove they share its shared-memory directory), ``pid`` and ``pidns`` the owner's
process id and pid namespace: :func:`sweep` removes the segments of owners that are dead (in
its own pid namespace only: another namespace's pids mean nothing here). Every segment starts
with a 64-byte header, ``MAGIC``, a 16-byte nonce and the size; data lives after it.

* :class:`Ring` -- a client's push slots: bytes are written once, referenced by a PUSH, and the
  slot is reused only after the broker said (FREE) that nothing it sent needs them any more.
* :class:`Board` -- a shard's published weights: two versions per block, each behind a stamp
  word (a seqlock); a reader copies a version out and checks the stamp before and after, so it
  never keeps a half-written block.
* :class:`ReplyArea` -- a shard's replies (snapshots, rows reads, a partition's state for a
  standby): written over the oldest, never freed; each reply's granules carry its stamp in a
  table apart from the data, so a reader knows whether what it copied out is still that reply.
* :class:`Mapper` -- a reader's cache of peers' segments, opened read-only, bounds-checked.

The three writers live in :mod:`gradbus.codecs.shm_writers` and are re-exported here.

References travel in a tensor descriptor's ``r`` field: ``[segment, offset]`` into a ring,
``[segment, offset, stamp]`` into a board or a reply area (see docs/protocol.md). The board's stamp protocol
relies on stores being seen in program order (x86-64); elsewhere boards are off and weights
travel as frames.
"""
from __future__ import annotations

import collections
import itertools
import logging
import mmap
import os
import platform
import re
import struct
import sys
import threading
import time

import numpy as np
import xxhash

from .errors import Code, WireError

log = logging.getLogger("gradbus.shm")

MAGIC = b"GRADBUS\x01"
HEADER = 64                       # bytes before a segment's data
ALIGN = 64                        # every slot starts on a cache line
MIN_RING_SEGMENT = 8 << 20        # a ring grows by segments of at least this size
MAX_MAPPED = 64                   # peers' segments a reader keeps open
MIN_REPLY_SEGMENT = 8 << 20       # a reply area's first segment (data bytes)
REPLY_CAP = 256 << 20             # the most data bytes a shard's reply area grows to
REPLY_MARK = b"GBREPLY1"          # at byte 32 of a reply area's segment: then its layout
GRANULE_SHIFT = 12                # a reply area's data is stamped per 4 KiB granule
_WRITING = (1 << 64) - 1          # a board slot's stamp while it is being written
_U64 = struct.Struct("<Q")
NAME_RE = re.compile(r"gradbus-([0-9a-f]{8})-([wsb])(\d{1,10})-(\d{1,20})-(\d{1,12})-([0-9a-f]{4})\Z")
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


class ShmFull(OSError):
    """The shared-memory directory has no room for a segment."""


# ----------------------------------------------------------------------------- settings
def wanted(flag: bool | None = None, default: bool = True) -> bool:
    """Whether this process offers shared memory: ``flag`` (a command-line switch or an
    argument) wins, then ``$GRADBUS_SHM`` (``0`` or ``1``), then ``default``."""
    if flag is not None:
        return bool(flag)
    env = os.environ.get("GRADBUS_SHM")
    if env is None or env == "":
        return default
    if env not in ("0", "1"):
        raise ValueError(f"GRADBUS_SHM must be 0 or 1, not {env!r}")
    return env == "1"


def directory() -> str:
    return os.environ.get("GRADBUS_SHM_DIR") or "/dev/shm"


def usable(path: str | None = None) -> bool:
    """Linux, and a shared-memory directory this process can create files in."""
    path = path or directory()
    return sys.platform.startswith("linux") and os.path.isdir(path) and os.access(path, os.W_OK)


def host_identity() -> str:
    """What two processes must share to use each other's segments: the boot id, the user and
    the shared-memory directory (a peer still proves it can open a segment: see
    :func:`probe`)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{boot}:{os.getuid()}:{directory()}"


def cluster_tag(url: str) -> str:
    """8 hex digits naming a cluster (its broker's address) in segment names."""
    return f"{xxhash.xxh32_intdigest(url.encode()):08x}"


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_counter = itertools.count()


def segment_name(cluster: str, role: str) -> str:
    return (f"gradbus-{cluster}-{role}{os.getpid()}-{_pidns()}-{next(_counter)}-"
            f"{os.urandom(2).hex()}")


# ----------------------------------------------------------------------------- segments
class Segment:
    """One mapped segment. ``create`` makes and owns it (``unlink`` removes the name);
    ``open`` maps a peer's read-only."""

    __slots__ = ("name", "path", "size", "mm", "view", "words", "nonce", "owner", "address",
                 "stamps", "data", "shift")

    def __init__(self, name: str, path: str, mm: mmap.mmap, owner: bool):
        self.name, self.path, self.mm, self.owner = name, path, mm, owner
        self.size = len(mm)
        self.view = memoryview(mm)
        self.words = np.frombuffer(mm, np.uint64) if owner else None   # aligned 8-byte stores
        self.address = self.words.ctypes.data if owner else 0          # where byte 0 is mapped
        self.nonce = bytes(self.view[8:24])
        self.stamps = None               # a reply area's granule stamps (see ReplyArea)
        self.data = self.shift = 0
        if not owner and self.view[32:40] == REPLY_MARK:
            self._reply_layout()

    def _reply_layout(self) -> None:
        """A peer's reply area: its granule size, count and data offset, checked against the
        segment's size (a bad one is refused when a ref into it is read)."""
        shift, count, data = struct.unpack_from("<QQQ", self.view, 40)
        if (not 6 <= shift <= 30 or data < HEADER + 8 * count or data % ALIGN
                or data + (count << shift) > self.size):
            return
        self.stamps = np.frombuffer(self.mm, np.uint64, count, HEADER)
        self.data, self.shift = data, shift

    @classmethod
    def create(cls, cluster: str, role: str, size: int) -> Segment:
        base = directory()
        size = max(HEADER + ALIGN, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        name = segment_name(cluster, role)
        path = os.path.join(base, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(path)
                raise ShmFull(e.errno, f"no room for a {size >> 20} MiB segment in {base}: "
                                       f"{e.strerror}") from None
            mm = mmap.mmap(fd, size)
        except BaseException:
            if os.path.exists(path):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm[0:8] = MAGIC
        mm[8:24] = os.urandom(16)
        mm[24:32] = _U64.pack(size)
        return cls(name, path, mm, True)

    @classmethod
    def open(cls, name: str) -> Segment:
        """A peer's segment, read-only; WireError when the name is not a gradbus segment, or
        it is gone, not this user's, open to others, or not one at all."""
        if type(name) is not str or NAME_RE.match(name) is None:
            raise WireError(Code.BAD_FIELD, f"{name!r} is not a gradbus segment name")
        path = os.path.join(directory(), name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise WireError(Code.BAD_FIELD, f"segment {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size < HEADER + ALIGN:
                raise WireError(Code.BAD_FIELD, f"segment {name} is not a private gradbus segment")
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC:
            mm.close()
            raise WireError(Code.BAD_FIELD, f"segment {name} is not a gradbus segment")
        return cls(name, path, mm, False)

    def span(self, off: int, n: int) -> memoryview:
        if type(off) is not int or off < HEADER or n < 0 or off + n > self.size:
            raise WireError(Code.BAD_FIELD, f"segment {self.name}: [{off}, {off}+{n}) is out of "
                                            f"its {self.size} B")
        return self.view[off:off + n]

    def close(self) -> None:
        self.words = self.stamps = None
        try:
            self.view.release()
            self.mm.close()
        except BufferError:      # a slice is still in use somewhere: the GC unmaps it later
            pass
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def probe(name: str, nonce: bytes) -> bool:
    """Whether this process can open a peer's segment and finds the nonce the peer sent: the
    proof, beyond a host identity, that the two share a shared-memory directory."""
    try:
        seg = Segment.open(name)
    except WireError:
        return False
    ok = seg.nonce == nonce
    seg.close()
    return ok


def accept(offer) -> str | None:
    """The cluster tag of a broker's shared-memory offer (WELCOME's ``shm``) when this process
    can take it up: the same host identity, and the broker's probe segment opens and holds the
    nonce the offer names. None otherwise (tensors then go as frames)."""
    if not isinstance(offer, dict) or not usable():
        return None
    cluster, seg, nonce = offer.get("cluster"), offer.get("seg"), offer.get("nonce")
    if (offer.get("host") != host_identity() or type(cluster) is not str
            or re.fullmatch(r"[0-9a-f]{8}", cluster) is None or type(nonce) is not bytes):
        return None
    return cluster if probe(seg, nonce) else None


# ----------------------------------------------------------------------------- reading
class Mapper:
    """A reader's peers' segments, opened on first use, at most ``MAX_MAPPED`` kept (least
    recently used closed first). Thread safe."""

    def __init__(self, limit: int = MAX_MAPPED, on_open=None, on_close=None):
        """``on_open(seg)`` is called with each segment once it is mapped, ``on_close(seg)``
        before it is unmapped (a GPU shard pins and unpins them)."""
        self.limit = limit
        self.on_open, self.on_close = on_open, on_close
        self.segs: collections.OrderedDict[str, Segment] = collections.OrderedDict()
        self.used: dict[str, float] = {}      # name -> when it was last asked for (monotonic)
        self.lock = threading.Lock()
        # big copies out of boards in pieces on these threads (a codecs.passes.Passes; None:
        # one thread)
        self.passes = None

    def segment(self, name: str) -> Segment:
        now = time.monotonic()
        with self.lock:
            seg = self.segs.get(name)
            if seg is not None:
                self.segs.move_to_end(name)
                self.used[name] = now
                return seg
        seg = Segment.open(name)
        if self.on_open is not None:
            self.on_open(seg)
        with self.lock:
            self.segs[name] = seg
            self.used[name] = now
            while len(self.segs) > self.limit:
                old, gone = self.segs.popitem(last=False)
                self.used.pop(old, None)
                self._close(gone)
        return seg

    def _close(self, seg: Segment) -> None:
        if self.on_close is not None:
            self.on_close(seg)
        seg.close()

    def prune(self, idle: float) -> int:
        """Close the segments whose file is gone (their owner removed it, or it was swept)
        and that nobody asked for in the last ``idle`` seconds: a dead client's ring, mapped
        (memory and a descriptor) for nothing. Returns how many."""
        now = time.monotonic()
        with self.lock:
            gone = [name for name, seg in self.segs.items()
                    if now - self.used.get(name, 0.0) >= idle and not os.path.exists(seg.path)]
            for name in gone:
                self._close(self.segs.pop(name))
                self.used.pop(name, None)
        return len(gone)

    def view(self, ref, n: int) -> memoryview:
        """The ``n`` bytes a ring ref names (a read-only view into the peer's segment)."""
        return self.segment(ref[0]).span(ref[1], n)

    def copy(self, ref, n: int) -> bytearray | None:
        """The ``n`` bytes a board or reply-area ref names, copied out whole, or None when
        they were rewritten meanwhile (the reader fell two publishes behind, or later replies
        took the area's room)."""
        seg = self.segment(ref[0])
        if seg.stamps is not None:
            return _copy_reply(seg, ref[1], n, ref[2])
        got = self._board_span(seg, ref, n)
        if got is None:
            return None
        out = bytearray(got)
        return out if self._stamped(ref, seg) else None

    def copy_into(self, ref, out: memoryview) -> bool:
        """Copy the ``out.nbytes`` bytes a board or reply-area ref names into ``out`` (a
        writable byte view); False, ``out`` then holding nothing of use, when they were
        rewritten before they were read whole."""
        seg = self.segment(ref[0])
        if seg.stamps is not None:
            got = _copy_reply(seg, ref[1], out.nbytes, ref[2])
            if got is not None:
                out[:] = got
            return got is not None
        got = self._board_span(seg, ref, out.nbytes)
        if got is None:
            return False
        if self.passes is not None:
            self.passes.copy(out, got)
        else:
            out[:] = got
        return self._stamped(ref, seg)

    def _board_span(self, seg: Segment, ref, n: int) -> memoryview | None:
        """The bytes of a board ref whose stamp still holds, else None."""
        off = ref[1]
        if ref[2] == 0:       # no version is stamped 0
            return None
        if seg.view[32:40] == REPLY_MARK:
            raise WireError(Code.BAD_FIELD, f"segment {seg.name}: a reply area with a bad layout")
        if off - ALIGN < HEADER:
            raise WireError(Code.BAD_FIELD, f"segment {seg.name}: offset {off} is no board slot")
        src = seg.span(off, n)
        return src if self._stamped(ref, seg) else None

    @staticmethod
    def _stamped(ref, seg) -> bool:
        return _U64.unpack_from(seg.view, ref[1] - ALIGN)[0] == ref[2]

    # -- the newest version of a board block (a live ref: [segment, offset, capacity]) -------
    def _live(self, ref) -> tuple:
        """The segment and both versions' header offsets of a live ref, bounds checked."""
        seg = self.segment(ref[0])
        off, cap = ref[1], ref[2]
        if (type(off) is not int or type(cap) is not int or off < HEADER or off % ALIGN
                or cap < 0 or cap % ALIGN or off + 2 * (cap + ALIGN) > seg.size
                or seg.stamps is not None):
            raise WireError(Code.BAD_FIELD, f"segment {seg.name}: {ref[1:]} is no board slot")
        return seg, off, off + cap + ALIGN

    @staticmethod
    def _newest(view, h0: int, h1: int) -> tuple[int, int]:
        """The stamp and header offset of a slot's newest written version ((0, 0): none)."""
        s0 = _U64.unpack_from(view, h0)[0]
        s1 = _U64.unpack_from(view, h1)[0]
        s0 = 0 if s0 == _WRITING else s0
        s1 = 0 if s1 == _WRITING else s1
        return (s0, h0) if s0 >= s1 else (s1, h1)

    def live_version(self, ref) -> tuple[int, int] | None:
        """``(stamp, version)`` of the newest version a live ref's block has, or None when it
        has none (given up, or never written)."""
        seg, h0, h1 = self._live(ref)
        view = seg.view
        for _ in range(8):
            stamp, h = self._newest(view, h0, h1)
            if not stamp:
                return None
            version = _U64.unpack_from(view, h + 8)[0]
            if _U64.unpack_from(view, h)[0] == stamp:
                return stamp, version
        return None

    def read_live(self, ref, out: memoryview) -> tuple[int, int] | None:
        """Copy the newest whole version of a live ref's block into ``out`` (a writable byte
        view of its size); ``(stamp, version)``, or None when there is none to read (given up,
        never written, of another size, or rewritten under every attempt)."""
        seg, h0, h1 = self._live(ref)
        view, n = seg.view, out.nbytes
        for _ in range(8):
            stamp, h = self._newest(view, h0, h1)
            if not stamp or _U64.unpack_from(view, h + 24)[0] != n:
                return None
            if self.passes is not None:
                self.passes.copy(out, view[h + ALIGN:h + ALIGN + n])
            else:
                out[:] = view[h + ALIGN:h + ALIGN + n]
            version = _U64.unpack_from(view, h + 8)[0]
            if _U64.unpack_from(view, h)[0] == stamp:
                return stamp, version
        return None

    def close(self) -> None:
        with self.lock:
            for seg in self.segs.values():
                self._close(seg)
            self.segs.clear()
            self.used.clear()


def _copy_reply(seg: Segment, off: int, n: int, stamp: int) -> bytearray | None:
    """A reply area's ``n`` bytes at ``off``, when every granule they lie in holds ``stamp``
    before and after the copy."""
    lo = off - seg.data if type(off) is int else -1
    if lo < 0 or n < 0 or off + n > seg.data + (len(seg.stamps) << seg.shift):
        raise WireError(Code.BAD_FIELD, f"segment {seg.name}: [{off}, {off}+{n}) is out of "
                                        "its reply granules")
    stamps = seg.stamps[lo >> seg.shift:((lo + max(n, 1) - 1) >> seg.shift) + 1]
    if not (stamps == stamp).all():
        return None
    out = bytearray(seg.view[off:off + n])
    if not (stamps == stamp).all():
        return None
    return out


# ----------------------------------------------------------------------------- sweeping
def owned(name: str) -> tuple | None:
    """``(cluster, role, pid, pidns)`` of a gradbus segment name, else None."""
    m = NAME_RE.match(name)
    if m is None:
        return None
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:        # a zombie is dead for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def dead_segments(cluster: str | None = None, roles: str = "wsb") -> list[str]:
    """The segments (of ``cluster``, or of every cluster; of ``roles``) whose owner is dead,
    in this pid namespace."""
    try:
        names = os.listdir(directory())
    except OSError:
        return []
    ns = _pidns()
    out = []
    alive: dict[int, bool] = {}     # a process owns several segments: asked once per pid
    for name in names:
        who = owned(name)
        if who is None:
            continue
        tag, role, pid, pidns = who
        if (cluster is not None and tag != cluster) or role not in roles or pidns != ns:
            continue
        known = alive.get(pid)
        if known is None:
            known = alive[pid] = _alive(pid)
        if not known:
            out.append(name)
    return out


def remove(names) -> list[str]:
    """Unlink these segments; returns the names removed (one gone already is not)."""
    base = directory()
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(base, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segments of dead processes", len(removed))
    return removed


def sweep(cluster: str | None = None, roles: str = "wsb", keep=frozenset()) -> list[str]:
    """Remove the segments (of ``cluster``, or of every cluster) whose owner is dead, in this
    pid namespace, except those named in ``keep``; returns the names removed."""
    return remove(n for n in dead_segments(cluster, roles) if n not in keep)


def sweep_abandoned(keep=frozenset()) -> list[str]:
    """Remove every segment of the clusters (in this pid namespace) none of whose segments'
    owners is alive: nobody is left to read them, nor to remove them."""
    ns = _pidns()
    by_cluster: dict[str, list] = {}
    try:
        names = os.listdir(directory())
    except OSError:
        return []
    for name in names:
        who = owned(name)
        if who is not None and who[3] == ns and name not in keep:
            by_cluster.setdefault(who[0], []).append(who[2])
    removed = []
    for tag, pids in by_cluster.items():
        if not any(_alive(pid) for pid in pids):
            removed += sweep(tag, keep=keep)
    return removed


def segments(cluster: str | None = None) -> list[str]:
    """The gradbus segments in the shared-memory directory (of ``cluster``, or all)."""
    try:
        names = os.listdir(directory())
    except OSError:
        return []
    return sorted(n for n in names
                  if (o := owned(n)) is not None and (cluster is None or o[0] == cluster))


# the writers' classes, in a module of their own (they need the segments above)
from .shm_writers import Board, ReplyArea, Ring  # noqa: E402

__all__ = ["Board", "Mapper", "ReplyArea", "Ring", "Segment", "ShmFull", "accept", "sweep",
           "sweep_abandoned", "segments", "wanted"]
