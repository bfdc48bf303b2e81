"""The writers of shared memory: a client's push :class:`Ring` (and the broker's relay ring),
a shard's weights :class:`Board` and its :class:`ReplyArea`, over first-fit arenas in segments
of :mod:`gradbus.codecs.shm` (which re-exports them; see it for the naming, the layouts and
the readers).
"""
from __future__ import annotations

import collections
import itertools
import os
import struct
import threading

import xxhash

from .shm import (
    _WRITING,
    ALIGN,
    GRANULE_SHIFT,
    HEADER,
    MIN_REPLY_SEGMENT,
    MIN_RING_SEGMENT,
    ORDERED_STORES,
    REPLY_CAP,
    REPLY_MARK,
    Segment,
    log,
)


# ----------------------------------------------------------------------------- allocation
class _Arena:
    """First-fit allocation over one segment's data area, with coalescing frees."""

    __slots__ = ("seg", "free")

    def __init__(self, seg: Segment):
        self.seg = seg
        self.free = [(HEADER, seg.size - HEADER)]      # sorted (offset, length)

    def alloc(self, n: int) -> int | None:
        n = -(-max(n, 1) // ALIGN) * ALIGN
        for i, (off, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, length - n)
                return off
        return None

    def release(self, off: int, n: int) -> None:
        n = -(-max(n, 1) // ALIGN) * ALIGN
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (off, n))
        if lo + 1 < len(free) and off + n == free[lo + 1][0]:      # merge with the next
            free[lo] = (off, n + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == off:      # and the previous
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    def idle(self) -> bool:
        return self.free == [(HEADER, self.seg.size - HEADER)]


def _new_arena(holder, role: str, size: int, what: str) -> _Arena | None:
    """A new segment of ``size`` bytes for ``holder`` (a :class:`Ring` or :class:`Board`);
    None, with one warning, when the directory has no room: ``what`` goes as frames from then
    on (``holder.failed`` says why)."""
    try:
        seg = Segment.create(holder.cluster, role, size)
    except OSError as e:
        holder.failed = str(e)
        log.warning("shared memory for %s is off from now on, %s go as frames: %s", what, what, e)
        return None
    arena = _Arena(seg)
    holder.arenas.append(arena)
    return arena


HASH_PIECE = 256 << 10     # bytes copied then hashed at a time: both passes in one core's cache


def _copy_hashing(dst: memoryview, src: memoryview) -> int:
    """``dst[:] = src`` a piece at a time, each piece hashed right after it is copied; the
    xxh3-64 of all of it."""
    src = src.cast("B")
    h = xxhash.xxh3_64()
    for lo in range(0, len(src), HASH_PIECE):
        piece = dst[lo:lo + HASH_PIECE]
        piece[:] = src[lo:lo + HASH_PIECE]
        h.update(piece)
    return h.intdigest()


class Ring:
    """A client's push slots, at most ``cap`` bytes in all, in segments made as needed. Thread
    safe: pushes place from the caller's thread, FREE messages release from the I/O thread."""

    def __init__(self, cluster: str, cap: int, first: int = MIN_RING_SEGMENT, role: str = "w"):
        self.cluster = cluster
        self.role = role                      # "w", a client's; "b", the broker's relay ring
        self.cap = cap
        self.lock = threading.Lock()
        self.arenas: list[_Arena] = []
        self.held: dict[int, list] = {}       # msg -> [(arena, offset, n)]
        self.loose: dict[int, tuple] = {}     # token -> (arena, offset, n): reserved, no push yet
        self._tokens = itertools.count(1)
        self.failed: str | None = None        # why the ring stopped making segments
        self.stats = collections.Counter()
        # big copies in pieces on these threads (a codecs.passes.Passes; None: one thread)
        self.passes = None
        self._grow(first)                      # the first segment is also the probe

    @property
    def probe_fields(self) -> dict:
        seg = self.arenas[0].seg
        return {"seg": seg.name, "nonce": seg.nonce}

    @property
    def size(self) -> int:
        return sum(a.seg.size for a in self.arenas)

    def _grow(self, need: int) -> _Arena | None:
        if self.failed is not None:
            return None
        least = need + HEADER + ALIGN
        room = self.cap - self.size
        if self.arenas and least > room:
            return None
        # each new segment as large as all before it (doubling), so large pushes do not end up
        # one per segment with the rest of each wasted
        size = max(least, MIN_RING_SEGMENT, self.size)
        if self.arenas:
            size = min(size, room)
        return _new_arena(self, self.role, size, "pushes")

    def place(self, msg: int, bufs: list, digests: list | None = None) -> list | None:
        """Copy each buffer into a slot of its own, held for ``msg``; returns their refs
        ``[segment, offset]``, or None (nothing held) when the ring has no room. ``digests``
        (one per buffer): where None, set to the frame checksum (xxh3-64, as
        ``wire.checksum``) of the bytes copied, each piece hashed as soon as it is copied,
        while it is in cache, rather than in a pass of its own."""
        with self.lock:
            got = []
            for buf in bufs:
                slot = self._alloc(memoryview(buf).nbytes)
                if slot is None:
                    for a, o, m in got:
                        a.release(o, m)
                    self.stats["shm_ring_full"] += 1
                    return None
                got.append(slot)
            self.held[msg] = got
        refs = []
        passes = self.passes
        for j, ((arena, off, n), buf) in enumerate(zip(got, bufs)):
            dst = arena.seg.view[off:off + n]
            if digests is not None and digests[j] is None:
                got_hash = passes.copy_hashing(dst, buf) if passes is not None and n else None
                digests[j] = got_hash if got_hash is not None else \
                    _copy_hashing(dst, memoryview(buf))
            elif n and passes is not None:
                passes.copy(dst, buf)
            elif n:
                dst[:] = memoryview(buf).cast("B")
            refs.append([arena.seg.name, off])
        return refs

    def bind(self, msg: int, tokens) -> None:
        """Hold reserved slots (their tokens) for push ``msg`` from now on: FREE of ``msg``
        releases them with its other slots."""
        with self.lock:
            slots = [self.loose.pop(t) for t in tokens]
            self.held.setdefault(msg, []).extend(slots)

    def _alloc(self, n: int):
        for arena in self.arenas:
            off = arena.alloc(n)
            if off is not None:
                return arena, off, n
        arena = self._grow(n)
        off = arena.alloc(n) if arena is not None else None
        return None if off is None else (arena, off, n)

    def reserve(self, n: int) -> tuple | None:
        """A slot of ``n`` bytes not yet bound to a push (a gradient buffer the caller writes
        in place): ``(segment, offset, token)``, or None when the ring has no room. It is held
        until :meth:`place` binds it to a push or :meth:`unreserve` gives it back."""
        with self.lock:
            slot = self._alloc(n)
            if slot is None:
                self.stats["shm_ring_full"] += 1
                return None
            token = next(self._tokens)
            self.loose[token] = slot
        return slot[0].seg, slot[1], token

    def unreserve(self, token: int) -> bool:
        """Give back a reserved slot that no push took (a token already bound is ignored)."""
        with self.lock:
            slot = self.loose.pop(token, None)
            if slot is not None:
                slot[0].release(slot[1], slot[2])
        return slot is not None

    def free(self, msgs) -> int:
        """Release the slots of these pushes (ids not held are ignored); returns how many."""
        n = 0
        with self.lock:
            for m in msgs:
                slots = self.held.pop(m, None)
                if slots is not None:
                    n += 1
                    for arena, off, size in slots:
                        arena.release(off, size)
        return n

    def close(self) -> None:
        with self.lock:
            for arena in self.arenas:
                arena.seg.close()
            self.arenas = []
            self.held.clear()
            self.loose.clear()


class Board:
    """A shard's published weights: per block two versions, each a 64-byte header (the stamp,
    then the block's version, the partition seq it was published at and its byte count, one
    uint64 each) then the bytes; a block's versions alternate, so a reader one publish behind
    still reads a whole block, and a reader of the newest (:meth:`live_ref`) picks the higher
    stamp of the two."""

    def __init__(self, cluster: str, segment_bytes: int = 64 << 20):
        self.cluster = cluster
        self.segment_bytes = segment_bytes
        self.arenas: list[_Arena] = []
        # key -> [arena, offset, capacity, next version slot, the block's version written last]
        self.slots: dict[str, list] = {}
        # stamps count up from a random 56-bit start: bytes written where a given-up slot's
        # stamp was (its partition moved) equal a stamp a reader still holds in a ref only by
        # a chance of about 2^-56, not whenever they are small integers
        self.stamp = int.from_bytes(os.urandom(7), "little") | 1
        self.failed: str | None = None
        self.stats = collections.Counter()
        self._grow(0)

    @property
    def probe_fields(self) -> dict | None:
        if not self.arenas:
            return None
        seg = self.arenas[0].seg
        return {"seg": seg.name, "nonce": seg.nonce}

    def _grow(self, need: int) -> _Arena | None:
        if self.failed is not None:
            return None
        return _new_arena(self, "s", max(self.segment_bytes, need + HEADER + ALIGN), "weights")

    def _slot(self, key: str, n: int):
        slot = self.slots.get(key)
        if slot is not None and slot[2] >= n:
            return slot
        if slot is not None:        # the block's bytes grew (a compressing chain): a new place
            self._give_up(slot)
            del self.slots[key]
        cap = -(-max(n, 1) // ALIGN) * ALIGN
        need = 2 * (cap + ALIGN)
        for arena in self.arenas:
            off = arena.alloc(need)
            if off is not None:
                break
        else:
            arena = self._grow(need)
            off = arena.alloc(need) if arena is not None else None
            if off is None:
                return None
        slot = self.slots[key] = [arena, off, cap, 0, -1]
        return slot

    def write(self, key: str, buf, version: int = 0, seq: int = 0) -> list | None:
        """Publish ``buf`` as the block's next version (``version``: gradients applied to it,
        ``seq``: its partition's seq); its ref ``[segment, offset, stamp]``, or None (publish
        it as a frame) when the board has no room."""
        src = memoryview(buf).cast("B")
        dst = self.begin(key, src.nbytes)
        if dst is None:
            return None
        dst[:] = src
        return self.commit(key, version, seq)

    def begin(self, key: str, n: int) -> memoryview | None:
        """The place of the block's next version, ``n`` bytes, to be written there (by a step
        that reads the newest version, :meth:`newest`, and writes this one) and then published
        with :meth:`commit`. From now until then readers skip that version, and a reader one
        publish behind that was reading it reads again. Left uncommitted (the writer gave up)
        the block keeps its newest version. None when the board has no room."""
        if not ORDERED_STORES:
            return None
        slot = self._slot(key, n)
        if slot is None:
            self.stats["shm_board_full"] += 1
            return None
        arena, off, cap, nxt, _ = slot
        word = off + nxt * (cap + ALIGN)
        head = arena.seg.words[word >> 3:(word >> 3) + 4]   # aligned 8-byte stores each
        head[0] = _WRITING
        head[3] = n              # the byte count, read back by commit (readers skip it till then)
        return arena.seg.view[word + ALIGN:word + ALIGN + n]

    def commit(self, key: str, version: int, seq: int) -> list:
        """Publish the version :meth:`begin` opened (its bytes written) as the block's newest;
        its ref ``[segment, offset, stamp]``."""
        slot = self.slots[key]
        arena, off, cap, nxt, _ = slot
        slot[3] = nxt ^ 1
        slot[4] = version
        word = off + nxt * (cap + ALIGN)
        self.stamp += 1
        head = arena.seg.words[word >> 3:(word >> 3) + 4]   # aligned 8-byte stores each
        head[1] = version
        head[2] = seq
        head[0] = self.stamp
        return [arena.seg.name, word + ALIGN, self.stamp]

    def newest(self, key: str) -> tuple[memoryview, list] | None:
        """The bytes of the block's newest version here and its ref ``[segment, offset,
        stamp]``; None when it has none. The view stays whole until the block's second
        :meth:`begin` from now (the first writes the other version)."""
        slot = self.slots.get(key)
        if slot is None or slot[4] < 0:
            return None
        arena, off, cap = slot[0], slot[1], slot[2]
        word = (off + (slot[3] ^ 1) * (cap + ALIGN)) >> 3
        words = arena.seg.words     # written by this process only: two reads, no copy
        stamp, n = int(words[word]), int(words[word + 3])
        data = (word << 3) + ALIGN
        return arena.seg.view[data:data + n], [arena.seg.name, data, stamp]

    def holds(self, key: str, version: int) -> bool:
        """Whether the block's newest version here is ``version``."""
        slot = self.slots.get(key)
        return slot is not None and slot[4] == version

    def live_ref(self, key: str) -> list | None:
        """Where a reader finds the newest version of ``key`` whenever it reads:
        ``[segment, offset, capacity]`` (the first version's header, the bytes each version
        has room for); None when the block was never written here."""
        slot = self.slots.get(key)
        if slot is None:
            return None
        return [slot[0].seg.name, slot[1], slot[2]]

    def forget(self, keys) -> None:
        """Blocks this shard no longer publishes (their partition moved away)."""
        for key in keys:
            slot = self.slots.pop(key, None)
            if slot is not None:
                self._give_up(slot)

    @staticmethod
    def _give_up(slot) -> None:
        """Free a block's place, its versions' stamps cleared first: a reader's ref into it
        fails from now on, whatever is written there later (a stamp is never reused, and
        bytes equal one only by chance: stamps start at random)."""
        arena, off, cap = slot[0], slot[1], slot[2]
        words = arena.seg.words
        words[off >> 3] = 0
        words[(off + cap + ALIGN) >> 3] = 0
        arena.release(off, 2 * (cap + ALIGN))

    def close(self) -> None:
        for arena in self.arenas:
            arena.seg.close()
        self.arenas = []
        self.slots.clear()


class ReplyArea:
    """A shard's replies in shared memory (SNAPSHOT_REPLY, ROWS_REPLY, STATE), written over the
    oldest and never freed: no FREE comes back for them.

    Its segment (role ``s``) is a 64-byte header, a table of stamp words, one per granule of
    ``1 << GRANULE_SHIFT`` bytes, then the granules. A reply takes consecutive granules (from
    where the last one ended, or from the first when it does not fit before the end), its
    tensors each on a cache line; its granules' stamps are set to ``_WRITING``, the bytes
    written, then every stamp set to the reply's own, a number never used before (the board's
    seqlock, stamp by granule). A reader copies a tensor out and checks the stamps of the
    granules it lies in before and after: all equal to its ref's, the bytes are that reply's.
    The stamps live apart from the data, so no reply's bytes can pass for one.

    One segment at a time, made at the first reply; a reply larger than it makes one twice as
    large (or as large as the reply), at most ``cap`` data bytes, and the old one is removed
    (refs still in flight into it read as torn). A reply larger than ``cap`` goes as frames.
    Not thread safe: the shard's loop is its one writer."""

    def __init__(self, cluster: str, cap: int = REPLY_CAP, first: int = MIN_REPLY_SEGMENT):
        self.cluster = cluster
        self.cap = cap
        self.first = first
        self.seg: Segment | None = None
        self.table = None                  # the segment's stamp words (a numpy view)
        self.count = 0                     # granules in the segment
        self.data = 0                      # offset of the first granule
        self.head = 0                      # the granule the next reply starts at
        self.stamp = 0
        self.failed: str | None = None     # why the area stopped making segments
        self.stats = collections.Counter()

    @property
    def size(self) -> int:
        return self.seg.size if self.seg is not None else 0

    def _grow(self, need: int) -> bool:
        """A segment of at least ``need`` granules (the old one removed); False when the cap or
        the directory has no room for it (the old one is kept)."""
        g = 1 << GRANULE_SHIFT
        want = max(self.first, 2 * (self.count << GRANULE_SHIFT), need << GRANULE_SHIFT)
        want = min(want, self.cap) // g * g
        if self.failed is not None or need << GRANULE_SHIFT > want:
            return False
        count = want >> GRANULE_SHIFT
        data = HEADER + -(-8 * count // ALIGN) * ALIGN
        try:
            seg = Segment.create(self.cluster, "s", data + want)
        except OSError as e:
            self.failed = str(e)
            log.warning("shared memory for replies stops growing, larger replies go as "
                        "frames: %s", e)
            return False
        seg.view[32:40] = REPLY_MARK
        struct.pack_into("<QQQ", seg.view, 40, GRANULE_SHIFT, count, data)
        self._drop()
        self.seg, self.count, self.data, self.head = seg, count, data, 0
        self.table = seg.words[HEADER >> 3:(HEADER >> 3) + count]
        self.stats["shm_reply_segments"] += 1
        return True

    def place(self, bufs) -> list | None:
        """Write one reply's tensors; their refs ``[segment, offset, stamp]``, or None (send
        them as frames) when the reply is larger than the area can be."""
        if not ORDERED_STORES:
            return None
        views = [memoryview(b).cast("B") for b in bufs]
        offs, total = [], 0
        for v in views:
            offs.append(total)
            total += -(-max(v.nbytes, 1) // ALIGN) * ALIGN
        need = max(1, -(-total >> GRANULE_SHIFT))
        if (self.seg is None or need > self.count) and not self._grow(need):
            self.stats["shm_replies_full"] += 1
            return None
        g0 = self.head if self.head + need <= self.count else 0
        self.head = g0 + need
        self.stamp += 1
        stamps = self.table[g0:g0 + need]
        stamps[:] = _WRITING                 # aligned 8-byte stores, before any byte
        base = self.data + (g0 << GRANULE_SHIFT)
        view, name = self.seg.view, self.seg.name
        for v, off in zip(views, offs):
            if v.nbytes:
                view[base + off:base + off + v.nbytes] = v
        stamps[:] = self.stamp               # after every byte
        self.stats["shm_replies"] += 1
        self.stats["shm_reply_bytes"] += sum(v.nbytes for v in views)
        return [[name, base + off, self.stamp] for off in offs]

    def _drop(self) -> None:
        self.table = None
        if self.seg is not None:
            self.seg.close()
            self.seg = None
        self.count = 0

    def close(self) -> None:
        self._drop()
