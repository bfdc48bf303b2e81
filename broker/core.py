"""The broker's state machine: a facade over components that each own their state. No sockets,
no disk, no clock of its own.

Each ``on_*`` method (and :meth:`BrokerCore.flush`) takes one event with the current monotonic
time and returns a list of typed actions (:mod:`.actions`). The facade dispatches the event to
the components and applies one step to what they return: the pushes acknowledged in the step
become one ACK message per client.

Components (each with a ``validate_state()``):

* :mod:`.partition_table` -- replica membership and bytes (its only writer);
* :mod:`.membership` -- shards and clients, liveness;
* :mod:`.sequencer` -- queued entries, seqs, batches in flight, credit;
* :mod:`.settlement` -- pushes and inits awaiting their replicas, the duplicate window;
* :mod:`.catalog` -- tensors and tables, request checks, INIT planning;
* :mod:`.consistency` -- staleness, SSP, BSP barriers, parked reads;
* :mod:`.reads` -- snapshots, rows, digests and checkpoints routed to shards;
* :mod:`.delivery` -- conflated delivery of weights to clients that read them as frames: the
  partitions each follows, its credits, a last-value cache per followed partition;
* :mod:`.rebalance` -- catch-ups, moves, drain, hand-overs;
* :mod:`.recovery` -- restart, log replay, the update log's write policy;
* :mod:`.backend` -- what shards say (registration, APPLIED, death) across the components;
* :mod:`.acked` -- per partition the newest (epoch, seq) answered for (what brings a lost
  partition back);
* :mod:`.admission` -- who may say what: the CURVE roles each message needs, REGISTERs that
  would take over a live shard's id;
* :mod:`.status` -- read-only status and metrics.

Tensor frames are passed through as the objects the loop received (``zmq.Frame`` with
``copy=False``): the core reads their length, never their bytes.
"""
from __future__ import annotations

import logging
import secrets
import time
from dataclasses import replace

from gradbus.codecs import hops, messages, wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import DEFAULT_PARTITIONS, row_key, split_key, table_partitions
from gradbus.codecs.tier import TierMap, name_of

from . import status as _status
from .acked import AckMarks
from .actions import Publish, ReadLog, ToClient, ToShard
from .admission import Admission
from .backend import ShardEvents
from .catalog import Catalog
from .coalesce import Coalesce
from .consistency import Consistency
from .delivery import Delivery
from .membership import Membership
from .meters import Meters
from .partition_table import PartitionTable
from .reads import Reads
from .rebalance import Rebalance
from .recovery import Recovery
from .sequencer import Sequencer
from .settings import (  # noqa: F401
    DEDUPE_WINDOW,
    MAX_BATCH_BYTES,
    MAX_BLOCKS_PER_TENSOR,
    MAX_PARAM_BYTES,
    MAX_PARKED_READS,
    MAX_PENDING_BYTES,
    MAX_SYNC_BYTES,
    MAX_SYNCS,
    MIN_GAIN,
    MOVE_PACE,
    RATE_TAU,
    SHARD_CREDIT,
    Settings,
)
from .settlement import Pending, Settlement
from .tier_gate import TierGate
from .tier_moves import TierMoves

log = logging.getLogger("gradbus.broker")

ALL = wire.ACKS_ALL
# frontend kinds that do not register their sender as a worker (protocol section 6.11)
_NOT_WORKERS = frozenset({wire.HELLO, wire.STATUS, wire.DIGEST, wire.CHECKPOINT, wire.ADMIN,
                          wire.BYE})


def _ids(m) -> dict:
    """The correlation ids (``msg``, ``req``) an ERROR answering ``m`` copies."""
    return {k: v for k in ("msg", "req") if type(v := getattr(m, k, None)) is int}


