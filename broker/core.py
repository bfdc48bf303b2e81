"""The broker's state machine: routing, the partition table, sequencing, batching, membership,
duplicate suppression and credit flow control. No sockets here.

Each ``on_*`` method takes one event (a message's frames, or a clock tick) with the current
monotonic time and returns a list of actions. An action is a tuple:

* ``(FRONT, identity, frames)`` -- send to a client (frontend ROUTER);
* ``(BACK, identity, frames)``  -- send to a shard (backend ROUTER);
* ``(PUB, frames)``             -- publish on events (XPUB), ``frames[0]`` is the topic.

Tensor frames are passed through as the objects the loop received (``zmq.Frame`` with
``copy=False``): this module reads their length, never their bytes.
"""
from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np

from gradbus.codecs import specs, stats, timing, wire
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import (DEFAULT_PARTITIONS, MAX_NAME_LEN, TensorLayout,
                                      partition_of, row_key, row_partitions, split_key,
                                      split_row_key, table_partitions)

log = logging.getLogger("gradbus.broker")

FRONT, BACK, PUB = "front", "back", "pub"
_ACK = "ack"        # internal: (_ACK, client, msg), coalesced into one ACK per client
ACKED = "acked"     # duplicate-window marker: applied and acknowledged

SHARD_CREDIT = 2                 # batches in flight to one shard before the broker holds back:
                                 # one being applied while the next arrives (more only shrinks
                                 # batches and multiplies weight republishes; see docs)
MAX_BATCH_BYTES = 64 << 20       # one batch message to a shard carries at most this much tensor data
MAX_PENDING_BYTES = 512 << 20    # above this the loop stops reading the frontend (back-pressure)
DEDUPE_WINDOW = 100_000          # (client, msg_id) pairs remembered per client
MAX_PARKED_READS = 10_000        # table reads waiting for a bsp step to be applied
MAX_BLOCKS_PER_TENSOR = 1 << 20  # an INIT asking for more blocks is refused (TOO_LARGE)
MAX_PARAM_BYTES = 1 << 40        # one parameter tensor above this is refused (TOO_LARGE)
MAX_SYNCS = 32                   # partitions catching up on standbys at once ...
MOVE_PACE = 1.0                  # after a move of T seconds, the next waits MOVE_PACE * T:
                                 # moving uses at most about half of the shards' time
RATE_TAU = 10.0                  # seconds: time constant of a partition's update rate
MIN_GAIN = 1e-3                  # a rebalance move must lower the imbalance at least this much
MAX_SYNC_BYTES = 64 << 20        # ... and their bytes (one partition, however large, may go):
                                 # a state in transit delays the heartbeats behind it
ALL = wire.ACKS_ALL


@dataclass
class ShardInfo:
    id: str
    identity: bytes
    last_seen: float
    alive: bool = True
    inflight: int = 0                     # batch messages sent, not yet APPLIED
    partitions: set = field(default_factory=set)
    bytes: int = 0                        # bytes of parameters placed on it
    info: dict = field(default_factory=dict)
    snapshots: list = field(default_factory=list)  # outstanding (client, req)
    queued_snapshots: list = field(default_factory=list)  # (client, req, keys, of, rows)


@dataclass
class ClientInfo:
    identity: bytes
    last_seen: float
    pushes: int = 0
    seen: OrderedDict = field(default_factory=OrderedDict)  # msg_id -> "pending"|ack/err frames
    errors: dict = field(default_factory=lambda: defaultdict(int))  # code -> pushes refused
    rate: float = 0.0              # pushes per second, smoothed over about 5 s
    rate_at: float = 0.0
    staleness: float | None = None     # versions behind on arrival, smoothed


@dataclass
class Pending:
    """A push or init waiting for all its blocks to be applied."""
    client: bytes
    msg: int
    kind: str                      # "push" | "init"
    remaining: int
    error: tuple | None = None     # (code, message)
    reply: dict = field(default_factory=dict)
    acks: int = 1                  # 1: settled when the primary applied; ALL: every replica
    t0: float = 0.0                # when the broker received it
    tables: tuple = ()             # the tables a push carries rows of
    step: bool = False             # released by a bsp barrier


@dataclass
class Batch:
    """One partition's sequenced batch on its way to the replicas."""
    refs: list                     # the Pending ref of each entry, in order
    waiting: set                   # in-sync replicas (at send time) that have not applied it
    errors: dict | None = None     # entry index -> (code, message), from the first APPLIED
    primary_done: bool = False


@dataclass
class Tensor:
    layout: TensorLayout
    opt: dict
    versions: dict = field(default_factory=dict)   # block index -> last version seen
    cons: dict = field(default_factory=lambda: specs.consistency_from_wire(None))

    @property
    def version(self) -> int:
        if len(self.versions) < self.layout.nblocks:
            return 0
        return min(self.versions.values())


@dataclass
class Table:
    """An embedding table: rows spread over every partition (key ``name#p``)."""
    name: str
    cfg: dict                                       # specs.table_from_wire
    rows: dict = field(default_factory=dict)        # p -> [rows, bytes] the primary reported
    applied: int = 0     # pushes to the table applied since this broker started ...
    base: int = 0        # ... on top of this many (learned from the shards after a restart)
    stepping: int = 0    # bsp: pushes of released steps not yet applied

    @property
    def version(self) -> int:
        """Pushes applied to the table (what staleness counts)."""
        return self.base + self.applied

    @property
    def cons(self) -> dict:
        return self.cfg["cons"]      # table_from_wire always fills it in


#: counters exported as ``gradbus_broker_<name>_total``: (name, counters key, help)
_BROKER_COUNTERS = (
    ("pushes_received", "pushes_received", "Pushes accepted from clients."),
    ("pushes_applied", "pushes_applied", "Pushes applied and acknowledged."),
    ("push_wire_bytes", "push_wire_bytes", "Gradient bytes received, as encoded on the wire."),
    ("push_decoded_bytes", "push_decoded_bytes",
     "Gradient bytes received, decoded (dense parameter bytes)."),
    ("batches", "batches", "Batch messages sent to shards."),
    ("duplicates", "duplicates", "Pushes or inits received again (resends) and not applied again."),
    ("failovers", "failovers", "Partitions whose primary was replaced by a standby."),
    ("shard_deaths", "shards_lost",
     "Shards declared dead (silent past liveness, bye, or restarted)."),
    ("fenced_partitions", "fenced_partitions",
     "Stale partitions a returning shard was told to drop."),
    ("partition_moves", "moves", "Partition moves finished (rebalance, drain, a new shard)."),
    ("replayed_batches", "replayed", "Batches replayed from an update log."),
    ("standbys_synced", "standbys_synced",
     "Standbys that finished catching up on a partition."),
)


