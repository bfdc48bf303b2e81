"""The client's weight cache: a state machine fed snapshots and updates, no I/O.

It follows the Clone pattern: subscribe to a partition, then snapshot it at seq S; updates with
seq <= S are dropped, S+1, S+2 ... apply in order, and a gap (seq > last+1) asks for a fresh
snapshot of the partition. Blocks are immutable read-only arrays, replaced, never written, so a
reader holding one never sees it change.

A block a shard published into its weights board on this host may be held as a
:class:`BoardBlock`, a reference to where its bytes are: they are copied once, when a pull
reads the tensor, straight into the array it returns (not once per update and again to join
the blocks). A tensor read whose blocks did not change since the last read is the same array
again (kept by the cache where the blocks are board references, else only while the caller
holds it).

A client that reads weights as frames follows its partitions by conflated delivery (protocol
section 22): its UPDATEs name ``since``, the seq they follow on from, and versions in between
are skipped, not lost; an UPDATE applies when ``since <= last seq < seq`` and one whose
``since`` is above the last seq is a gap. Such a cache (``conflated``) is behind the broker's
heartbeats by design and does not re-snapshot for it.

A partition whose snapshot named, for every block followed, where its shard's board keeps the
block's newest version (a *live* partition: its blocks are :class:`LiveBlock`) needs no
updates at all: a read takes the newest version there, and a block's version is read from the
board too. Its stream is not followed (no seq, no gaps); the partition is snapshot again when a
TABLE says its epoch changed (its primary moved or failed over) or its board slot is gone.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from gradbus.codecs.errors import WireError
from gradbus.codecs.partition import TensorLayout, partition_of

UPDATE_BUFFER = 256  # updates kept per partition while its snapshot is in flight


@dataclass
class Part:
    p: int
    last_seq: int = -1            # last contiguous seq applied; -1 = no stream yet
    resync: bool = True           # a snapshot of every tracked key is in flight
    live: bool = False            # every key a LiveBlock: read from the board, no stream
    keys: set = field(default_factory=set)
    buffered: list = field(default_factory=list)     # (seq, since, blocks)
    # keys added to a partition already in sync, whose snapshot is in flight: the newest update
    # seen for each meanwhile, (seq, array, version), applied if newer than the snapshot
    pending: dict = field(default_factory=dict)


class BoardBlock:
    """A block's bytes in a shard's weights board (a ref ``[segment, offset, stamp]``), read
    through ``mapper`` (a :class:`gradbus.codecs.shm.Mapper`) only when needed."""

    __slots__ = ("mapper", "ref", "dtype", "size")
    ndim = 1

    def __init__(self, mapper, ref, dtype, size: int):
        self.mapper, self.ref, self.dtype, self.size = mapper, ref, np.dtype(dtype), size

    @property
    def shape(self) -> tuple:
        return (self.size,)

    def read_into(self, out: np.ndarray) -> bool:
        """Copy the block into ``out`` (flat, contiguous, of its size); False when the
        shard rewrote it twice since (a newer update is on its way) or its board is gone."""
        try:
            return self.mapper.copy_into(self.ref, memoryview(out).cast("B"))
        except WireError:
            return False

    def read(self) -> np.ndarray | None:
        out = np.empty(self.size, self.dtype)
        return _frozen(out) if self.read_into(out) else None


class LiveBlock:
    """A block read from its shard's board whenever it is read: the newest version there (a
    live ref ``[segment, offset, capacity]``, read through ``mapper``)."""

    __slots__ = ("mapper", "ref", "dtype", "size")
    ndim = 1

    def __init__(self, mapper, ref, dtype, size: int):
        self.mapper, self.ref, self.dtype, self.size = mapper, ref, np.dtype(dtype), size

    @property
    def shape(self) -> tuple:
        return (self.size,)

    def head(self) -> tuple[int, int] | None:
        """``(stamp, version)`` of the newest version there, None when there is none."""
        try:
            return self.mapper.live_version(self.ref)
        except WireError:
            return None

    def read_into(self, out: np.ndarray) -> tuple[int, int] | None:
        """Copy the newest version into ``out``; its ``(stamp, version)``, or None."""
        try:
            return self.mapper.read_live(self.ref, memoryview(out).cast("B"))
        except WireError:
            return None


@dataclass
class Block:
    value: np.ndarray | BoardBlock
    version: int
    seq: int
    pub: int | None = None     # delta weights: the publish seq this value corresponds to


class WeightCache:
    def __init__(self, partitions: int, conflated: bool = False):
        self.P = partitions
        self.conflated = conflated      # followed by conflated delivery: skips are no gaps
        self.layouts: dict[str, TensorLayout] = {}
        self.name_parts: dict[str, tuple] = {}     # name -> the partitions of its blocks
        self.blocks: dict[str, Block] = {}
        self.parts: dict[int, Part] = {}
        self.down: set[int] = set()
        self.tables = 0          # TABLE messages taken: a pull that asked for one waits on it
        self.tier: dict | None = None   # the tier map the last TABLE named (as sent)
        self.stats = {"updates": 0, "stale_updates": 0, "gaps": 0, "snapshots": 0,
                      "board_reads": 0, "board_rewritten": 0, "live_reads": 0}
        # name -> its last read while no block changed (a weakref where its blocks hold the
        # bytes as well: not kept for nobody)
        self.joined: dict[str, np.ndarray | weakref.ref] = {}
        self.joined_stamps: dict[str, tuple] = {}   # name -> its live blocks' stamps then
        self.joined_versions: dict[str, int] = {}   # name -> the version of that read
        # name -> the version of what its last read (tensor, read_into) returned: the oldest
        # version among its blocks as they were copied, not as they are now (a live block
        # may have moved on since)
        self.read_versions: dict[str, int] = {}
        self.epochs: list | None = None     # (epoch, primary) per partition, last TABLE
        self.newly_live: list[int] = []             # partitions that became live (unfollowed)

    # -- tracking ------------------------------------------------------------------------
    def track(self, layout: TensorLayout) -> tuple[list[int], list[str]]:
        """Start following a tensor. Returns (partitions to subscribe, keys to snapshot)."""
        self.layouts[layout.name] = layout
        self.name_parts[layout.name] = tuple(sorted(
            {partition_of(k, self.P) for k in layout.block_keys()}))
        new_parts, keys = [], []
        for key in layout.block_keys():
            p = partition_of(key, self.P)
            part = self.parts.get(p)
            if part is None:
                part = self.parts[p] = Part(p)
                new_parts.append(p)
            if key not in part.keys:
                part.keys.add(key)
                keys.append(key)
                if p not in new_parts:
                    part.pending[key] = None
        return new_parts, keys

    def tracked(self, name: str) -> bool:
        layout = self.layouts.get(name)
        return layout is not None and all(k in self.blocks for k in layout.block_keys())

    def partitions_of(self, name: str) -> set[int]:
        return set(self.name_parts[name])

    def parts_of(self, names) -> tuple:
        """The partitions the blocks of tensors ``names`` (followed ones) are in."""
        np_ = self.name_parts
        return tuple(sorted({p for n in names if n in np_ for p in np_[n]}))

    def parts_behind(self, needs: dict) -> tuple:
        """The partitions holding a block of a tensor below its needed version (``needs``:
        name -> version): those a waiting read asks newer weights of."""
        P, out = self.P, set()
        for name, need in needs.items():
            layout = self.layouts.get(name)
            if layout is None:
                continue
            for k in layout.block_keys():
                blk = self.blocks.get(k)
                if blk is None or self._version(blk) < need:
                    out.add(partition_of(k, P))
        return tuple(sorted(out))

    # -- events --------------------------------------------------------------------------
    def on_snapshot(self, parts: dict, blocks) -> list[int]:
        """Apply a snapshot reply: ``parts`` {p: seq}, ``blocks`` [(key, array, version, base)]
        (``base``: the publish seq the value corresponds to, for delta weights, else None).
        Returns partitions that need another snapshot."""
        self.stats["snapshots"] += 1
        for key, arr, ver, base in blocks:
            p = partition_of(key, self.P)
            seq = int(parts.get(p, 0))
            part = self.parts.get(p)
            newer = part.pending.pop(key, None) if part is not None else None
            if newer is not None and newer[0] > seq:
                seq, arr, ver = newer
                base = seq
            cur = self.blocks.get(key)
            if cur is None or seq >= cur.seq or type(arr) is LiveBlock:
                self.blocks[key] = Block(_frozen(arr), ver, seq, base)
                self.joined.pop(key.rpartition("/")[0], None)
        again = []
        for p, seq in parts.items():
            part = self.parts.get(int(p))
            if part is None or not part.resync:
                continue
            part.resync = False
            part.last_seq = int(seq)
            live = all(k in self.blocks and type(self.blocks[k].value) is LiveBlock
                       for k in part.keys)
            if live:
                part.buffered = []
                if not part.live:
                    part.live = True
                    self.newly_live.append(part.p)
                continue
            part.live = False
            pending, part.buffered = part.buffered, []
            for useq, since, ublocks in sorted(pending, key=lambda x: x[0]):
                if self.on_update(part.p, useq, ublocks, since):
                    again.append(part.p)
                    break
        return again

    def on_update(self, p: int, seq: int, blocks, since: int | None = None) -> bool:
        """Apply one partition update (``since``: conflated delivery's, the seq it follows
        on from; None, the previous seq). Returns True when a gap means a new snapshot is
        needed."""
        part = self.parts.get(p)
        if part is None or part.live:
            return False
        if part.resync:
            if len(part.buffered) < UPDATE_BUFFER:
                part.buffered.append((seq, since, blocks))
            return False
        if seq <= part.last_seq:
            self.stats["stale_updates"] += 1
            return False
        if (seq - 1 if since is None else since) > part.last_seq:
            self.stats["gaps"] += 1
            part.resync = True
            part.buffered = [(seq, since, blocks)]
            return True
        new = {}
        for key, arr, ver, base in blocks:
            cur = self.blocks.get(key)
            if base is not None:
                # a delta: it applies only onto the value published at ``base``
                if key in part.pending or cur is None or seq <= cur.seq:
                    continue
                value = cur.value.read() if type(cur.value) is BoardBlock else cur.value
                if cur.pub != base or value is None or value.shape != arr.shape:
                    self.stats["gaps"] += 1
                    part.resync = True
                    part.buffered = []
                    return True
                new[key] = Block(_frozen(value + arr), ver, seq, seq)
                continue
            if key in part.pending:
                held = part.pending[key]
                if held is None or seq > held[0]:
                    part.pending[key] = (seq, arr, ver)
                continue
            if cur is not None and seq > cur.seq:
                new[key] = Block(_frozen(arr), ver, seq, seq)
        part.last_seq = seq
        self.stats["updates"] += 1
        self.blocks.update(new)
        for key in new:
            self.joined.pop(key.rpartition("/")[0], None)
        return False

    def on_heartbeat(self, ps, seqs) -> list[int]:
        """The broker's last published seq per partition. Returns in-sync partitions that are
        behind it (their tail was dropped); they are put in resync."""
        behind = []
        if self.conflated:      # behind by design; a credit unanswered is the agent's to ask
            return behind
        for p, seq in zip(ps, seqs):
            part = self.parts.get(p)
            if part is not None and not part.resync and not part.live and part.last_seq < seq:
                self.stats["gaps"] += 1
                part.resync = True
                part.buffered = []
                behind.append(p)
        return behind

    def on_table(self, epochs, owners=None, down=()) -> list[int]:
        """A TABLE's partition epochs (and primaries, and partitions down): live partitions
        whose board may be another one now go back to resync, to be snapshot again. That is
        one whose epoch or primary changed since the last TABLE (or that no TABLE named
        before), and one back up after it was down (its shard came back as a new process,
        with a new board, under the same name and epoch). Returns them."""
        key = [None if p in down else (e, owners[p] if owners and p < len(owners) else None)
               for p, e in enumerate(epochs)]
        prev, self.epochs = self.epochs, key
        out = []
        for p, part in self.parts.items():
            if not part.live or part.resync or p >= len(key) or key[p] is None:
                continue
            if prev is None or p >= len(prev) or prev[p] != key[p]:
                part.resync = True
                out.append(p)
        return out

    def forget_table(self) -> list[int]:
        """Another broker process answers now: the partition table the live partitions were
        read under may be another (a restarted broker takes each partition from the first
        shard that names it). Every live partition goes back to resync, and the next TABLE is
        taken as the first. Returns them. A conflated cache's partitions go back to resync
        too, each one: the new broker knows nothing of what this client holds, and a
        partition's delivery starts again from a snapshot taken after it follows it."""
        self.epochs = None
        out = [p for p, part in self.parts.items()
               if (part.live or self.conflated) and not part.resync]
        for p in out:
            self.parts[p].resync = True
        return out

    def live_behind(self, p: int, versions) -> bool:
        """An UPDATE of live partition ``p`` names block versions ``[(key, version)]``; a shard
        writes its board before it publishes, so a board whose block is older than that is
        not the one the partition is published from now (its shard was restarted in place, or
        it moved unseen): the partition goes back to resync. Whether it did."""
        part = self.parts.get(p)
        if part is None or not part.live or part.resync:
            return False
        for key, version in versions:
            blk = self.blocks.get(key)
            if blk is None or type(blk.value) is not LiveBlock:
                continue
            head = blk.value.head()
            if head is None or head[1] < version:
                part.resync = True
                return True
        return False

    def resync(self, keys) -> list[int]:
        """Put the partitions of these keys in resync (their blocks are snapshot again);
        returns those that were in sync."""
        out = []
        for key in keys:
            part = self.parts.get(partition_of(key, self.P))
            if part is not None and not part.resync:
                part.resync = True
                part.buffered = []
                out.append(part.p)
        return out

    def resync_keys(self, p: int) -> list[str]:
        return sorted(self.parts[p].keys)

    # -- reads ---------------------------------------------------------------------------
    def version(self, name: str) -> int:
        layout = self.layouts[name]
        vs = [self._version(self.blocks[k]) for k in layout.block_keys() if k in self.blocks]
        return min(vs) if len(vs) == layout.nblocks else -1

    @staticmethod
    def _version(blk: Block) -> int:
        if type(blk.value) is LiveBlock:
            head = blk.value.head()
            return -1 if head is None else head[1]
        return blk.version

    def tensor(self, name: str) -> np.ndarray | None:
        """The tensor's weights as one read-only array (never changed after), or None when a
        block in a board was rewritten before it was read (:meth:`stale_keys` says which:
        the update that rewrote it is on its way). :attr:`read_versions` then holds the
        version of the array returned."""
        layout = self.layouts[name]
        held = [self.blocks[k] for k in layout.block_keys()]
        stamps = _live_stamps(held)
        joined = self._joined(name)
        if joined is not None and (stamps is None or stamps == self.joined_stamps.get(name)):
            self.read_versions[name] = self.joined_versions[name]
            return joined               # no block changed since the last read
        if len(held) == 1 and stamps is None and type(held[0].value) is not BoardBlock:
            out = held[0].value.reshape(layout.shape)
            self.joined[name] = out
            self.joined_versions[name] = self.read_versions[name] = held[0].version
            return out
        flat = np.empty(layout.size, layout.dtype)
        got = self._fill(held, layout, flat)
        if got is None:
            return None
        boards, read, version = got
        flat.flags.writeable = False
        out = flat.reshape(layout.shape)
        # where its blocks hold the bytes too, kept only while the caller does
        self.joined[name] = out if boards else weakref.ref(out)
        self.joined_versions[name] = self.read_versions[name] = version
        if read:
            self.joined_stamps[name] = read
        return out

    def read_into(self, name: str, out: np.ndarray) -> bool:
        """Copy the tensor's weights into ``out`` (writable, C-contiguous, of its dtype and
        size); False as :meth:`tensor` returns None. :attr:`read_versions` then holds the
        version copied."""
        flat = out.reshape(-1)
        layout = self.layouts[name]
        held = [self.blocks[k] for k in layout.block_keys()]
        stamps = _live_stamps(held)
        joined = self._joined(name)
        if joined is not None and (stamps is None or stamps == self.joined_stamps.get(name)):
            np.copyto(flat, joined.reshape(-1))
            self.read_versions[name] = self.joined_versions[name]
            return True
        got = self._fill(held, layout, flat)
        if got is None:
            return False
        self.read_versions[name] = got[2]
        return True

    def _joined(self, name: str) -> np.ndarray | None:
        joined = self.joined.get(name)
        return joined() if type(joined) is weakref.ref else joined

    def _fill(self, held: list, layout: TensorLayout, flat: np.ndarray) -> tuple | None:
        """Copy the blocks ``held`` into ``flat``: whether one was read from a board, the
        stamps of the live blocks' versions read, and the oldest version copied; None when
        one there was rewritten, or a live one has no version to read."""
        boards, stamps, version = False, [], None
        for i, blk in enumerate(held):
            a, b = layout.block_range(i)
            t = type(blk.value)
            if t is LiveBlock:
                self.stats["live_reads"] += 1
                got = blk.value.read_into(flat[a:b])
                if got is None:
                    return None
                stamps.append(got[0])
                boards = True
                version = got[1] if version is None else min(version, got[1])
                continue
            version = blk.version if version is None else min(version, blk.version)
            if t is not BoardBlock:
                flat[a:b] = blk.value
                continue
            self.stats["board_reads"] += 1
            boards = True
            if not blk.value.read_into(flat[a:b]):
                self.stats["board_rewritten"] += 1
                return None
        return boards, tuple(stamps), version

    def stale_keys(self, name: str) -> list[str]:
        """The tensor's blocks whose board bytes are no longer the version held."""
        out = []
        for k in self.layouts[name].block_keys():
            v = self.blocks[k].value
            if (type(v) is BoardBlock and v.read() is None) or (type(v) is LiveBlock
                                                                 and v.head() is None):
                out.append(k)
        return out

    def unreadable_live(self, name: str) -> bool:
        """Whether a live block of the tensor has no version to read (its board slot was
        given up): no update will come, it must be snapshot again."""
        return any(type(b.value) is LiveBlock and b.value.head() is None
                   for b in (self.blocks.get(k) for k in self.layouts[name].block_keys())
                   if b is not None)

    def live_parts(self, names) -> tuple:
        """The live partitions the tensors ``names`` have blocks in."""
        return tuple(sorted({p for n in names for p in self.partitions_of(n)
                             if p in self.parts and self.parts[p].live}))

    def unavailable(self, name: str) -> set[int]:
        return self.partitions_of(name) & self.down


    # -- invariants --------------------------------------------------------------------
    def validate_state(self) -> None:
        """Assert the cache's invariants (tests call it after every event)."""
        for name, layout in self.layouts.items():
            for key in layout.block_keys():
                part = self.parts.get(partition_of(key, self.P))
                assert part is not None and key in part.keys, f"{name}: {key} not followed"
        for p, part in self.parts.items():
            assert part.p == p and 0 <= p < self.P, (p, part.p)
            assert all(partition_of(k, self.P) == p for k in part.keys), f"partition {p}: keys"
            assert part.pending.keys() <= part.keys, f"partition {p}: pending keys not followed"
            assert len(part.buffered) <= UPDATE_BUFFER, f"partition {p}: buffer over its cap"
            assert part.resync or not part.buffered, f"partition {p}: buffered while in sync"
            assert part.last_seq >= -1
        for p, part in self.parts.items():
            assert not part.live or all(type(self.blocks[k].value) is LiveBlock
                                        for k in part.keys), f"partition {p}: live, not read so"
        for key, block in self.blocks.items():
            v = block.value
            assert type(v) in (BoardBlock, LiveBlock) or not v.flags.writeable, key
            assert v.ndim == 1, key
            assert block.pub is None or block.pub <= block.seq, (key, block.pub, block.seq)
        assert all(v >= 0 for v in self.stats.values()), self.stats
        assert all(0 <= p < self.P for p in self.down)
        assert self.joined.keys() <= self.layouts.keys(), "a read of a tensor not followed"
        assert self.joined.keys() <= self.joined_versions.keys(), "a kept read with no version"
        assert self.read_versions.keys() <= self.layouts.keys(), "a version of no tensor read"


def _live_stamps(held: list) -> tuple | None:
    """The newest stamps of the live blocks among ``held`` (None for one with none), or None
    when there is none."""
    out = [b.value.head() for b in held if type(b.value) is LiveBlock]
    return tuple(h and h[0] for h in out) if out else None


def _frozen(arr):
    if type(arr) in (BoardBlock, LiveBlock):
        return arr
    a = arr.reshape(-1)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


__all__ = ["WeightCache"]