class BrokerCore:
    def __init__(self, partitions: int = DEFAULT_PARTITIONS, *, settings: Settings | None = None,
                 replay=None, wall_clock=None, now: float = 0.0, tier: TierMap | None = None,
                 tier_index: int = 0, tier_map_file: str | None = None, **overrides):
        """``overrides``: fields of :class:`~.settings.Settings`; ``replay``: a log index to
        replay (:class:`~.log.LogIndex`); ``wall_clock``: the time that row expiry counts
        from and the log records (default ``time.time``); ``tier``: the broker tier's map,
        this broker member ``tier_index`` of it (protocol section 24)."""
        if not 1 <= partitions <= 65535:
            raise ValueError("partitions must be in 1..65535")
        self.settings = s = replace(settings or Settings(), **overrides)
        self.P = partitions
        self.now = now
        self.ports = {"events": 0, "backend": 0}
        self.shm: dict | None = None      # the loop's shared-memory offer for WELCOME (or None)
        self.metrics_url: str | None = None     # where this broker's /metrics is served
        self._wall = wall_clock or time.time
        self.last_hb_sent = now
        # this broker process's run id, in WELCOME and every events heartbeat: a client that
        # hears another one knows the broker restarted and sends again what it lost
        self.run = secrets.randbits(63)
        # a broker pair's epoch (protocol section 23): in WELCOME and REGISTERED, recorded by
        # every shard; 0 for a broker without a peer
        self.broker_epoch = 0
        self.pair_status = None     # the pair's role and epoch for STATUS (the loop sets it)
        self.meters = m = Meters()
        self.tier = TierGate(tier, tier_index, partitions, m.counters, tier_map_file)
        self.members = Membership(s)
        self.acked = AckMarks(partitions)      # p -> the newest (epoch, seq) answered for
        self.admission = Admission(m.errors)   # roles per message, register takeovers
        self.table = PartitionTable(partitions, s.replicas, self.members.shards,
                                    self.acked.lost_message)
        self.table.run = self.run          # TABLE names it too
        self.table.tier = self.tier.table_fields
        self.catalog = Catalog(partitions, s, m, lambda what, known:
                               self.recovery.check_recovering(what, known))
        self.consistency = Consistency(s, m, self.members)
        self.sequencer = Sequencer(partitions, s, m, self.table, self.members)
        self.delivery = Delivery(partitions, m, self.members, self.sequencer)
        self.recovery = Recovery(s, m, self.members, self.table, self.catalog, self.sequencer,
                                 self.acked, replay, now)
        self.reads = Reads(partitions, s, m, self.members, self.table, self.catalog,
                           self.sequencer, self.consistency)
        self.settlement = Settlement(s, m, self.members, self.catalog, self.table,
                                     self.sequencer, self.acked, self.reads.wake)
        self.rebalance = Rebalance(partitions, s, m, self.members, self.table, self.sequencer,
                                   self.settlement, now)
        self.shard_events = ShardEvents(self)
        self._coalesce = Coalesce(self.sequencer, m)
        self.tier_moves = TierMoves(self)
        # the containers tests and tools read, by their old names (the same objects)
        tb, sq, rb = self.table, self.sequencer, self.rebalance
        self.owners, self.standbys, self.syncing = tb.owners, tb.standbys, tb.syncing
        self.epochs, self.pbytes, self.lost = tb.epochs, tb.pbytes, tb.lost
        self.shards, self.clients = self.members.shards, self.members.clients
        self.counters, self.errors = m.counters, m.errors
        self.seq, self.published_seq = sq.seq, sq.published_seq
        self.pending_entries = sq.pending_entries
        self.moves, self.move_log, self.failovers = rb.moves, rb.move_log, rb.failovers
        self.handover, self.tables = rb.handover, self.catalog.tables

    @property
    def rebalance_wanted(self) -> bool:
        return self.rebalance.wanted

    @property
    def wall(self):
        return self._wall

    @wall.setter
    def wall(self, clock) -> None:
        self._wall = clock

    def accepting(self) -> bool:
        """False while the tensor bytes queued for shards exceed the cap. The loop keeps reading
        clients either way; :class:`.flow.ByteCap` answers the pushes that find no room BUSY."""
        return self.sequencer.accepting()

    def _unheld(self, identity: bytes, msg, t) -> None:
        """A push (``msg``, descriptors ``t`` as sent) with shared-memory refs that holds
        nothing here (refused, or a resend of one already done): its slots are free."""
        ref = (identity, msg)
        if type(msg) is not int or ref in self.sequencer.shm_live:
            return
        client = self.members.clients.get(identity)
        if client is not None and client.seen.get(msg) == "pending":
            return                  # accepted: queued, or held by a bsp barrier
        if isinstance(t, list) and any(isinstance(d, dict) and "r" in d for d in t):
            self.sequencer.freed.append(ref)

    def _forbidden(self, identity: bytes, h: dict, roles, backend: bool):
        """The FORBIDDEN reply to a message whose sender's CURVE ``roles`` (None: CURVE off)
        do not permit its kind, or None when it may be acted on: the one role check, for both
        sockets, before any component sees the message."""
        refused = self.admission.role_refusal(roles, backend, h["kind"])
        if refused is None:
            return None
        if backend:
            return ToShard(identity, [wire.error(Code.FORBIDDEN, refused)])
        ids = {k: h[k] for k in ("msg", "req") if isinstance(h.get(k), int)}
        return ToClient(identity, [wire.error(Code.FORBIDDEN, refused, **ids)])

    # ------------------------------------------------------------------ frontend
    def on_frontend(self, identity: bytes, frames: list, now: float, roles=None) -> list:
        """``roles``: the sender's CURVE key's roles (None with CURVE off)."""
        self.meters.counters["frontend_msgs"] += 1
        self.now = self.settlement.now = self.recovery.now = now
        if not frames:
            self.meters.errors[Code.BAD_FRAME.value] += 1
            return []
        try:
            h = wire.unpack_header(frames[0], wire.FRONTEND_KINDS)
        except WireError as e:
            return [self.meters.err(identity, e.code, str(e.args[0]))]
        refused = self._forbidden(identity, h, roles, False)
        if refused is None and h["kind"] == wire.INIT and ("imp" in h or "drop" in h):
            # a tier move's import or drop is an ops command's: the role ADMIN needs
            refused = self._forbidden(identity, {**h, "kind": wire.ADMIN}, roles, False)
        if refused is not None:
            return [refused]
        kind = h["kind"]
        try:     # every field, nested ones included, checked once (codecs/messages.py)
            m = messages.from_header(h, self.P)
        except messages.FieldError as e:
            if kind not in _NOT_WORKERS:   # it passed steps 1-6: the sender is a worker
                self.members.client(identity, now)
            return self._refused(identity, h, [self.meters.err(identity, e.code,
                                                               str(e.args[0]), **e.ids)])
        if kind == wire.HELLO:   # discovery only: registers nobody
            shm = {"shm": self.shm} if self.shm is not None else {}
            return [ToClient(identity, [wire.pack(wire.WELCOME, events=self.ports["events"],
                                                  backend=self.ports["backend"],
                                                  partitions=self.P, down=self.table.down(),
                                                  hb=self.settings.heartbeat_interval,
                                                  run=self.run, **shm, **self.tier.wire(),
                                                  **({"bepoch": self.broker_epoch}
                                                     if self.broker_epoch else {}))])]
        if kind == wire.STATUS:   # ops tools are not workers
            st = self.status(now)
            if m.table:
                st["table"] = self.partition_table()
            return [ToClient(identity, [wire.pack(wire.STATUS_REPLY, req=m.req, status=st)])]
        if kind == wire.BYE:
            self.members.clients.pop(identity, None)
            self.delivery.forget(identity)
            return []
        if kind in (wire.DIGEST, wire.CHECKPOINT):
            return self.reads.fanout(identity, m)
        if kind == wire.ADMIN:
            if m.op == "tier":
                try:
                    return self._coalesce(self.tier_moves.admin(identity, m))
                except WireError as e:
                    return [self.meters.err(identity, e.code, str(e.args[0]), req=m.req)]
            return self._coalesce(self.rebalance.admin(identity, m, now))
        client = self.members.client(identity, now)
        try:
            if kind == wire.PUSH:
                actions = self._push(client, m, frames[1:])
                if frames[1:] and not wire.frame_len(frames[1]) and m.t:
                    client.shm = True                  # its tensors are in its ring
                    self._unheld(identity, m.msg, m.t)
                return self._coalesce(actions)
            if kind == wire.INIT:
                return self._init(client, m, frames[1:])
            if kind == wire.SNAPSHOT:
                self.tier.check(name_of(k) for k in m.keys)   # held elsewhere: MOVED
                return self.reads.snapshot(client, m)
            if kind == wire.ROWS:
                self.tier.check((m.table,))
                return self.reads.rows(client, m)
            if kind == wire.CATALOG:
                self.tier.check_catalog(m.names, self.catalog)   # held elsewhere: MOVED
                return [ToClient(identity, self.catalog.reply(m))]
            if kind == wire.FOLLOW:
                self.delivery.follow(identity, m.ps)
                return []
            if kind == wire.CREDIT:
                return self.delivery.credit(identity, m.ps, m.seqs, m.again)
            if getattr(m, "shm", None) is not None:    # HEARTBEAT: registered, last_seen set
                client.shm = m.shm
            return []
        except WireError as e:
            return self._refused(identity, h, [self.meters.err(identity, e.code, str(e.args[0]),
                                                               **_ids(m))])

    def _refused(self, identity: bytes, h: dict, actions: list) -> list:
        """A refused message's answer; a refused PUSH's shared-memory slots are free."""
        if h["kind"] == wire.PUSH:
            self._unheld(identity, h.get("msg"), h.get("t"))
        return self._coalesce(actions)

    def _push(self, client, h: messages.Push, frames: list) -> list:
        msg = h.msg
        if hops.ON:
            hops.stamp_woke("broker_wake", msg)
            hops.stamp("broker_in", msg)
        settle = self.settlement
        replay = settle.replay(client, msg)
        if replay is not None:
            return replay
        descs = h.descs(frames, self.settings.max_tensor_bytes)
        self.tier.check_keys(descs)
        self.sequencer.rings.check(descs)         # a ring the sweep removed: nobody reads it
        routed, tensors, decoded = self.catalog.route_push(descs, frames, self.table.live_owner)
        weights, bsp = self.consistency.check(tensors, h.ver, client)
        counters = self.meters.counters
        counters["push_wire_bytes"] += sum(d.nbytes for d in descs)
        counters["push_decoded_bytes"] += decoded
        settle.remember(client, msg, "pending")
        client.count_push(self.now)
        counters["pushes_received"] += 1
        if bsp is not None:    # held until the step's gradients are all in
            self.consistency.hold(bsp, client, h, routed, weights)
            counters["bsp_held"] += 1
            self.consistency.release(self._enqueue_push)
            return []
        self._enqueue_push(client, h, routed, weights)
        return []

    def _enqueue_push(self, client, h: messages.Push, routed: list, weights: dict,
                      step: bool = False) -> None:
        msg = h.msg
        ref = (client.identity, msg)
        tables = tuple({n for (_, d, _, n) in routed if d.ids is not None})
        names = tuple({n for (_, d, _, n) in routed if d.ids is None})
        self.settlement.pending[ref] = Pending(client.identity, msg, "push", len(routed),
                                               acks=ALL if h.acks == ALL else 1, t0=self.now,
                                               tables=tables, step=step, names=names)
        if step:
            for name in tables:
                self.catalog.tables[name].stepping += 1
        self.sequencer.enqueue_push(ref, h, routed, weights, self._wall)

    def _init(self, client, h: messages.Init, frames: list) -> list:
        msg = h.msg
        replay = self.settlement.replay(client, msg)
        if replay is not None:
            return replay
        if h.imp is not None or h.drop is not None:     # a tier move's (24.4)
            return self._coalesce(self.tier_moves.init(client, h, frames))
        self.tier.check_init(h)
        plan = self.catalog.plan_init(h, frames, self.table)
        if (plan.blocks or plan.tables) and not self.members.live_shards():
            raise WireError(Code.NO_SHARDS, "no live shard to place parameters on")
        if not plan.blocks and not plan.tables:
            return self.settlement.reply(client, msg, [wire.pack(
                wire.INIT_OK, msg=msg, created=[], existing=plan.existing)])
        # all checks passed: mutate
        ref = (client.identity, msg)
        layouts = {}
        for layout, rule, key, p, g in plan.blocks:
            layouts[layout.name] = layout
            self.table.place(p)
            self.table.account(p, layout.block_bytes(split_key(key)[1]))
            entry = {"op": "init", "key": key, "layout": layout.to_wire(), "rule": rule,
                     "opt": plan.opt}
            self.sequencer.enqueue(p, entry, g[1] if g else None, g[2] if g else None, ref)
        self.catalog.add_tensors(layouts.values(), plan.opt, plan.cons)
        parts = 0
        for name, cfg in plan.tables:    # each of its partitions gets the table's (empty) rows
            ps = table_partitions(name, self.P, cfg["spread"]).tolist()
            for p in ps:
                self.table.place(p)
                self.sequencer.enqueue(p, {"op": "init", "key": row_key(name, p), "table": cfg},
                                       None, None, ref)
            parts += len(ps)
            self.catalog.add_table(name, cfg)
        self.settlement.expect(Pending(client.identity, msg, "init", len(plan.blocks) + parts,
                                       reply={"created": plan.created,
                                              "existing": plan.existing}), client)
        return [Publish(self.table.message())]

    # ------------------------------------------------------------------ batching
    def flush(self, now: float) -> list:
        """Turn pending entries into sequenced batches: one message per replica group that has
        credit, the same header and tensor frames to every replica of those partitions; then
        the reads no queued entry blocks."""
        self.now = self.settlement.now = self.recovery.now = now
        actions = []
        replaying = self.recovery.replaying
        if replaying:
            self.recovery.flush(now, actions)
        self.sequencer.flush(now, replaying, self._wall, actions)
        self.reads.dispatch(replaying, actions)
        return self._coalesce(actions)

    def has_flushable(self) -> bool:
        """True when flush() would send something now (every in-sync replica has credit)."""
        replaying = self.recovery.replaying
        return (self.recovery.has_flushable() or self.sequencer.has_flushable(replaying)
                or self.reads.has_flushable(replaying))

    # ------------------------------------------------------------------ backend
    def on_backend(self, identity: bytes, frames: list, now: float, log_index=None,
                   roles=None, key: str | None = None) -> list:
        """A shard's message. ``log_index``: this broker's update log, read by the loop for a
        REGISTER the core answered with :class:`~.actions.ReadLog` (its roles were checked
        when it arrived); ``roles``: the sender's CURVE key's roles, ``key`` the key (both
        None with CURVE off)."""
        if log_index is None:
            self.meters.counters["backend_msgs"] += 1
        self.now = self.settlement.now = self.recovery.now = now
        ev = self.shard_events
        try:
            h = wire.unpack_header(frames[0], wire.BACKEND_KINDS) if frames else None
            if h is None:
                raise WireError(Code.BAD_FRAME, "empty message")
        except WireError as e:
            self.meters.errors[e.code.value] += 1
            return [ToShard(identity, [wire.error(e.code, str(e.args[0]))])]
        refused = self._forbidden(identity, h, roles, True) if log_index is None else None
        if refused is not None:
            return [refused]
        kind = h["kind"]
        if kind == wire.REGISTER:
            try:
                m = messages.from_header(h, self.P)
            except messages.FieldError as e:
                self.meters.errors[e.code.value] += 1
                return [ToShard(identity, [wire.error(e.code, str(e.args[0]))])]
            if (log_index is None and self.recovery.needs_log(m)
                    and ev.claim(identity, m, key, now) is None):   # refused without the log
                return [ReadLog(identity, frames, key)]
            self.recovery.log_index = log_index
            try:
                return self._coalesce(ev.register(identity, m, now, key))
            finally:
                self.recovery.log_index = None
        s = self.members.shard_of(identity)
        if s is None:
            # Unknown or declared dead: it must register again before anything else counts.
            self.meters.errors[Code.NOT_REGISTERED.value] += 1
            return [ToShard(identity, [wire.error(Code.NOT_REGISTERED, "send register first")])]
        s.last_seen = now
        try:     # every field, nested ones included, checked once (codecs/messages.py)
            m = messages.from_header(h, self.P)
            updates = m.updates(frames[1:]) if kind == wire.APPLIED else None
        except WireError as e:
            # A shard bug, not a client's: count it loudly (an APPLIED's credit returns).
            self.meters.errors[e.code.value] += 1
            if kind == wire.APPLIED:
                s.inflight = max(0, s.inflight - 1)
                self.meters.errors["bad_applied"] += 1
            log.error("malformed %s from %s: %s", kind, s.id, e)
            return [ToShard(identity, [wire.error(e.code, str(e.args[0]))])]
        if kind == wire.HEARTBEAT:
            if m.info is not None:
                s.info = m.info
            return []
        if kind == wire.APPLIED:
            out = ev.applied(s, m, updates, now)
            if self.tier_moves.fences:
                out += self.tier_moves.drained()
            return self._coalesce(out)
        if kind in (wire.SNAPSHOT_REPLY, wire.ROWS_REPLY, wire.DIGEST_REPLY,
                    wire.CHECKPOINT_REPLY):
            return self.reads.replied(s, m, frames)
        if kind == wire.STATE:
            mover = self.tier_moves.exported(m, frames)
            return mover if mover is not None else ev.forward_state(s, m, frames)
        if kind == wire.SYNCED:
            return self._coalesce(ev.synced(s, m, now))
        if kind == wire.ERROR:
            self.meters.errors["shard_" + m.code] += 1
            if m.code == Code.SHM_TORN.value:     # a STATE it could not read whole
                return ev.state_torn(s, m)
            log.warning("shard %s reports %s: %s", s.id, m.code, m.message)
            return []
        if kind == wire.BYE:
            s.left = True      # gone on purpose: not silent
            return self._coalesce(ev.shard_dead(s, now, "said bye"))
        return []

    # ------------------------------------------------------------------ clock
    def on_tick(self, now: float) -> list:
        self.now = self.settlement.now = self.recovery.now = now
        rb, st = self.rebalance, self.settings
        actions = self.shard_events.silent(now)
        if rb.handover:      # a moved primary that never reported its last batches
            deadline = st.shard_deadline
            for p, seq in rb.end_handovers(lambda ho: now - ho[2] > deadline):
                actions += self.delivery.unpublished(p, seq)
        self.members.expire_clients(now, self.settlement.busy)
        self.delivery.forget_gone(self.members.clients)
        actions += rb.repair(now)
        if self.consistency.barriers:
            self.consistency.release(self._enqueue_push)
        self.recovery.tick(now, actions)
        if rb.draining or rb.wanted:
            actions += rb.plan(now)
        if self.tier_moves.fences:
            actions += self.tier_moves.drained()
        if now - self.last_hb_sent >= st.heartbeat_interval:
            self.last_hb_sent = now
            hb = wire.pack(wire.HEARTBEAT)
            actions += [ToShard(s.identity, [hb]) for s in self.members.live_shards()]
            actions.append(self.events_heartbeat())
        return self._coalesce(actions)

    def events_heartbeat(self) -> Publish:
        """The heartbeat on events, every interval and to a new subscriber of it at once (it
        learns this broker's run id without waiting an interval). It names the last seq
        published per partition: a subscriber that is behind one of them lost the tail of that
        stream (XPUB drops on HWM) and re-snapshots, even when no later update would reveal
        the gap."""
        published = self.sequencer.published_seq
        ps = sorted(published)
        tv = {n: t.version for n, t in self.catalog.tensors.items() if t.cons["mode"] != "async"}
        return Publish([wire.TOPIC_HEARTBEAT, wire.pack(
            wire.HEARTBEAT, ps=ps, seqs=[published[p] for p in ps], run=self.run,
            **({"tv": tv} if tv else {}))])

    def on_published(self, p: int, frames: list | None, owners: tuple, now: float,
                     seq: int | None = None) -> list:
        """The loop published a :class:`~.actions.Capture`: ``frames`` as published, with
        the blocks a shard referenced in its board copied into them (None when one was
        rewritten before it was read whole; ``seq`` is then the UPDATE's). Conflated
        delivery caches it and sends it to the followers that are to get it."""
        self.now = now
        return self.delivery.published_update(p, frames, owners, seq)

    # ------------------------------------------------------------------ views
    def status(self, now: float) -> dict:
        return _status.status(self, now)

    def metrics(self, now: float) -> dict:
        """A snapshot for the Prometheus exporter (built on the loop's thread)."""
        return _status.metrics(self, now)

    def partition_table(self) -> dict:
        """The partition table: per partition its primary, in-sync standbys, standbys catching
        up, epoch and last seq."""
        return _status.table(self)

    def validate_state(self) -> None:
        """Every component's invariants, for tests: raises RuntimeError naming what is
        broken."""
        problems = []
        for part in (self.members, self.table, self.catalog, self.sequencer, self.settlement,
                     self.consistency, self.rebalance, self.recovery, self.acked,
                     self.admission, self.delivery):
            problems += part.validate_state()
        if problems:
            raise RuntimeError("; ".join(problems))