class BrokerCore:
    def __init__(self, partitions: int = DEFAULT_PARTITIONS, *,
                 shard_credit: int = SHARD_CREDIT, max_batch_bytes: int = MAX_BATCH_BYTES,
                 max_pending_bytes: int = MAX_PENDING_BYTES,
                 max_tensor_bytes: int = wire.MAX_TENSOR_BYTES,
                 heartbeat_interval: float = timing.HEARTBEAT_INTERVAL,
                 liveness: int = timing.LIVENESS,
                 client_liveness: int = timing.CLIENT_LIVENESS,
                 dedupe_window: int = DEDUPE_WINDOW, replicas: int = 1,
                 auto_rebalance: bool = True, log=None, replay=None,
                 replay_until: float | None = None, wall_clock=None,
                 expect_shards: int | None = None,
                 fault_drop: float = 0.0, fault_seed: int = 0, now: float = 0.0):
        if not 1 <= partitions <= 65535:
            raise ValueError("partitions must be in 1..65535")
        if not 1 <= replicas <= 16:
            raise ValueError("replicas must be in 1..16")
        if not 0.0 <= fault_drop < 1.0:
            raise ValueError("fault_drop must be in [0, 1)")
        self.P = partitions
        self.replicas = replicas
        # Fault injection (tests): drop this fraction of pushes in and acks out, seeded.
        self.fault_drop = fault_drop
        self._fault_rng = random.Random(fault_seed)
        self.shard_credit = shard_credit
        self.max_batch_bytes = max_batch_bytes
        self.max_pending_bytes = max_pending_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.hb_interval = heartbeat_interval
        self.liveness = liveness
        self.client_liveness = client_liveness
        self.dedupe_window = dedupe_window
        self.ports = {"events": 0, "backend": 0}
        self.metrics_url: str | None = None     # where this broker's /metrics is served
        self.started = self.now = now
        # After a start, keys the broker does not know may be held by shards that have not
        # registered again yet (the broker restarted). Until the grace ends, a push or snapshot
        # of an unknown key gets RECOVERING (the SDK resends), not UNKNOWN_KEY; so does an
        # init of an unknown tensor once a shard registered holding partitions.
        self.recovery_grace = 2 * (heartbeat_interval * liveness + timing.RECONNECT_MAX)
        self.restarted: bool | None = None   # unknown until a shard registers
        self.last_hb_sent = now

        self.owners: list[str | None] = [None] * partitions      # primaries
        self.standbys: list[list[str]] = [[] for _ in range(partitions)]  # in-sync standbys
        self.syncing: dict[int, dict[str, float]] = defaultdict(dict)  # p -> {shard: since}
        self.pbytes = [0] * partitions                               # parameter bytes per p
        self.pcount = [0] * partitions      # gradients batched into p since the last tick ...
        self.prate = np.zeros(partitions)   # ... folded each tick into a rate (RATE_TAU)
        self.prate_at = now
        self.failovers: list[dict] = []                              # the most recent ones
        # Partition moves (rebalance, drain): p -> {"from", "to", "since"}; the copy catches up
        # like a standby, then takes the place of "from" (the primary's with a new epoch).
        # The update log (broker/log.py), written as batches go out, and a log index to replay:
        # a partition taken from a shard at seq S gets the logged batches after S (up to
        # replay_until, wall clock) before any new one; so does one no shard holds, from 0.
        self.log = log
        self.replay = replay
        self.replay_until = replay_until
        self.replaying: dict[int, list] = {}
        self.replay_done: set[int] = set()
        self.no_relog: set[int] = set()      # replays from this broker's own log
        self.expect_shards = expect_shards   # registered this many: nobody else is coming
        import time as _time
        self.wall = wall_clock or _time.time
        self.moves: dict[int, dict] = {}
        self.next_move_at = 0.0          # moves are paced (MOVE_PACE)
        self.move_log: list[dict] = []
        self.auto_rebalance = auto_rebalance
        self.rebalance_wanted = False
        self.draining: set[str] = set()
        self.adopted: dict[int, tuple] = {}       # p -> (epoch, seq) of a copy taken from a
        self.pending_drops: list = []             # registration (restart / restore)
        self.epochs = [0] * partitions
        self.lost: set[int] = set()
        self.table_version = 0
        self.seq = [0] * partitions
        self.published_seq: dict[int, int] = {}   # p -> last seq whose UPDATE went out on events
        # A moved primary still publishes the batches it was sent as primary: p -> (its id,
        # the last such seq). Subscribers then see no gap, and re-fetch nothing.
        self.handover: dict[int, tuple[str, int, float]] = {}     # ... (id, seq, since)
        self.catalog: dict[str, Tensor] = {}
        self.tables: dict[str, Table] = {}
        self.shards: dict[str, ShardInfo] = {}
        self.by_identity: dict[bytes, str] = {}
        self.clients: dict[bytes, ClientInfo] = {}
        self.pending_entries: dict[int, list] = defaultdict(list)   # p -> [(entry, desc, frame, ref)]
        self.pending_bytes = 0
        self.pending: dict[tuple[bytes, int], Pending] = {}
        self.barriers: dict[str, dict] = {}    # bsp tensor -> the step's held pushes
        self.parked_reads: list = []           # (client, ROWS header) waiting for a bsp step
        self.inflight: dict[tuple[int, int], Batch] = {}             # (p, seq) -> batch
        self.counters: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.h_batch = stats.Histogram(stats.COUNT_BUCKETS)      # entries per batch part
        self.h_visible = stats.Histogram()     # push received -> its weights published
        self.h_ack = stats.Histogram()         # push received -> acknowledged
        self.h_staleness = stats.Histogram(stats.COUNT_BUCKETS)  # versions behind, on arrival
        for recs in (replay.by_p.values() if replay is not None else ()):
            for h, _ in recs:                # tensors the log created are known from the start
                if replay_until is not None and h["time"] > replay_until:
                    continue
                for e in h["e"]:
                    self._catalog_init_entry(e)

    # ------------------------------------------------------------------ helpers
    def accepting(self) -> bool:
        """False while queued tensor bytes exceed the bound: the loop stops reading clients."""
        return self.pending_bytes < self.max_pending_bytes

    def _err(self, identity: bytes, code: Code, message: str, **fields):
        self.errors[code.value] += 1
        return (FRONT, identity, [wire.error(code, message, **fields)])

    def _live(self, shard_id: str | None) -> bool:
        s = self.shards.get(shard_id) if shard_id else None
        return bool(s and s.alive)

    def _client(self, identity: bytes, now: float) -> ClientInfo:
        c = self.clients.get(identity)
        if c is None:
            c = self.clients[identity] = ClientInfo(identity, now)
        c.last_seen = now
        return c

    def _down(self) -> list[int]:
        """Partitions that have an owner on record but no live one."""
        return sorted(p for p in range(self.P)
                      if p in self.lost or (self.owners[p] and not self._live(self.owners[p])))

    def _available(self, p: int) -> bool:
        """A partition can take work: unplaced (placed on first use) or owned by a live shard."""
        return p not in self.lost and (self.owners[p] is None or self._live(self.owners[p]))

    def _table_msg(self) -> list:
        return [wire.TOPIC_TABLE, wire.pack(wire.TABLE, version=self.table_version,
                                            owners=[o or "" for o in self.owners],
                                            standbys=self.standbys, epochs=self.epochs,
                                            down=self._down())]

    def _members(self, p: int) -> list[str]:
        """The in-sync replicas of p: primary first."""
        return [self.owners[p], *self.standbys[p]] if self.owners[p] else []

    def _holds(self, sid: str, p: int) -> bool:
        return sid == self.owners[p] or sid in self.standbys[p] or sid in self.syncing.get(p, ())

    def _place(self, p: int) -> str | None:
        """Owner of partition p, placing it on the live shard holding fewest bytes if new."""
        owner = self.owners[p]
        if owner is not None:
            return owner
        live = [s for s in self.shards.values() if s.alive]
        if not live:
            return None
        live.sort(key=lambda s: (s.bytes, len(s.partitions), s.id))
        s = live[0]
        self.owners[p] = s.id
        self.epochs[p] = 1
        s.partitions.add(p)
        # A new partition is empty, so its standbys are in sync from the first batch.
        for sb in live[1:self.replicas]:
            self.standbys[p].append(sb.id)
            sb.partitions.add(p)
        self.table_version += 1
        return s.id

    # ------------------------------------------------------------------ frontend
    def on_frontend(self, identity: bytes, frames: list, now: float) -> list:
        self.counters["frontend_msgs"] += 1
        self.now = now
        if not frames:
            self.errors[Code.BAD_FRAME.value] += 1
            return []
        try:
            h = wire.unpack_header(frames[0], wire.FRONTEND_KINDS)
        except WireError as e:
            return [self._err(identity, e.code, str(e.args[0]))]
        kind = h["kind"]
        if kind == wire.HELLO:   # discovery only: registers nobody
            return [(FRONT, identity, [wire.pack(wire.WELCOME, events=self.ports["events"],
                                                 backend=self.ports["backend"],
                                                 partitions=self.P, down=self._down(),
                                                 hb=self.hb_interval)])]
        if kind == wire.STATUS:   # ops tools are not workers
            st = self.status(now)
            if h.get("table"):
                st["table"] = self.table()
            return [(FRONT, identity, [wire.pack(wire.STATUS_REPLY, req=h["req"], status=st)])]
        if kind == wire.BYE:
            self.clients.pop(identity, None)
            return []
        if kind in (wire.DIGEST, wire.CHECKPOINT):
            return self._fanout(identity, h)
        if kind == wire.ADMIN:
            return self._admin(identity, h, now)
        if kind == wire.PUSH and self.fault_drop and self._fault_rng.random() < self.fault_drop:
            self.counters["fault_dropped_pushes"] += 1
            return []
        client = self._client(identity, now)
        try:
            if kind == wire.PUSH:
                return self._push(client, h, frames[1:])
            if kind == wire.INIT:
                return self._init(client, h, frames[1:])
            if kind == wire.SNAPSHOT:
                return self._snapshot(client, h, frames[1:])
            if kind == wire.ROWS:
                return self._rows(client, h)
            if kind == wire.CATALOG:
                return self._catalog(client, h)
            return []  # HEARTBEAT: registered above, last_seen updated
        except WireError as e:
            ids = {k: h[k] for k in ("msg", "req") if isinstance(h.get(k), int)}
            return [self._err(identity, e.code, str(e.args[0]), **ids)]
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # a field of an unexpected shape that the schema does not pin down
            ids = {k: h[k] for k in ("msg", "req") if isinstance(h.get(k), int)}
            return [self._err(identity, Code.BAD_FIELD, f"{kind}: malformed ({e!r})", **ids)]

    def _fanout(self, identity: bytes, h: dict) -> list:
        """DIGEST or CHECKPOINT: ask every live shard holding the named partitions (all, by
        default); the replies go straight to the asker (``of`` says how many)."""
        kind, req, ps = h["kind"], h["req"], h.get("ps")
        if ps is not None and (not isinstance(ps, list) or not all(
                isinstance(p, int) and 0 <= p < self.P for p in ps)):
            return [self._err(identity, Code.BAD_FIELD, f"{kind}: ps must be a list of "
                                                        "partition numbers", req=req)]
        targets = [x for x in self.shards.values() if x.alive and (
            ps is None or any(self._holds(x.id, p) for p in ps))]
        if not targets:
            empty = wire.pack(wire.DIGEST_REPLY, req=req, shard="", parts=[], of=1) \
                if kind == wire.DIGEST else wire.pack(wire.CHECKPOINT_REPLY, req=req, shard="",
                                                      of=1)
            return [(FRONT, identity, [empty])]
        extra = {"ps": ps} if ps is not None else {}
        msg = wire.pack(kind, req=req, client=identity, of=len(targets), **extra)
        return [(BACK, x.identity, [msg]) for x in targets]

    def _replay(self, client: ClientInfo, msg: int) -> list | None:
        """The answer to a msg id already seen (duplicate suppression), else None."""
        seen = client.seen.get(msg)
        if seen is None:
            return None
        self.counters["duplicates"] += 1
        if seen == "pending":
            return []
        if seen == ACKED:
            return [(FRONT, client.identity, [wire.pack(wire.ACK, msg=msg)])]
        return [(FRONT, client.identity, seen)]

    def _block(self, key: str) -> tuple[Tensor, int]:
        """The catalog entry and block index of an initialised block key, or UNKNOWN_KEY."""
        try:
            name, idx = split_key(key)
        except ValueError:
            raise WireError(Code.UNKNOWN_KEY, f"{key!r} is not a block key") from None
        t = self.catalog.get(name)
        if t is None or idx >= t.layout.nblocks:
            self._check_recovering(key, True)
            raise WireError(Code.UNKNOWN_KEY, f"{key} was never initialised")
        return t, idx

    def _table(self, name) -> Table:
        """An initialised table, or UNKNOWN_KEY (RECOVERING while a restarted broker may
        still hear of it from its shards)."""
        tbl = self.tables.get(name) if isinstance(name, str) else None
        if tbl is None:
            self._check_recovering(f"table {name!r}", True)
            raise WireError(Code.UNKNOWN_KEY, f"table {name!r} was never initialised")
        return tbl

    def _row_ids(self, tbl: Table, parts: list) -> None:
        """Check that every row id sent for ``tbl`` in a partition lives there (a client that
        placed rows by another rule would split a row in two). ``parts``: [(p, ids)]."""
        for p, _ in parts:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.P:
                raise WireError(Code.BAD_FIELD, f"{tbl.name}: partition {p!r} out of range")
        ids = np.concatenate([i for _, i in parts]) if len(parts) > 1 else parts[0][1]
        want = np.repeat([p for p, _ in parts], [len(i) for _, i in parts])
        bad = np.flatnonzero(row_partitions(tbl.name, ids, self.P, tbl.cfg.get("spread", 0))
                             != want)
        if len(bad):
            raise WireError(Code.BAD_FIELD, f"{tbl.name}: row id {ids[bad[0]]} sent for "
                                            f"partition {want[bad[0]]}, which it does not "
                                            "belong to")

    def _rows_of(self, d) -> tuple[Table, int]:
        """The table and partition of a pushed rows frame, checked."""
        name_p = split_row_key(d.key)
        if name_p is None:
            raise WireError(Code.BAD_FIELD, f"{d.key!r} carries row ids but is not a row key")
        tbl = self._table(name_p[0])
        cfg = tbl.cfg
        if d.dtype != cfg["dtype"] or d.shape[1] != cfg["dim"]:
            raise WireError(Code.BAD_SHAPE, f"{d.key}: rows {d.dtype}{list(d.shape)} do not "
                                            f"match {cfg['dtype']}[n, {cfg['dim']}]")
        if tcodec.parse_stages(d.codec).sparsifier is not None:
            raise WireError(Code.BAD_CODEC, f"{d.key}: rows take a dense codec chain, not "
                                            f"{d.codec!r}")
        if not 0 <= name_p[1] < self.P:
            raise WireError(Code.BAD_FIELD, f"{d.key}: partition out of range")
        return tbl, name_p[1]

    def _check_recovering(self, what: str, known_elsewhere: bool) -> None:
        """RECOVERING while the broker is young and the thing asked for may exist on a shard
        that has not registered again yet."""
        if self.replay is None and self.restarted is False or self._recovered():
            return      # a fresh cluster (its first shard held nothing), or recovered
        if self.restarted or known_elsewhere:
            self.counters["recovering_refusals"] += 1
            raise WireError(Code.RECOVERING, f"{what}: the broker started "
                                             f"{self.now - self.started:.1f}s ago and is still "
                                             "hearing from its shards; try again")

    def _live_owner(self, key: str, p: int) -> str:
        """The live shard owning partition p, or SHARD_UNAVAILABLE."""
        owner = self.owners[p]
        if p in self.lost or not self._live(owner):
            raise WireError(Code.SHARD_UNAVAILABLE,
                            f"{key}: partition {p} has no live shard (owner {owner or 'none'})")
        return owner

    def _push(self, client: ClientInfo, h: dict, frames: list) -> list:
        msg = h["msg"]
        replay = self._replay(client, msg)
        if replay is not None:
            return replay
        descs = wire.parse_tensors(h, frames, self.max_tensor_bytes)
        routed = []
        decoded = 0
        tensors: dict[str, Tensor] = {}
        rows: dict[str, list] = {}
        for d, fr in zip(descs, frames):
            if d.ids is not None:             # a table's rows for one partition
                tbl, p = self._rows_of(d)
                self._live_owner(d.key, p)
                routed.append((p, d, fr, tbl.name))
                rows.setdefault(tbl.name, []).append((p, d.row_ids()))
                tensors[tbl.name] = tbl
                decoded += d.shape[0] * d.shape[1] * tcodec.DTYPES[d.dtype].itemsize
                continue
            t, idx = self._block(d.key)
            start, stop = t.layout.block_range(idx)
            if d.shape != (stop - start,) or d.dtype != t.layout.dtype:
                raise WireError(Code.BAD_SHAPE, f"{d.key}: gradient {d.dtype}{list(d.shape)} does "
                                                f"not match {t.layout.dtype}[{stop - start}]")
            p = partition_of(d.key, self.P)
            self._live_owner(d.key, p)
            routed.append((p, d, fr, t.layout.name))
            tensors[t.layout.name] = t
            decoded += t.layout.block_bytes(idx)
        if not routed:
            raise WireError(Code.BAD_REQUEST, "push carries no tensors")
        for name, parts in rows.items():      # one vectorized check per table
            self._row_ids(self.tables[name], parts)
        acks = h["acks"]
        if acks not in (0, 1, ALL):
            raise WireError(Code.BAD_FIELD, f"acks must be 0, 1 or {ALL} (all), not {acks}")
        ver = h.get("ver")
        ver = ver if isinstance(ver, int) and not isinstance(ver, bool) else None
        weights, bsp = self._consistency(tensors, ver, client)
        self.counters["push_wire_bytes"] += sum(d.nbytes for d in descs)
        self.counters["push_decoded_bytes"] += decoded
        self._remember(client, msg, "pending")
        client.pushes += 1
        self._client_rate(client)
        self.counters["pushes_received"] += 1
        if bsp is not None:    # held until the step's gradients are all in
            bsp["held"].append((client, h, routed, weights))
            bsp["clients"].add(client.identity)
            self.counters["bsp_held"] += 1
            return self._release_barriers()
        self._enqueue_push(client, h, routed, weights)
        return []

    def _consistency(self, tensors: dict, ver: int | None, client: ClientInfo):
        """Staleness of a push against each tensor's consistency model: refuses it (STALE),
        returns per-tensor gradient weights (staleness-scaled learning rate) and, for a bsp
        tensor, the barrier to hold it at."""
        weights, barrier = {}, None
        modes = {t.cons["mode"] for t in tensors.values()}
        if "bsp" in modes and len({(t.cons["mode"], t.cons["n"]) for t in tensors.values()}) > 1:
            raise WireError(Code.BAD_REQUEST, "a push with a bsp tensor may only carry tensors "
                                              "of the same bsp setting")
        for name, t in tensors.items():
            if ver is None:
                if t.cons["mode"] == "bsp":
                    raise WireError(Code.BAD_REQUEST, f"{name} is bsp: a push must say which "
                                                      "version it was computed on (ver)")
                continue
            st = max(0, t.version - ver)
            self.h_staleness.observe(st)
            client.staleness = st if client.staleness is None else \
                0.9 * client.staleness + 0.1 * st
            if t.cons["mode"] == "ssp" and t.cons["policy"] == "refuse" and st > t.cons["n"]:
                client.errors[Code.STALE.value] += 1
                raise WireError(Code.STALE, f"{name}: computed on version {ver}, {st} behind "
                                            f"{t.version} (ssp allows {t.cons['n']})")
            if t.cons["mode"] == "bsp":
                if ver < t.version:
                    client.errors[Code.STALE.value] += 1
                    raise WireError(Code.STALE, f"{name}: step {ver} is over (now {t.version})")
                barrier = self.barriers.setdefault(name, {"held": [], "clients": set(),
                                                          "n": t.cons["n"], "tensor": t})
            if t.cons["scale"] and st > 1:
                weights[name] = 1.0 / st
        return weights, barrier

    def _client_rate(self, c: ClientInfo) -> None:
        """An exponentially smoothed push rate (time constant 5 s)."""
        dt = max(self.now - c.rate_at, 1e-6)
        decay = math.exp(-dt / 5.0)
        c.rate = c.rate * decay + (1 - decay) / dt
        c.rate_at = self.now

    def _release_barriers(self) -> list:
        """Release every bsp step whose gradients are in: from N workers, or from every
        connected client when fewer than N are connected (workers join and leave between
        steps; one that disappears is forgotten after its liveness window)."""
        actions = []
        for name, b in list(self.barriers.items()):
            if not b["held"] or len(b["clients"]) < min(b["n"], max(1, len(self.clients))):
                continue
            del self.barriers[name]
            for client, h, routed, weights in b["held"]:
                self._enqueue_push(client, h, routed, weights, step=True)
            self.counters["bsp_steps"] += 1
        return actions

    def _enqueue_push(self, client: ClientInfo, h: dict, routed: list, weights: dict,
                      step: bool = False) -> None:
        msg = h["msg"]
        ref = (client.identity, msg)
        tables = tuple({n for (_, d, _, n) in routed if d.ids is not None})
        self.pending[ref] = Pending(client.identity, msg, "push", len(routed),
                                    acks=ALL if h["acks"] == ALL else 1, t0=self.now,
                                    tables=tables, step=step)
        if step:
            for name in tables:
                self.tables[name].stepping += 1
        ts = None
        for (p, d, fr, name), raw in zip(routed, h["t"]):
            entry = {"op": "push", "c": client.identity, "m": msg}
            if d.ids is not None:     # rows: the time that row expiry counts from, the same
                if ts is None:        # on every replica
                    ts = round(self.wall(), 3)
                entry["ts"] = ts
            w = weights.get(name)
            if w is not None:
                entry["w"] = w
            self._enqueue(p, entry, raw, fr, ref)

    def _remember(self, client: ClientInfo, msg: int, value) -> None:
        client.seen[msg] = value
        if len(client.seen) > self.dedupe_window:
            client.seen.popitem(last=False)

    def _enqueue(self, p: int, entry: dict, raw_desc, frame, ref) -> None:
        self.pending_entries[p].append((entry, raw_desc, frame, ref))
        if frame is not None:
            self.pending_bytes += wire.frame_len(frame)

    def _init(self, client: ClientInfo, h: dict, frames: list) -> list:
        msg = h["msg"]
        replay = self._replay(client, msg)
        if replay is not None:
            return replay
        opt = h["opt"]
        if specs.optimizer_from_wire(opt).name == "ftrl" and h["tensors"]:
            raise WireError(Code.BAD_FIELD, "ftrl optimizes embedding table rows only "
                                            "(init_table)")
        try:
            cons = specs.consistency_from_wire(h.get("cons"))
        except ValueError as e:
            raise WireError(Code.BAD_FIELD, f"init: {e}") from None
        descs = wire.parse_tensors(h, frames, self.max_tensor_bytes)
        given = {d.key: (d, raw, fr) for d, raw, fr in zip(descs, h.get("t", []), frames)}
        created, existing, plan = [], [], []
        for t in h["tensors"]:
            layout, rule = self._check_tensor(t)
            cur = self.catalog.get(layout.name)
            if layout.name in self.tables:
                raise WireError(Code.SHAPE_MISMATCH, f"{layout.name} exists as a table")
            if cur is None:
                self._check_recovering(f"init of {layout.name}", False)
            if cur is not None:
                if cur.layout.dtype != layout.dtype or cur.layout.shape != layout.shape:
                    raise WireError(Code.SHAPE_MISMATCH,
                                    f"{layout.name} exists as {cur.layout.dtype}"
                                    f"{list(cur.layout.shape)}, init asks "
                                    f"{layout.dtype}{list(layout.shape)}")
                existing.append(layout.name)
                continue
            if layout.name in created:
                raise WireError(Code.BAD_REQUEST, f"{layout.name} named twice")
            for i, key in enumerate(layout.block_keys()):
                p = partition_of(key, self.P)
                if not self._available(p):
                    raise WireError(Code.SHARD_UNAVAILABLE,
                                    f"{key}: partition {p} has no live shard "
                                    f"(owner {self.owners[p]})")
                g = None
                if rule["name"] == "given":
                    g = given.get(key)
                    start, stop = layout.block_range(i)
                    if g is None or g[0].shape != (stop - start,) or g[0].dtype != layout.dtype:
                        raise WireError(Code.BAD_SHAPE, f"{key}: initial values missing or not "
                                                        f"{layout.dtype}[{stop - start}]")
                plan.append((layout, rule, key, g))
            created.append(layout.name)
        new_tables = self._plan_tables(h.get("tables"), created, existing)
        if (plan or new_tables) and not any(s.alive for s in self.shards.values()):
            raise WireError(Code.NO_SHARDS, "no live shard to place parameters on")
        ref = (client.identity, msg)
        if not plan and not new_tables:
            reply = [wire.pack(wire.INIT_OK, msg=msg, created=[], existing=existing)]
            self._remember(client, msg, reply)
            return [(FRONT, client.identity, reply)]
        # all checks passed: mutate
        layouts = {}
        for layout, rule, key, g in plan:
            layouts[layout.name] = layout
            p = partition_of(key, self.P)
            self._place(p)
            self._account(p, layout.block_bytes(split_key(key)[1]))
            entry = {"op": "init", "key": key, "layout": layout.to_wire(), "rule": rule,
                     "opt": opt}
            self._enqueue(p, entry, g[1] if g else None, g[2] if g else None, ref)
        for name, layout in layouts.items():
            self.catalog[name] = Tensor(layout, opt, cons=cons)
        for name, cfg in new_tables:     # each of its partitions gets the table's (empty) rows
            for p in table_partitions(name, self.P, cfg["spread"]).tolist():
                self._place(p)
                self._enqueue(p, {"op": "init", "key": row_key(name, p), "table": cfg},
                              None, None, ref)
            self.tables[name] = Table(name, cfg)
        self.pending[ref] = Pending(client.identity, msg, "init", len(plan) + sum(
            len(table_partitions(n, self.P, c["spread"])) for n, c in new_tables),
                                    reply={"created": created, "existing": existing})
        self._remember(client, msg, "pending")
        actions = [(PUB, self._table_msg())]
        return actions

    def _plan_tables(self, tables, created: list, existing: list) -> list:
        """The tables of an INIT that are new: ``[(name, settings)]``; existing ones (same
        dim and dtype) go to ``existing``."""
        if tables is None:
            return []
        if not isinstance(tables, list):
            raise WireError(Code.BAD_FIELD, "init: tables must be a list")
        new = []
        for t in tables:
            if not isinstance(t, dict):
                raise WireError(Code.BAD_FIELD, "init tables must be maps")
            name = t.get("name")
            if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or any(
                    c in name for c in "\x00#"):
                raise WireError(Code.BAD_FIELD, f"table name must be a non-empty string "
                                                f"without '#', got {name!r}")
            cfg = specs.table_from_wire(t)
            cur = self.tables.get(name)
            if name in self.catalog or name in created:
                raise WireError(Code.SHAPE_MISMATCH, f"{name} exists as a dense tensor or is "
                                                     "named twice")
            if cur is not None:
                if (cur.cfg["dim"], cur.cfg["dtype"]) != (cfg["dim"], cfg["dtype"]):
                    raise WireError(Code.SHAPE_MISMATCH,
                                    f"table {name} exists with rows of {cur.cfg['dtype']}"
                                    f"[{cur.cfg['dim']}], init asks {cfg['dtype']}[{cfg['dim']}]")
                existing.append(name)
                continue
            self._check_recovering(f"init of table {name}", False)
            down = [p for p in table_partitions(name, self.P, cfg["spread"]).tolist()
                    if not self._available(p)]
            if down:
                raise WireError(Code.SHARD_UNAVAILABLE, f"table {name}: partitions {down[:8]} "
                                                        "have no live shard")
            new.append((name, cfg))
            created.append(name)
        return new

    def _check_tensor(self, t) -> tuple[TensorLayout, dict]:
        if not isinstance(t, dict):
            raise WireError(Code.BAD_FIELD, "init tensors must be maps")
        name, dtype, shape, block = t.get("name"), t.get("dtype"), t.get("shape"), t.get("block")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or "\x00" in name:
            raise WireError(Code.BAD_FIELD, f"tensor name must be a non-empty string, got {name!r}")
        if dtype not in tcodec.PARAM_DTYPES:
            raise WireError(Code.BAD_DTYPE, f"{name}: parameters must be float32 or float64, "
                                            f"not {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > wire.MAX_NDIM or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 < s < 2**40 for s in shape)):
            raise WireError(Code.BAD_SHAPE, f"{name}: shape must be a list of positive ints")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise WireError(Code.BAD_FIELD, f"{name}: block must be a positive int")
        layout = TensorLayout(name, dtype, tuple(shape), block)
        itemsize = 8 if dtype == "float64" else 4
        if min(block, layout.size) * itemsize > self.max_tensor_bytes:
            raise WireError(Code.TOO_LARGE, f"{name}: block of {block} elements above the cap")
        if layout.size * itemsize > MAX_PARAM_BYTES or layout.nblocks > MAX_BLOCKS_PER_TENSOR:
            raise WireError(Code.TOO_LARGE, f"{name}: {layout.size} elements in {layout.nblocks} "
                                            f"blocks is above the limits ({MAX_PARAM_BYTES} B, "
                                            f"{MAX_BLOCKS_PER_TENSOR} blocks)")
        rule = specs.validate_init_rule(t.get("init", {"name": "given"}))
        return layout, rule

    def _snapshot(self, client: ClientInfo, h: dict, frames: list) -> list:
        req = h["req"]
        by_shard: dict[str, list] = defaultdict(list)
        for key in h["keys"]:
            if not isinstance(key, str):
                raise WireError(Code.BAD_FIELD, "snapshot keys must be strings")
            t, idx = self._block(key)
            sid = self._live_owner(key, partition_of(key, self.P))
            # one reply carries at most max_batch_bytes: a shard's heartbeats wait behind it
            chunks = by_shard[sid]
            size = t.layout.block_bytes(idx)
            if not chunks or (chunks[-1][1] and chunks[-1][1] + size > self.max_batch_bytes):
                chunks.append([[], 0])
            chunks[-1][0].append(key)
            chunks[-1][1] += size
        if not by_shard:
            return [(FRONT, client.identity, [wire.pack(wire.SNAPSHOT_REPLY, req=req, parts=[],
                                                        of=1, missing=[])])]
        of = sum(len(c) for c in by_shard.values())
        for sid, chunks in by_shard.items():
            for keys, _ in chunks:
                self.shards[sid].queued_snapshots.append((client.identity, req, keys, of, None))
        return []

    def _wake_reads(self) -> list:
        """Forward the parked reads of bsp tables whose step is now applied."""
        actions, keep = [], []
        for ident, h in self.parked_reads:
            tbl = self.tables.get(h["table"])
            client = self.clients.get(ident)
            if client is None or tbl is None:
                continue
            if tbl.stepping or tbl.version < h["min"]:
                keep.append((ident, h))
                continue
            try:
                actions += self._rows(client, h)
            except WireError as e:
                actions.append(self._err(ident, e.code, str(e.args[0]), req=h["req"]))
        self.parked_reads = keep
        return actions

    def _rows(self, client: ClientInfo, h: dict) -> list:
        """A read of table rows: ``q`` = [[p, ids], ...]; forwarded to each partition's
        primary behind any push still queued for it (a client reads its own writes). A read
        of a bsp table with ``min`` waits until the table reached that version and no step
        is being applied."""
        req, tbl = h["req"], self._table(h["table"])
        need = h.get("min")
        if (isinstance(need, int) and tbl.cons["mode"] == "bsp"
                and (tbl.stepping or tbl.version < need)):
            if len(self.parked_reads) >= MAX_PARKED_READS:
                raise WireError(Code.BAD_REQUEST, "too many reads waiting for bsp steps")
            self.parked_reads.append((client.identity, h))
            return []
        by_shard: dict[str, list] = defaultdict(list)
        for q in h["q"]:
            if (not isinstance(q, list) or len(q) != 2 or not isinstance(q[1], bytes)
                    or len(q[1]) % 8):
                raise WireError(Code.BAD_FIELD, "rows: q must be [[partition, int64 ids], ...]")
        if h["q"]:
            self._row_ids(tbl, [(p, wire.row_ids(ids)) for p, ids in h["q"]])
        for q in h["q"]:
            key = row_key(tbl.name, q[0])
            by_shard[self._live_owner(key, q[0])].append(q)
        if not by_shard:
            return [(FRONT, client.identity, [wire.pack(wire.ROWS_REPLY, req=req, of=1)])]
        for sid, qs in by_shard.items():
            self.shards[sid].queued_snapshots.append(
                (client.identity, req, [row_key(tbl.name, p) for p, _ in qs], len(by_shard),
                 {"table": tbl.name, "q": qs, "tv": tbl.version}))
        return []

    def _catalog(self, client: ClientInfo, h: dict) -> list:
        names = h.get("names")
        if names is not None and not isinstance(names, list):
            raise WireError(Code.BAD_FIELD, "names must be a list")
        sel = self.catalog if names is None else {n: self.catalog[n] for n in names
                                                  if isinstance(n, str) and n in self.catalog}
        tensors = [{**t.layout.to_wire(), "version": t.version, "cons": t.cons}
                   for t in sel.values()]
        tables = [{"name": t.name, **t.cfg, "version": t.version} for n, t in self.tables.items()
                  if names is None or n in names]
        return [(FRONT, client.identity, [wire.pack(wire.CATALOG_REPLY, req=h["req"],
                                                    tensors=tensors, tables=tables)])]

    # ------------------------------------------------------------------ batching
    def _group(self, p: int) -> tuple:
        """Who receives p's batches: (primary, in-sync standbys, standbys catching up)."""
        return (self.owners[p], tuple(self.standbys[p]), tuple(self.syncing.get(p, ())))

    def _can_send(self, group: tuple) -> bool:
        """Every in-sync replica is alive and has credit (the slowest one paces the partition;
        a standby catching up only buffers and does not)."""
        primary, standbys, _ = group
        for sid in (primary, *standbys):
            sh = self.shards.get(sid)
            if sh is None or not sh.alive or sh.inflight >= self.shard_credit:
                return False
        return True

    def _send_group(self, group: tuple, msg: list, actions: list) -> None:
        """One BATCH to every live receiver of a replica group; each uses a credit."""
        for sid in (group[0], *group[1], *group[2]):
            sh = self.shards.get(sid)
            if sh is not None and sh.alive:
                sh.inflight += 1
                actions.append((BACK, sh.identity, msg))

    def flush(self, now: float) -> list:
        """Turn pending entries into sequenced batches: one message per replica group that has
        credit, the same header and tensor frames to every replica of those partitions."""
        actions = []
        if self.replaying:
            self._flush_replay(actions)
        if not self.pending_entries and not any(s.queued_snapshots for s in self.shards.values()):
            return actions
        groups: dict[tuple, list[int]] = defaultdict(list)
        for p in self.pending_entries:
            if p not in self.replaying:        # logged batches go first
                groups[self._group(p)].append(p)
        for group, parts in groups.items():
            if not self._can_send(group):
                continue
            primary, standbys, _ = group
            header_parts, t_list, frames, nbytes = [], [], [], 0
            for p in parts:
                if nbytes >= self.max_batch_bytes:
                    break
                entries = self.pending_entries[p]
                take = 0
                for entry, raw, fr, ref in entries:
                    size = wire.frame_len(fr) if fr is not None else 0
                    if take and nbytes + size > self.max_batch_bytes:
                        break
                    nbytes += size
                    take += 1
                batch, rest = entries[:take], entries[take:]
                if rest:
                    self.pending_entries[p] = rest
                else:
                    del self.pending_entries[p]
                self.seq[p] += 1
                ents, refs = [], []
                for entry, raw, fr, ref in batch:
                    e = dict(entry)
                    if fr is not None:
                        e["i"] = len(frames)
                        t_list.append(raw)
                        frames.append(fr)
                        self.pending_bytes -= wire.frame_len(fr)
                    ents.append(e)
                    refs.append(ref)
                header_parts.append({"p": p, "seq": self.seq[p], "epoch": self.epochs[p],
                                     "o": primary, "e": ents})
                self.pcount[p] += len(ents)
                self.h_batch.observe(len(ents))
                self.inflight[(p, self.seq[p])] = Batch(refs, {primary, *standbys})
            hdr = wire.pack(wire.BATCH, t_list, parts=header_parts)
            if self.log is not None:
                self.log.append(header_parts, t_list, frames, self.wall())
            self.counters["batches"] += 1
            self.counters["batched_entries"] += sum(len(x["e"]) for x in header_parts)
            self._send_group(group, [hdr, *frames], actions)
        for s in self.shards.values():
            if not s.queued_snapshots or not s.alive:
                continue
            keep = []
            for item in s.queued_snapshots:
                client, req, keys, of, rows = item
                if self._snapshot_blocked(keys):
                    keep.append(item)   # an init/push for these partitions is still queued
                    continue
                s.snapshots.append((client, req))
                msg = (wire.pack(wire.SNAPSHOT, req=req, client=client, of=of, keys=keys)
                       if rows is None else wire.pack(wire.ROWS, req=req, client=client, of=of,
                                                      **rows))
                actions.append((BACK, s.identity, [msg]))
            s.queued_snapshots = keep
        return actions

    def has_flushable(self) -> bool:
        """True when flush() would send something now (every in-sync replica has credit)."""
        if any(self._can_send(self._group(p)) for p in self.replaying):
            return True
        for p in self.pending_entries:
            if p not in self.replaying and self._can_send(self._group(p)):
                return True
        return any(s.alive and any(not self._snapshot_blocked(item[2])
                                   for item in s.queued_snapshots)
                   for s in self.shards.values())

    def _snapshot_blocked(self, keys) -> bool:
        """A snapshot must wait while an init/push for one of its partitions is still queued,
        so that it sees them (a client's init is answered before the blocks exist)."""
        if not self.pending_entries and not self.replaying:
            return False
        return any((p := partition_of(k, self.P)) in self.pending_entries or p in self.replaying
                   for k in keys)

    # ------------------------------------------------------------------ backend
    def on_backend(self, identity: bytes, frames: list, now: float) -> list:
        self.counters["backend_msgs"] += 1
        self.now = now
        try:
            h = wire.unpack_header(frames[0], wire.BACKEND_KINDS) if frames else None
            if h is None:
                raise WireError(Code.BAD_FRAME, "empty message")
        except WireError as e:
            self.errors[e.code.value] += 1
            return [(BACK, identity, [wire.error(e.code, str(e.args[0]))])]
        kind = h["kind"]
        if kind == wire.REGISTER:
            return self._register(identity, h, now)
        sid = self.by_identity.get(identity)
        s = self.shards.get(sid) if sid else None
        if s is None or not s.alive:
            # Unknown or declared dead: it must register again before anything else counts.
            self.errors[Code.NOT_REGISTERED.value] += 1
            return [(BACK, identity, [wire.error(Code.NOT_REGISTERED, "send register first")])]
        s.last_seen = now
        if kind == wire.HEARTBEAT:
            if isinstance(h.get("info"), dict):
                s.info = h["info"]
            return []
        if kind == wire.APPLIED:
            try:
                return self._applied(s, h, frames[1:])
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
                # A shard bug, not a client's: count it loudly; the credit was returned.
                self.errors["bad_applied"] += 1
                log.error("malformed APPLIED from %s: %r", s.id, e)
                return []
        if kind in (wire.SNAPSHOT_REPLY, wire.ROWS_REPLY):
            client = h.get("client")
            if isinstance(client, bytes):
                try:
                    s.snapshots.remove((client, h["req"]))
                except ValueError:
                    pass
                return [(FRONT, client, frames)]
            return []
        if kind in (wire.DIGEST_REPLY, wire.CHECKPOINT_REPLY):
            client = h.get("client")
            return [(FRONT, client, frames)] if isinstance(client, bytes) else []
        if kind == wire.STATE:
            return self._forward_state(s, h, frames)
        if kind == wire.SYNCED:
            return self._synced(s, h, now)
        if kind == wire.ERROR:
            self.errors["shard_" + str(h["code"])] += 1
            log.warning("shard %s reports %s: %s", s.id, h["code"], h["message"])
            return []
        if kind == wire.BYE:
            return self._shard_dead(s, now, "said bye")
        return []

    def _register(self, identity: bytes, h: dict, now: float) -> list:
        sid = h["shard"]
        held = h.get("holds", [])
        if (not sid or len(sid) > 128 or not isinstance(held, list)
                or not all(isinstance(x, list) and len(x) == 3 and all(isinstance(v, int) for v in x)
                           and 0 <= x[0] < self.P for x in held)):
            self.errors[Code.BAD_FIELD.value] += 1
            return [(BACK, identity, [wire.error(Code.BAD_FIELD,
                                                 "register: bad shard id or holds")])]
        holds = {p: (epoch, seq) for p, epoch, seq in held}
        if holds or h.get("rejoin") is True:
            self.restarted = True   # shards from an earlier life: this broker may miss tensors
        elif self.restarted is None:
            self.restarted = False  # the first shard is new and holds nothing: a fresh cluster
        s = self.shards.get(sid)
        actions = []
        drop = []
        if s is None:
            s = self.shards[sid] = ShardInfo(sid, identity, now)
            log.info("shard %s registered", sid)
            if self.auto_rebalance and not holds and any(
                    x.partitions for x in self.shards.values()):
                self.rebalance_wanted = True     # a new, empty shard: give it a share
        else:
            if s.alive:
                actions += self._shard_dead(s, now, "re-registered")
            # A sole owner that comes back without its partitions lost them, unless the update
            # log holds them from the start; one that comes back behind is brought up to date.
            own_log: list = []        # this broker's log, read once for all its partitions
            for p in list(s.partitions):
                if self.owners[p] == sid and p not in holds:
                    if self._replay_own_log(p, 0, own_log):
                        self.lost.discard(p)
                    else:
                        self.lost.add(p)
                elif self.owners[p] != sid:
                    s.partitions.discard(p)
                elif holds[p][1] < self.seq[p] and self._replay_own_log(p, holds[p][1], own_log):
                    log.info("shard %s is behind on partition %d (seq %d < %d): replaying "
                             "the update log", sid, p, holds[p][1], self.seq[p])
            s.identity, s.alive, s.last_seen, s.inflight = identity, True, now, 0
            log.info("shard %s re-registered", sid)
        held_bytes = self._learn_catalog(h)
        for p in sorted(holds):
            if self.owners[p] == sid:
                continue            # its only copy: it comes back with its data
            if not self._adopt(s, p, holds[p], held_bytes.get(p, 0)):
                drop.append(p)      # failed over while it was away, or older: fenced
        for other, p in self.pending_drops:   # copies a newer registration replaced
            sh = self.shards[other]
            if sh.alive:
                actions.append((BACK, sh.identity, [wire.pack(wire.DROP, ps=[p])]))
        self.pending_drops.clear()
        if drop:
            self.counters["fenced_partitions"] += len(drop)
            log.warning("shard %s: dropping %d partitions it holds from an older epoch",
                        sid, len(drop))
        self.by_identity[identity] = sid
        self.table_version += 1
        actions.append((BACK, identity, [wire.pack(wire.REGISTERED, shard=sid, partitions=self.P)]))
        if self.replay is not None:
            self._replay_orphans()
        if drop:
            actions.append((BACK, identity, [wire.pack(wire.DROP, ps=drop)]))
        actions.append((PUB, self._table_msg()))
        return actions

    def _schedule_replay(self, p: int, seq: int) -> None:
        if self.replay is None or p in self.replay_done:
            return
        self.replay_done.add(p)
        recs = self.replay.after(p, seq, self.replay_until)
        if recs:
            self.replaying[p] = recs
            self.counters["replay_scheduled"] += len(recs)

    def _recovered(self) -> bool:
        """Every shard that may bring partitions back has registered (as many as expected),
        or the recovery grace is over."""
        if self.expect_shards and sum(1 for x in self.shards.values()
                                      if x.alive) >= self.expect_shards:
            return True
        return self.now - self.started >= self.recovery_grace

    def _replay_own_log(self, p: int, after: int, index: list) -> bool:
        """Rebuild partition p on its returning sole owner from this broker's own update log
        (every logged batch after ``after``); False when the log does not cover it. ``index``
        holds the log's index once read (empty until then), shared by the calls of one
        registration."""
        if self.log is None:
            return False
        if not index:
            from .log import LogIndex
            self.log.sync()
            index.append(LogIndex(self.log.dir))
        recs = index[0].after(p, after)
        if not recs or recs[0][0]["seq"] != after + 1:
            return False
        self.replaying[p] = recs
        self.no_relog.add(p)
        self.counters["replay_scheduled"] += len(recs)
        return True

    def _replay_orphans(self) -> None:
        """Once recovered: partitions the log has but no shard brought back (created after the
        checkpoints) are placed and replayed from the start."""
        if self.replay is None or not self._recovered():
            return
        for p in sorted(self.replay.by_p):
            if p not in self.replay_done and self.owners[p] is None and self._place(p):
                self._schedule_replay(p, 0)

    def _flush_replay(self, actions: list) -> None:
        """Send the logged batches of replaying partitions, one record per message, in order."""
        for p in list(self.replaying):
            group = self._group(p)
            while self.replaying.get(p) and self._can_send(group):
                h, frames = self.replaying[p].pop(0)
                self._learn_inits(p, h)
                part = {"p": p, "seq": h["seq"], "epoch": self.epochs[p], "o": group[0],
                        "e": h["e"]}
                self.seq[p] = max(self.seq[p], h["seq"])
                hdr = wire.pack(wire.BATCH, h["t"], parts=[part])
                if self.log is not None and p not in self.no_relog:
                    self.log.append([part], h["t"], frames, h["time"])
                self._send_group(group, [hdr, *frames], actions)
                self.counters["replayed"] += 1
            if not self.replaying.get(p):
                self.replaying.pop(p, None)
                self.no_relog.discard(p)

    def _learn_inits(self, p: int, h: dict) -> None:
        """A replayed INIT entry of a tensor this broker does not know yet enters the catalog."""
        for e in h["e"]:
            layout = self._catalog_init_entry(e)
            if layout is not None:
                self._account(p, layout.block_bytes(split_key(e["key"])[1]))

    def _catalog_init_entry(self, e: dict) -> TensorLayout | None:
        """The layout of a logged INIT entry (None for other entries), put in the catalog if
        the tensor is new to it."""
        if e.get("op") != "init":
            return None
        if "table" in e:           # a table's rows start empty: no bytes to account
            name = split_row_key(e["key"])[0]
            self.tables.setdefault(name, Table(name, e["table"]))
            return None
        layout = TensorLayout.from_wire(e["layout"])
        if layout.name not in self.catalog:
            self.catalog[layout.name] = Tensor(layout, e["opt"])
        return layout

    def _account(self, p: int, nbytes: int) -> None:
        """Parameter bytes added to partition p, counted on every shard holding a copy."""
        self.pbytes[p] += nbytes
        for sid in (*self._members(p), *self.syncing.get(p, ())):
            self.shards[sid].bytes += nbytes

    def _learn_catalog(self, h: dict) -> dict[int, int]:
        """Tensors and block versions a registering shard holds that this broker does not know
        (it restarted, or the cluster was restored from checkpoints); returns the parameter
        bytes it holds per partition."""
        tensors, blocks = h.get("tensors"), h.get("blocks")
        held: dict[int, int] = defaultdict(int)
        if not isinstance(tensors, list) or not isinstance(blocks, list):
            return held
        for t in tensors:
            try:
                if t["name"] in self.catalog or t["name"] in self.tables:
                    continue
                if "table" in t:
                    self.tables[t["name"]] = Table(t["name"], specs.table_from_wire(t["table"]))
                    continue
                layout, _ = self._check_tensor({**t, "init": {"name": "zeros"}})
                specs.optimizer_from_wire(t["opt"])
                self.catalog[layout.name] = Tensor(layout, t["opt"])
            except (WireError, TypeError, KeyError, ValueError) as e:
                self.errors[Code.BAD_FIELD.value] += 1
                log.warning("register: bad tensor %r: %s", t, e)
        for b in blocks:
            if isinstance(b, list) and len(b) == 2 and isinstance(b[1], int):
                name_p = split_row_key(b[0]) if isinstance(b[0], str) else None
                if name_p is not None:
                    tbl = self.tables.get(name_p[0])
                    if tbl is not None:      # pushes applied: at least the most any part saw
                        tbl.base = max(tbl.base, b[1] - tbl.applied)
                    continue
                try:
                    t, idx = self._block(b[0])
                except (WireError, TypeError):
                    continue
                t.versions.setdefault(idx, b[1])
                held[partition_of(b[0], self.P)] += t.layout.block_bytes(idx)
        return held

    def _adopt(self, s: ShardInfo, p: int, state: tuple, nbytes: int) -> bool:
        """Whether a registering shard's copy of partition p (at ``state`` = (epoch, seq))
        becomes a replica: taken as the primary when this broker never placed p, as an in-sync
        standby when it equals the primary's registered copy and nothing was sent since, and
        as the new primary when it is newer than that copy. Otherwise it is stale."""
        epoch, seq = state
        owner = self.owners[p]
        if owner is None:
            self.owners[p], self.epochs[p] = s.id, max(epoch, 1)
            self.seq[p] = max(self.seq[p], seq)
            if seq:
                self.published_seq[p] = seq
            self.adopted[p] = state
            self.pbytes[p] = nbytes
            s.partitions.add(p)
            s.bytes += self.pbytes[p]
            self.counters["partitions_adopted"] += 1
            self._schedule_replay(p, seq)
            return True
        known = self.adopted.get(p)
        if known is None or self.seq[p] != known[1] or self._holds(s.id, p):
            return False       # batches went out since: a copy from before them is stale
        if state == known and 1 + len(self.standbys[p]) < self.replicas:
            self.standbys[p].append(s.id)
            s.partitions.add(p)
            s.bytes += self.pbytes[p]
            return True
        if state > known:      # newer than the copy adopted first: it takes over
            self.adopted[p] = state
            self.epochs[p], self.seq[p] = max(epoch, 1), seq
            self.published_seq[p] = seq
            old = [owner, *self.standbys[p]]
            self.standbys[p] = []
            self.owners[p] = s.id
            s.partitions.add(p)
            s.bytes += self.pbytes[p]
            for sid in old:
                sh = self.shards[sid]
                sh.partitions.discard(p)
                sh.bytes -= self.pbytes[p]
                self.pending_drops.append((sid, p))
            return True
        return False

    def _applied(self, s: ShardInfo, h: dict, frames: list) -> list:
        actions = []
        s.inflight = max(0, s.inflight - 1)
        pos = 0
        for part in h["parts"]:
            p, seq, n = part["p"], part["seq"], part["n"]
            pub = frames[pos:pos + 1 + n] if n >= 0 else None
            pos += 1 + n if n >= 0 else 0
            primary = s.id == self.owners[p]
            ho = self.handover.get(p)
            if ho is not None and ho[0] == s.id and not primary and s.id not in self.standbys[p]:
                if seq <= ho[1] and pub is not None:     # sent to it as the primary
                    actions.append((PUB, [wire.topic_partition(p), *pub]))
                    self.published_seq[p] = max(seq, self.published_seq.get(p, 0))
                if seq >= ho[1]:
                    del self.handover[p]
                continue
            if not primary and s.id not in self.standbys[p]:
                if s.id not in self.syncing.get(p, ()):
                    self.errors[Code.FENCED.value] += 1   # not a replica of p (any more)
                continue
            if primary:
                if pub is not None:
                    actions.append((PUB, [wire.topic_partition(p), *pub]))
                    b = self.inflight.get((p, seq))
                    for ref in (b.refs if b is not None and not b.primary_done else ()):
                        pend = self.pending.get(ref)
                        if pend is not None and pend.kind == "push":
                            self.h_visible.observe(self.now - pend.t0)
                # Even unpublished (applied as a standby just before a failover), the seq is
                # named in heartbeats, so subscribers see they missed it and re-snapshot.
                if seq > self.published_seq.get(p, 0):
                    self.published_seq[p] = seq
                self._learn_rows(p, part.get("tr"))
                for key, ver in part.get("vers", {}).items():
                    if split_row_key(key) is not None:
                        continue      # a table's version counts acknowledged pushes instead
                    try:
                        name, idx = split_key(key)
                    except ValueError:
                        continue
                    t = self.catalog.get(name)
                    if t is not None:
                        t.versions[idx] = ver
            b = self.inflight.get((p, seq))
            if b is None:
                continue
            if b.errors is None:
                b.errors = {e[0]: (e[1], e[2]) for e in part.get("errors", [])}
            b.waiting.discard(s.id)
            actions += self._progress(p, seq, b)
        return self._coalesce(actions)

    def _learn_rows(self, p: int, tr) -> None:
        """The rows and bytes a primary reports holding in p's tables after a batch: the
        bytes count towards p's size (what rebalancing weighs)."""
        if not isinstance(tr, dict):
            return
        for name, rb in tr.items():
            tbl = self.tables.get(name)
            if tbl is None or not (isinstance(rb, list) and len(rb) == 2
                                   and all(isinstance(x, int) for x in rb)):
                continue
            old = tbl.rows.get(p, [0, 0])[1]
            tbl.rows[p] = rb
            if rb[1] != old:
                self._account(p, rb[1] - old)

    def _progress(self, p: int, seq: int, b: Batch) -> list:
        """Settle what a batch's replies allow: acks=1 entries once the (current) primary
        applied it, acks=all entries once every in-sync replica did."""
        actions = []
        errors = b.errors or {}
        if not b.primary_done and self.owners[p] not in b.waiting:
            b.primary_done = True
            for i, ref in enumerate(b.refs):
                pend = self.pending.get(ref)
                if pend is not None and pend.acks != ALL:
                    actions += self._settle(ref, errors.get(i))
        if not b.waiting:
            del self.inflight[(p, seq)]
            for i, ref in enumerate(b.refs):
                pend = self.pending.get(ref)
                if pend is not None and pend.acks == ALL:
                    actions += self._settle(ref, errors.get(i))
        return actions

    def _forward_state(self, s: ShardInfo, h: dict, frames: list) -> list:
        """A primary's export of partition p for a standby catching up: pass it on."""
        p, to = h["p"], h["to"]
        target = self.shards.get(to)
        if (not 0 <= p < self.P or s.id != self.owners[p] or target is None or not target.alive
                or to not in self.syncing.get(p, ())):
            self.counters["states_discarded"] += 1
            return []
        self.counters["state_bytes"] += sum(wire.frame_len(f) for f in frames[1:])
        return [(BACK, target.identity, frames)]

    def _synced(self, s: ShardInfo, h: dict, now: float) -> list:
        p = h["p"]
        since = self.syncing.get(p, {}).pop(s.id, None) if 0 <= p < self.P else None
        if since is None:
            return []
        if not self.syncing[p]:
            del self.syncing[p]
        self.standbys[p].append(s.id)
        self.counters["standbys_synced"] += 1
        self.table_version += 1
        log.info("shard %s in sync for partition %d at seq %d (%.3fs)", s.id, p, h["seq"],
                 now - since)
        actions = []
        mv = self.moves.get(p)
        if mv is not None and mv["to"] == s.id:
            actions += self._finish_move(p, mv, int(h["seq"]), now)
        return self._coalesce([*actions, (PUB, self._table_msg())])

    # ------------------------------------------------------------------ moves
    def _start_move(self, p: int, src: str, dst: str, now: float) -> list:
        t = self.shards[dst]
        self.syncing[p][dst] = now
        t.partitions.add(p)
        t.bytes += self.pbytes[p]
        self.shards[src].bytes -= self.pbytes[p]   # counted where it is going, from now on
        self.moves[p] = {"from": src, "to": dst, "since": now}
        self.counters["moves_started"] += 1
        return [(BACK, t.identity, [wire.pack(wire.ADOPT, p=p)]),
                (BACK, self.shards[self.owners[p]].identity,
                 [wire.pack(wire.STATE_REQ, p=p, to=dst)])]

    def _finish_move(self, p: int, mv: dict, synced_seq: int, now: float) -> list:
        """The new copy is in sync: it takes the old one's place (as primary with the next epoch
        when the old one led), and the old one drops the partition."""
        del self.moves[p]
        src, dst = mv["from"], mv["to"]
        if src == self.owners[p]:
            self.standbys[p].remove(dst)
            self.owners[p] = dst
            self.epochs[p] += 1
            # Every batch sent so far names the old primary as its publisher (the new one
            # applies them silently): the old one still publishes those it has not reported.
            if self.seq[p] > self.published_seq.get(p, 0):
                self.handover[p] = (src, self.seq[p], now)
        elif src in self.standbys[p]:
            self.standbys[p].remove(src)
        else:
            return []      # the old copy is gone already (it died): the new one just stays
        actions = []
        for (bp, seq), b in list(self.inflight.items()):
            if bp != p:
                continue
            if seq > synced_seq:
                b.waiting.add(dst)    # sent to it while it caught up: it applies them next
            if src in b.waiting:
                b.waiting.discard(src)
                actions += self._progress(p, seq, b)
        old = self.shards[src]
        old.partitions.discard(p)
        if old.alive:
            actions.append((BACK, old.identity, [wire.pack(wire.DROP, ps=[p])]))
        self.counters["moves"] += 1
        self.next_move_at = max(self.next_move_at, now + MOVE_PACE * (now - mv["since"]))
        self.move_log.append({"p": p, "from": src, "to": dst, "bytes": self.pbytes[p],
                              "seconds": round(now - mv["since"], 3), "at": now})
        del self.move_log[:-256]
        self.table_version += 1
        log.info("partition %d moved %s -> %s in %.3fs", p, src, dst, now - mv["since"])
        if src in self.draining:
            actions += self._maybe_drained(old)
        return actions

    def _maybe_drained(self, s: ShardInfo) -> list:
        if s.partitions or any(m["from"] == s.id for m in self.moves.values()):
            return []
        self.draining.discard(s.id)
        log.info("shard %s drained: stopping it", s.id)
        self.counters["shards_drained"] += 1
        return [(BACK, s.identity, [wire.pack(wire.STOP)])] if s.alive else []

    def _fold_rates(self, now: float) -> None:
        """Each partition's update rate: an exponentially weighted count of the gradients
        batched into it (time constant RATE_TAU), brought up to ``now``."""
        decay = math.exp(-max(0.0, now - self.prate_at) / RATE_TAU)
        self.prate = self.prate * decay + np.asarray(self.pcount) / RATE_TAU
        self.pcount = [0] * self.P
        self.prate_at = now

    def _loads(self, now: float) -> tuple[dict, dict]:
        """Per partition ``(share of all parameter bytes, share of all updates per second)``,
        and per shard the sums over its copies (a copy moving away counts where it goes)."""
        self._fold_rates(now)
        rates = self.prate.tolist()
        tb, tr = sum(self.pbytes), sum(rates)
        w = {p: (self.pbytes[p] / tb if tb else 0.0, rates[p] / tr if tr else 0.0)
             for p in range(self.P) if self.owners[p] is not None}
        leaving = {(mv["from"], p) for p, mv in self.moves.items()}
        load = {}
        for s in self.shards.values():
            held = [w[p] for p in s.partitions if (s.id, p) not in leaving and p in w]
            load[s.id] = [sum(x[0] for x in held), sum(x[1] for x in held)]
        return w, load

    def _best_move(self, w: dict, load: dict, targets: list):
        """The move that most lowers the sum over shards of (bytes share)^2 + (rate share)^2,
        from one of the two most loaded shards to one of the two least: ``(p, src, dst)``,
        or None when no move lowers it by more than MIN_GAIN."""
        order = sorted(targets, key=lambda x: (sum(load[x.id]), x.id))
        best, gain = None, -MIN_GAIN
        for s in order[-2:]:
            bs, rs = load[s.id]
            for p in s.partitions:
                if p in self.moves or p in self.syncing or p not in w or not self._live(
                        self.owners[p]):
                    continue
                b, r = w[p]
                for t in order[:2]:
                    if t is s or self._holds(t.id, p):
                        continue
                    bt, rt = load[t.id]
                    d = 2 * b * (b + bt - bs) + 2 * r * (r + rt - rs)
                    if d < gain:
                        best, gain = (p, s, t), d
        return best

    def _plan(self, now: float) -> list:
        """Start moves while catch-ups may: everything off draining shards first, then from
        the most loaded shard to the least (load: bytes and update rate), each move only if
        it narrows the gap (so plans converge and never oscillate)."""
        actions = []
        targets = [x for x in self.shards.values() if x.alive and x.id not in self.draining]
        if not targets or now < self.next_move_at:
            return actions
        w, load = self._loads(now)
        for sid in sorted(self.draining):
            src = self.shards[sid]
            for p in sorted(src.partitions):
                if p in self.moves or p in self.syncing or self.owners[p] is None or (
                        not self._live(self.owners[p])):
                    continue
                if not self._sync_room(p):
                    return actions
                cands = [x for x in targets if not self._holds(x.id, p)]
                if not cands:    # no other shard can take this copy: let it go (a standby)
                    if sid in self.standbys[p]:
                        actions += self._release_standby(p, src)
                    continue
                dst = min(cands, key=lambda x: (sum(load[x.id]), x.id))
                actions += self._start_move(p, sid, dst.id, now)
                for i in (0, 1):
                    load[dst.id][i] += w.get(p, (0.0, 0.0))[i]
            actions += self._maybe_drained(src)
        if not (self.rebalance_wanted and len(targets) > 1):
            return actions
        moved = False
        while True:
            mv = self._best_move(w, load, targets)
            if mv is None or not self._sync_room(mv[0]):
                moved = moved or mv is not None     # waits for room, not balanced yet
                break
            p, src, dst = mv
            actions += self._start_move(p, src.id, dst.id, now)
            for i in (0, 1):
                load[src.id][i] -= w[p][i]
                load[dst.id][i] += w[p][i]
            moved = True
        if not moved and not self.moves:
            self.rebalance_wanted = False     # balanced
        return actions

    def _end_handovers(self, which) -> None:
        """Give up on moved primaries' last publishes (``which(handover)`` true): heartbeats
        name the seq they were to reach, so subscribers that missed some re-snapshot."""
        for p, ho in list(self.handover.items()):
            if which(ho):
                del self.handover[p]
                if ho[1] > self.published_seq.get(p, 0):
                    self.published_seq[p] = ho[1]

    def _sync_room(self, p: int) -> bool:
        """Whether another copy of partition p may start catching up now: fewer than
        MAX_SYNCS copies are, holding at most MAX_SYNC_BYTES with p's (or none is)."""
        busy = sum(len(v) for v in self.syncing.values())
        if not busy:
            return True
        held = sum(self.pbytes[q] * len(v) for q, v in self.syncing.items())
        return busy < MAX_SYNCS and held + self.pbytes[p] <= MAX_SYNC_BYTES

    def _release_standby(self, p: int, s: ShardInfo) -> list:
        self.standbys[p].remove(s.id)
        s.partitions.discard(p)
        s.bytes -= self.pbytes[p]
        for (bp, seq), b in list(self.inflight.items()):
            if bp == p and s.id in b.waiting:
                b.waiting.discard(s.id)
        self.table_version += 1
        return [(BACK, s.identity, [wire.pack(wire.DROP, ps=[p])])]

    def _admin(self, identity: bytes, h: dict, now: float) -> list:
        """Ops commands: ``rebalance``, ``drain`` (with ``shard``)."""
        op, req = h["op"], h["req"]
        if op == "rebalance":
            self.rebalance_wanted = True
            actions = self._plan(now)
            result = {"moves_started": sum(1 for a in actions if a[0] == BACK
                                           and b"adopt" in bytes(a[2][0]))}
        elif op == "drain":
            sid = h.get("shard")
            s = self.shards.get(sid) if isinstance(sid, str) else None
            if s is None or not s.alive:
                return [self._err(identity, Code.BAD_REQUEST, f"drain: no live shard {sid!r}",
                                  req=req)]
            if not any(x.alive and x.id != sid for x in self.shards.values()):
                return [self._err(identity, Code.BAD_REQUEST,
                                  f"drain: {sid} is the only live shard", req=req)]
            self.draining.add(sid)
            actions = self._plan(now)
            result = {"shard": sid, "partitions": len(s.partitions)}
        else:
            return [self._err(identity, Code.BAD_FIELD, f"admin: unknown op {op!r}", req=req)]
        actions.append((FRONT, identity, [wire.pack(wire.ADMIN_REPLY, req=req, result=result)]))
        actions.append((PUB, self._table_msg()))
        return self._coalesce(actions)

    def _coalesce(self, actions: list) -> list:
        """One ACK message per client for every push acknowledged in this step:
        ``{"msg": first, "msgs": [all]}`` (a send per client, not per push)."""
        acks: dict[bytes, list[int]] = {}
        out = []
        for a in actions:
            if a[0] == _ACK:
                acks.setdefault(a[1], []).append(a[2])
            else:
                out.append(a)
        for client, msgs in acks.items():
            if self.fault_drop and self._fault_rng.random() < self.fault_drop:
                self.counters["fault_dropped_acks"] += len(msgs)
                continue
            fields = {"msg": msgs[0]}
            if len(msgs) > 1:
                fields["msgs"] = msgs
            out.append((FRONT, client, [wire.pack(wire.ACK, **fields)]))
        return out

    def _settle(self, ref, error) -> list:
        pend = self.pending.get(ref)
        if pend is None:
            return []
        if error and pend.error is None:
            pend.error = error
        pend.remaining -= 1
        if pend.remaining > 0:
            return []
        del self.pending[ref]
        client = self.clients.get(pend.client)
        for name in pend.tables:
            tbl = self.tables.get(name)
            if tbl is not None:
                tbl.applied += not pend.error
                tbl.stepping -= pend.step
        # a bsp table's step: reads waiting for it may go once it is applied
        woken = self._wake_reads() if pend.step and self.parked_reads else []
        if pend.error:
            code, message = pend.error
            self.errors[str(code)] += 1
            if client is not None:
                client.errors[str(code)] += 1     # e.g. NOT_FINITE per client
            reply = [wire.error(code, message, msg=pend.msg)]
        elif pend.kind == "push":
            self.counters["pushes_applied"] += 1
            self.h_ack.observe(self.now - pend.t0)
            if client is not None:
                self._remember(client, pend.msg, ACKED)
            return [(_ACK, pend.client, pend.msg), *woken]
        else:
            reply = [wire.pack(wire.INIT_OK, msg=pend.msg, **pend.reply)]
        if client is not None:
            self._remember(client, pend.msg, reply)
        return [(FRONT, pend.client, reply), *woken]

    def _shard_dead(self, s: ShardInfo, now: float, why: str) -> list:
        log.warning("shard %s declared dead (%s)", s.id, why)
        s.alive = False
        self.counters["shards_lost"] += 1
        actions = []
        err = (Code.SHARD_UNAVAILABLE.value, f"shard {s.id} died before applying ({why})")
        self._end_handovers(lambda ho: ho[0] == s.id)
        for p in range(self.P):
            if self.syncing.get(p, {}).pop(s.id, None) is not None:
                s.partitions.discard(p)
                s.bytes -= self.pbytes[p]
                if not self.syncing[p]:
                    del self.syncing[p]
            if s.id in self.standbys[p]:
                self.standbys[p].remove(s.id)
                s.partitions.discard(p)
                s.bytes -= self.pbytes[p]
            if self.owners[p] != s.id:
                continue
            new = next((x for x in self.standbys[p] if self._live(x)), None)
            if new is None:
                # No copy left: what was in flight or queued for p fails; the partition waits
                # for this shard to come back (or is lost).
                actions += self._fail_partition(p, err)
                continue
            # Failover: the in-sync standby has every batch the primary was sent, in order.
            self.standbys[p].remove(new)
            self.owners[p] = new
            self.epochs[p] += 1
            s.partitions.discard(p)
            s.bytes -= self.pbytes[p]
            for sid in list(self.syncing.get(p, ())):
                # its state was to come from the dead primary: start again from the new one
                del self.syncing[p][sid]
                sh = self.shards.get(sid)
                if sh is not None:
                    sh.partitions.discard(p)
                    sh.bytes -= self.pbytes[p]
                if sh is not None and sh.alive:
                    actions.append((BACK, sh.identity, [wire.pack(wire.DROP, ps=[p])]))
            self.syncing.pop(p, None)
            self.counters["failovers"] += 1
            self.failovers.append({"p": p, "from": s.id, "to": new, "epoch": self.epochs[p],
                                   "at": now, "silent_s": round(now - s.last_seen, 3)})
        del self.failovers[:-256]
        for p, mv in list(self.moves.items()):
            if s.id in (mv["from"], mv["to"]) or p not in self.syncing:
                del self.moves[p]      # the catch-up was cancelled, or its source is gone
                src = self.shards[mv["from"]]
                if src.id != s.id and p in src.partitions:
                    src.bytes += self.pbytes[p]   # it keeps its copy after all
        self.draining.discard(s.id)
        for (p, seq), b in list(self.inflight.items()):
            if s.id in b.waiting:
                b.waiting.discard(s.id)
                actions += self._progress(p, seq, b)
        for client, req in s.snapshots + [(c, r) for c, r, *_ in s.queued_snapshots]:
            actions.append(self._err(client, Code.SHARD_UNAVAILABLE, err[1], req=req))
        s.snapshots, s.queued_snapshots, s.inflight = [], [], 0
        s.bytes = sum(self.pbytes[p] for p in s.partitions)   # what it still owns alone
        self.table_version += 1
        actions.append((PUB, self._table_msg()))
        return self._coalesce(actions)

    def _fail_partition(self, p: int, err: tuple) -> list:
        actions = []
        for (bp, seq) in [k for k in self.inflight if k[0] == p]:
            for ref in self.inflight.pop((bp, seq)).refs:
                actions += self._settle(ref, err)
        for entry, raw, fr, ref in self.pending_entries.pop(p, []):
            if fr is not None:
                self.pending_bytes -= wire.frame_len(fr)
            actions += self._settle(ref, err)
        return actions

    def _repair(self, now: float) -> list:
        """Give every partition ``replicas`` copies: start a catch-up on the live shard holding
        fewest bytes for each partition short of standbys (snapshot at the primary's seq S,
        then the batches after S, which the new standby receives from now on)."""
        if self.replicas <= 1:
            return []
        live = [x for x in self.shards.values() if x.alive]
        if len(live) < 2:
            return []
        actions = []
        for p in range(self.P):
            owner = self.owners[p]
            if owner is None or p in self.lost or not self._live(owner):
                continue
            have = 1 + len(self.standbys[p]) + len(self.syncing.get(p, ()))
            while have < self.replicas and self._sync_room(p):
                cands = [x for x in live if not self._holds(x.id, p)]
                if not cands:
                    break
                t = min(cands, key=lambda x: (x.bytes, len(x.partitions), x.id))
                self.syncing[p][t.id] = now
                t.partitions.add(p)
                t.bytes += self.pbytes[p]
                actions.append((BACK, t.identity, [wire.pack(wire.ADOPT, p=p)]))
                actions.append((BACK, self.shards[owner].identity,
                                [wire.pack(wire.STATE_REQ, p=p, to=t.id)]))
                self.counters["syncs_started"] += 1
                have += 1
        return actions

    # ------------------------------------------------------------------ clock
    def on_tick(self, now: float) -> list:
        self.now = now
        actions = []
        deadline = self.hb_interval * self.liveness
        for s in list(self.shards.values()):
            if s.alive and now - s.last_seen > deadline:
                actions += self._shard_dead(s, now, f"silent {now - s.last_seen:.2f}s")
        if self.handover:      # a moved primary that never reported its last batches
            self._end_handovers(lambda ho: now - ho[2] > deadline)
        for ident, c in list(self.clients.items()):
            if now - c.last_seen > self.hb_interval * self.client_liveness and not any(
                    ref[0] == ident for ref in self.pending):
                del self.clients[ident]
        actions += self._repair(now)
        if self.barriers:
            actions += self._release_barriers()
        if self.replay is not None and len(self.replay_done) < len(self.replay.by_p):
            self._replay_orphans()
        if self.log is not None and self.log.fsync == "interval":
            self.log.maybe_sync()
        if self.draining or self.rebalance_wanted:
            actions += self._coalesce(self._plan(now))
        if now - self.last_hb_sent >= self.hb_interval:
            self.last_hb_sent = now
            hb = wire.pack(wire.HEARTBEAT)
            for s in self.shards.values():
                if s.alive:
                    actions.append((BACK, s.identity, [hb]))
            # The events heartbeat names the last seq published per partition: a subscriber that
            # is behind one of them lost the tail of that stream (XPUB drops on HWM) and
            # re-snapshots, even when no later update would reveal the gap.
            ps = sorted(self.published_seq)
            tv = {n: t.version for n, t in self.catalog.items() if t.cons["mode"] != "async"}
            actions.append((PUB, [wire.TOPIC_HEARTBEAT, wire.pack(
                wire.HEARTBEAT, ps=ps, seqs=[self.published_seq[p] for p in ps],
                **({"tv": tv} if tv else {}))]))
        return actions

    # ------------------------------------------------------------------ status
    def status(self, now: float) -> dict:
        shards = []
        _, load = self._loads(now)
        for s in sorted(self.shards.values(), key=lambda s: s.id):
            primary = sum(1 for o in self.owners if o == s.id)
            shards.append({"id": s.id, "alive": s.alive, "partitions": len(s.partitions),
                           "primary": primary, "standby": sum(
                               1 for sb in self.standbys if s.id in sb),
                           "syncing": sum(1 for v in self.syncing.values() if s.id in v),
                           "bytes": s.bytes,
                           "load": [round(x, 4) for x in load.get(s.id, (0.0, 0.0))],
                           "inflight": s.inflight,
                           "last_seen_s": round(now - s.last_seen, 3), "info": s.info})
        workers = [{"id": c.identity.hex(), "pushes": c.pushes, "errors": dict(c.errors),
                    "pushes_per_s": round(c.rate * math.exp(-max(0.0, now - c.rate_at) / 5.0),
                                          2),
                    "staleness": None if c.staleness is None else round(c.staleness, 2),
                    "last_seen_s": round(now - c.last_seen, 3)}
                   for c in self.clients.values()]
        tensors = [{"name": n, "dtype": t.layout.dtype, "shape": list(t.layout.shape),
                    "blocks": t.layout.nblocks, "version": t.version,
                    "optimizer": t.opt.get("name")} for n, t in sorted(self.catalog.items())]
        tables = [{"name": n, "dim": t.cfg["dim"], "dtype": t.cfg["dtype"],
                   "optimizer": t.cfg["opt"]["name"], "version": t.version,
                   "rows": sum(r[0] for r in t.rows.values()),
                   "bytes": sum(r[1] for r in t.rows.values()),
                   "expiry_s": t.cfg["expiry"], "min_count": t.cfg["min_count"]}
                  for n, t in sorted(self.tables.items())]
        down = self._down()
        urls = {s.id: s.info["metrics_url"] for s in self.shards.values()
                if s.alive and s.info.get("metrics_url")}
        if self.metrics_url or urls:
            urls = {"broker": self.metrics_url, **urls}
        return {"uptime_s": round(now - self.started, 3), "partitions": self.P,
                "metrics_url": self.metrics_url,
                "metrics_urls": urls,
                "partitions_assigned": sum(1 for o in self.owners if o),
                "partitions_down": down, "table_version": self.table_version,
                "replicas": self.replicas,
                "under_replicated": self._under_replicated(),
                "failovers": self.failovers[-20:],
                "moves": self.move_log[-20:],
                "moves_in_progress": [{"p": p, **mv} for p, mv in sorted(self.moves.items())],
                "draining": sorted(self.draining),
                "shards": shards, "workers": workers, "tensors": tensors, "tables": tables,
                "pending_bytes": self.pending_bytes, "counters": dict(self.counters),
                "staleness": {"count": self.h_staleness.count,
                              "p50": self.h_staleness.quantile(0.5),
                              "p99": self.h_staleness.quantile(0.99),
                              "mean": round(self.h_staleness.sum / self.h_staleness.count, 3)
                              if self.h_staleness.count else None},
                "errors": dict(self.errors)}

    def _under_replicated(self) -> int:
        """Placed partitions with fewer in-sync copies than ``replicas``."""
        return sum(1 for p, o in enumerate(self.owners)
                   if o and 1 + len(self.standbys[p]) < self.replicas)

    def metrics(self, now: float) -> dict:
        """A snapshot for the Prometheus exporter (built on the loop's thread)."""
        c = self.counters
        alive = {s.id: int(s.alive) for s in self.shards.values()}
        wire_b, dec_b = c.get("push_wire_bytes", 0), c.get("push_decoded_bytes", 0)
        m = {f"gradbus_broker_{name}": stats.counter(help_, c.get(key, 0))
             for name, key, help_ in _BROKER_COUNTERS}
        m.update({
            "gradbus_broker_compression_ratio": stats.gauge(
                "Decoded over wire bytes of all pushes so far.", dec_b / wire_b if wire_b else 1.0),
            "gradbus_broker_partition_moves_in_progress": stats.gauge(
                "Partition moves under way.", len(self.moves)),
            "gradbus_broker_errors": stats.labelled("counter", "Errors by code.", "code",
                                                    dict(self.errors)),
            "gradbus_broker_pending_bytes": stats.gauge(
                "Tensor bytes queued in the broker, not yet sent to shards.", self.pending_bytes),
            "gradbus_broker_pending_entries": stats.gauge(
                "Entries queued in the broker.", sum(len(v) for v in
                                                     self.pending_entries.values())),
            "gradbus_broker_inflight_batches": stats.labelled(
                "gauge", "Batches sent to a shard and not yet applied (its used credit).",
                "shard", {s.id: s.inflight for s in self.shards.values()}),
            "gradbus_broker_shard_credit": stats.gauge("Batches allowed in flight per shard.",
                                                       self.shard_credit),
            "gradbus_broker_shard_up": stats.labelled("gauge", "1 if the shard is alive.",
                                                      "shard", alive),
            "gradbus_broker_partitions_down": stats.gauge(
                "Partitions with no live primary.", len(self._down())),
            "gradbus_broker_under_replicated_partitions": stats.gauge(
                "Partitions with fewer in-sync copies than --replicas.",
                self._under_replicated()),
            "gradbus_broker_workers": stats.gauge("Clients currently known.", len(self.clients)),
            "gradbus_broker_batch_entries": stats.histogram(
                "Entries (pushes and inits) per partition batch.", self.h_batch),
            "gradbus_broker_push_to_visible_seconds": stats.histogram(
                "From a push's arrival to the publish of the weights it changed.",
                self.h_visible),
            "gradbus_broker_push_to_ack_seconds": stats.histogram(
                "From a push's arrival to its acknowledgement.", self.h_ack),
            "gradbus_broker_staleness": stats.histogram(
                "Versions a push's weights were behind the tensor's on arrival (pushes that "
                "say which version they were computed on).", self.h_staleness),
        })
        return m

    def table(self) -> dict:
        """The partition table: per partition its primary, in-sync standbys, standbys catching
        up, epoch and last seq."""
        self._fold_rates(self.now)
        return {"owners": [o or "" for o in self.owners], "standbys": self.standbys,
                "syncing": [sorted(self.syncing.get(p, ())) for p in range(self.P)],
                "epochs": self.epochs, "seqs": self.seq, "down": self._down(),
                "bytes": self.pbytes,
                "rates": [round(r, 3) for r in self.prate.tolist()],
                "version": self.table_version}

    def validate_state(self) -> None:
        """Invariants, for tests: raises AssertionError-free RuntimeError when broken."""
        problems = []
        if self.pending_bytes < 0:
            problems.append(f"pending_bytes {self.pending_bytes} < 0")
        for (p, seq), b in self.inflight.items():
            if not b.waiting:
                problems.append(f"in-flight batch {p}/{seq} waits for nobody")
        for p, o in enumerate(self.owners):
            if o is not None and o not in self.shards:
                problems.append(f"partition {p} owned by unknown shard {o}")
            reps = [o, *self.standbys[p], *self.syncing.get(p, ())]
            if o is not None and len(set(reps)) != len(reps):
                problems.append(f"partition {p} has a shard twice among its replicas: {reps}")
            if o is None and (self.standbys[p] or self.syncing.get(p)):
                problems.append(f"partition {p} has standbys but no primary")
        if problems:
            raise RuntimeError("; ".join(problems))
