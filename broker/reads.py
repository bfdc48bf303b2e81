"""Reads: SNAPSHOT and ROWS requests routed to the partitions' primaries (queued behind any
init or push still queued for them, so a client reads its own writes), DIGEST and CHECKPOINT
fanned out to the shards, and the replies passed back to the asker.

A read goes to a shard marked ``shm`` when both the shard and the client read shared memory
(a client says so in its HEARTBEAT, or in the read itself; a read marked ``shm: false`` is a
client asking again, with frames, after a torn reply): the shard may then answer with refs
into its reply area. A reply with refs for a client that does not read shared memory has them
copied out (:class:`~.actions.ReplyClient`)."""
from __future__ import annotations

from collections import defaultdict

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import partition_of, row_key

from .actions import ReplyClient, ToClient, ToShard


class Reads:
    def __init__(self, partitions: int, settings, meters, members, table, catalog, sequencer,
                 consistency):
        self.P = partitions
        self.settings = settings
        self.meters = meters
        self.members = members
        self.table = table
        self.catalog = catalog
        self.sequencer = sequencer
        self.consistency = consistency

    def fanout(self, identity: bytes, h) -> list:
        """DIGEST or CHECKPOINT (typed: ``ps`` checked against P when it was unpacked): ask
        every live shard holding the named partitions (all, by default); the replies go
        straight to the asker (``of`` says how many)."""
        kind, req, ps = h.kind, h.req, h.ps
        targets = [x for x in self.members.shards.values() if x.alive and (
            ps is None or any(self.table.holds(x.id, p) for p in ps))]
        if not targets:
            empty = wire.pack(wire.DIGEST_REPLY, req=req, shard="", parts=[], of=1) \
                if kind == wire.DIGEST else wire.pack(wire.CHECKPOINT_REPLY, req=req, shard="",
                                                      of=1)
            return [ToClient(identity, [empty])]
        extra = {"ps": list(ps)} if ps is not None else {}
        msg = wire.pack(kind, req=req, client=identity, of=len(targets), **extra)
        return [ToShard(x.identity, [msg]) for x in targets]

    @staticmethod
    def _wants_shm(client, h) -> bool:
        """Whether the reply to read ``h`` may reference shared memory, as the client sees it
        (the shard's side is checked at dispatch)."""
        if h.shm:
            client.shm = True      # as its HEARTBEAT would say
        return client.shm if h.shm is None else h.shm

    def snapshot(self, client, h) -> list:
        """A typed SNAPSHOT (its keys are strings)."""
        req = h.req
        shm = self._wants_shm(client, h)
        by_shard: dict[str, list] = defaultdict(list)
        max_bytes, max_keys = self.settings.max_batch_bytes, self.settings.max_batch_entries
        for key in h.keys:
            t, idx = self.catalog.block(key)
            sid = self.table.live_owner(key, partition_of(key, self.P))
            # one reply carries at most max_batch_bytes and max_batch_entries blocks: a
            # shard's heartbeats wait behind it
            chunks = by_shard[sid]
            size = t.layout.block_bytes(idx)
            if not chunks or (chunks[-1][1] and chunks[-1][1] + size > max_bytes) \
                    or len(chunks[-1][0]) >= max_keys:
                chunks.append([[], 0])
            chunks[-1][0].append(key)
            chunks[-1][1] += size
        if not by_shard:
            return [ToClient(client.identity, [wire.pack(wire.SNAPSHOT_REPLY, req=req, parts=[],
                                                         of=1, missing=[])])]
        of = sum(len(c) for c in by_shard.values())
        for sid, chunks in by_shard.items():
            for keys, _ in chunks:
                self.members.shards[sid].queued_snapshots.append(
                    (client.identity, req, keys, of, None, shm))
        return []

    def rows(self, client, h) -> list:
        """A read of table rows (a typed ROWS): ``q`` = [(p, ids), ...]; forwarded to each
        partition's primary. A read of a bsp table with ``min`` is parked until its step is
        applied."""
        req, tbl = h.req, self.catalog.table(h.table)
        shm = self._wants_shm(client, h)
        if self.consistency.must_wait(tbl, h.min):
            self.consistency.park(client.identity, h)
            return []
        by_shard: dict[str, list] = defaultdict(list)
        if h.malformed:
            raise WireError(Code.BAD_FIELD, "rows: q must be [[partition, int64 ids], ...] "
                                            f"with partitions below {self.P}")
        if h.q:
            self.catalog.row_ids(tbl, [(p, wire.row_ids(ids)) for p, ids in h.q])
        for q in h.q:
            key = row_key(tbl.name, q[0])
            by_shard[self.table.live_owner(key, q[0])].append(q)
        if not by_shard:
            return [ToClient(client.identity, [wire.pack(wire.ROWS_REPLY, req=req, of=1)])]
        for sid, qs in by_shard.items():
            self.members.shards[sid].queued_snapshots.append(
                (client.identity, req, [row_key(tbl.name, p) for p, _ in qs], len(by_shard),
                 {"table": tbl.name, "q": qs, "tv": tbl.version}, shm))
        return []

    def wake(self) -> list:
        """Parked reads whose bsp step is now applied go to the shards."""
        return self.consistency.wake(self.catalog.tables, self.rows)

    # ------------------------------------------------------------------ to the shards
    def blocked(self, keys, replaying) -> bool:
        """A snapshot must wait while an init/push for one of its partitions is still queued,
        so that it sees them (a client's init is answered before the blocks exist)."""
        queued = self.sequencer.pending_entries
        if not queued and not replaying:
            return False
        return any((p := partition_of(k, self.P)) in queued or p in replaying for k in keys)

    def has_flushable(self, replaying) -> bool:
        for s in self.members.shards.values():      # asked every loop turn: no generators
            if s.queued_snapshots and s.alive and any(
                    not self.blocked(item[2], replaying) for item in s.queued_snapshots):
                return True
        return False

    def dispatch(self, replaying, actions: list) -> None:
        """Send the queued reads that no queued entry blocks."""
        for s in self.members.shards.values():
            if not s.queued_snapshots or not s.alive:
                continue
            keep = []
            for item in s.queued_snapshots:
                client, req, keys, of, rows, shm = item
                if self.blocked(keys, replaying):
                    keep.append(item)   # an init/push for these partitions is still queued
                    continue
                s.snapshots.append((client, req))
                refs = {"shm": True} if shm and s.shm else {}
                msg = (wire.pack(wire.SNAPSHOT, req=req, client=client, of=of, keys=keys, **refs)
                       if rows is None else wire.pack(wire.ROWS, req=req, client=client, of=of,
                                                      **rows, **refs))
                actions.append(ToShard(s.identity, [msg]))
            s.queued_snapshots = keep

    def replied(self, s, h, frames: list) -> list:
        """A shard's SNAPSHOT/ROWS/DIGEST/CHECKPOINT reply (typed), passed to the asker."""
        client = h.client
        if client is None:
            return []
        if h.kind in (wire.SNAPSHOT_REPLY, wire.ROWS_REPLY):
            try:
                s.snapshots.remove((client, h.req))
            except ValueError:
                pass
            asker = self.members.clients.get(client)
            if wire.has_refs(h.t) and (asker is None or not asker.shm):
                return [ReplyClient(client, frames, [wire.error(
                    Code.SHM_TORN, f"{h.kind}: rewritten in shard {s.id}'s shared memory before "
                                   "it was read; ask again", req=h.req)])]
        return [ToClient(client, frames)]

    def shard_gone(self, s, message: str) -> list:
        """The reads outstanding or queued on a shard that died fail."""
        out = [self.meters.err(client, Code.SHARD_UNAVAILABLE, message, req=req)
               for client, req in s.snapshots + [(c, r) for c, r, *_ in s.queued_snapshots]]
        s.snapshots, s.queued_snapshots = [], []
        return out
