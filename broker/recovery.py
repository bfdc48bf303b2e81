"""Recovery: a restarted broker relearning its cluster from the shards' registrations (and
refusing with RECOVERING meanwhile), and replays from an update log, whose contents reach the
core as events (a :class:`~.log.LogIndex` at start or with a REGISTER), never read here.

Also the update log's write policy: the core asks the loop to append each batch before it is
sent (:class:`~.actions.AppendLog`) and to fsync (:class:`~.actions.SyncLog`) as the fsync policy
says, timed by the injected clock.
"""
from __future__ import annotations

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import split_key

from .actions import AppendLog, SyncLog
from .settings import LOG_SYNC_INTERVAL


class LogPolicy:
    """When the update log is written and fsynced: ``always`` (before the batch goes to the
    shards), ``interval`` (at most LOG_SYNC_INTERVAL apart), ``never`` (the OS decides)."""

    def __init__(self, fsync: str, now: float):
        self.fsync = fsync
        self.dirty = False
        self.last_sync = now

    def append(self, actions: list, parts: list, t_list: list, frames: list, time: float,
               now: float) -> None:
        actions.append(AppendLog(parts, t_list, frames, time))
        self.dirty = True
        if self.fsync == "always":
            self.sync(actions, now)
        else:
            self.tick(actions, now)

    def tick(self, actions: list, now: float) -> None:
        if (self.fsync == "interval" and self.dirty
                and now - self.last_sync >= LOG_SYNC_INTERVAL):
            self.sync(actions, now)

    def sync(self, actions: list, now: float) -> None:
        actions.append(SyncLog())
        self.dirty = False
        self.last_sync = now


class Recovery:
    def __init__(self, settings, meters, members, table, catalog, sequencer, acked, replay,
                 now: float):
        self.settings = settings
        self.meters = meters
        self.members = members
        self.table = table
        self.catalog = catalog
        self.sequencer = sequencer
        self.acked = acked                   # replayed batches count as answered for
        self.log_policy = LogPolicy(settings.log_fsync, now) if settings.log_fsync else None
        sequencer.log_policy = self.log_policy      # batches are logged as they go out
        # After a start, keys the broker does not know may be held by shards that have not
        # registered again yet (the broker restarted). Until the grace ends, a push or snapshot
        # of an unknown key gets RECOVERING (the SDK resends), not UNKNOWN_KEY; so does an
        # init of an unknown tensor once a shard registered holding partitions.
        self.started = self.now = now
        self.restarted: bool | None = None   # unknown until a shard registers
        # A log index to replay: a partition taken from a shard at seq S gets the logged
        # batches after S (up to replay_until, wall clock) before any new one; so does one no
        # shard holds, from 0.
        self.replay = replay
        self.replaying: dict[int, list] = {}
        self.replay_done: set[int] = set()
        self.no_relog: set[int] = set()      # replays from this broker's own log
        self.log_index = None                # this broker's own log, read for a REGISTER
        self.adopted: dict[int, tuple] = {}  # p -> (epoch, seq) of a copy taken from a
        self.pending_drops: list = []        # registration (restart / restore)
        # p -> shards that registered holding a copy of p this broker dropped as stale: a
        # pair's broker without the votes may catch those up, and no other (section 23)
        self.stale_holders: dict[int, set[str]] = {}
        until = settings.replay_until
        for recs in (replay.by_p.values() if replay is not None else ()):
            for h, _ in recs:                # tensors the log created are known from the start
                if until is not None and h["time"] > until:
                    continue
                for e in h["e"]:
                    catalog.init_entry(e)

    # ------------------------------------------------------------------ restart
    def recovered(self) -> bool:
        """Every shard that may bring partitions back has registered (as many as expected),
        or the recovery grace is over."""
        expect = self.settings.expect_shards
        if expect and sum(1 for x in self.members.shards.values() if x.alive) >= expect:
            return True
        return self.now - self.started >= self.settings.recovery_grace

    def check_recovering(self, what: str, known_elsewhere: bool) -> None:
        """RECOVERING while the broker is young and the thing asked for may exist on a shard
        that has not registered again yet."""
        if self.replay is None and self.restarted is False or self.recovered():
            return      # a fresh cluster (its first shard held nothing), or recovered
        if self.restarted or known_elsewhere:
            self.meters.counters["recovering_refusals"] += 1
            raise WireError(Code.RECOVERING, f"{what}: the broker started "
                                             f"{self.now - self.started:.1f}s ago and is still "
                                             "hearing from its shards; try again")

    # ------------------------------------------------------------------ replay
    def needs_log(self, h) -> bool:
        """Whether a REGISTER may rebuild partitions from this broker's own log (a known shard
        that led partitions comes back): the loop then reads the log and hands it over."""
        if self.log_policy is None:
            return False
        s = self.members.shards.get(h.shard)
        return s is not None and any(self.table.owners[p] == s.id for p in s.partitions)

    def schedule_replay(self, p: int, seq: int) -> None:
        if self.replay is None or p in self.replay_done:
            return
        self.replay_done.add(p)
        recs = self.replay.after(p, seq, self.settings.replay_until)
        if recs:
            self.replaying[p] = recs
            self.meters.counters["replay_scheduled"] += len(recs)

    def replay_own_log(self, p: int, after: int, index: list) -> bool:
        """Rebuild partition p on its returning sole owner from this broker's own update log
        (every logged batch after ``after``); False when the log does not cover it. ``index``
        holds the log's index once taken (empty until then), shared by the calls of one
        registration."""
        if self.log_policy is None or self.log_index is None:
            return False
        if not index:
            index.append(self.log_index)
        recs = index[0].after(p, after)
        if not recs or recs[0][0]["seq"] != after + 1:
            return False
        self.replaying[p] = recs
        self.no_relog.add(p)
        self.meters.counters["replay_scheduled"] += len(recs)
        return True

    def replay_orphans(self) -> None:
        """Once recovered: partitions the log has but no shard brought back (created after the
        checkpoints) are placed and replayed from the start."""
        if self.replay is None or not self.recovered():
            return
        for p in sorted(self.replay.by_p):
            if p not in self.replay_done and self.table.owners[p] is None and self.table.place(p):
                self.schedule_replay(p, 0)

    def has_flushable(self) -> bool:
        return bool(self.replaying) and any(self.sequencer.can_send(self.table.group(p))
                                            for p in self.replaying)

    def flush(self, now: float, actions: list) -> None:
        """Send the logged batches of replaying partitions, one record per message, in order."""
        seq = self.sequencer
        for p in list(self.replaying):
            group = self.table.group(p)
            while self.replaying.get(p) and seq.can_send(group):
                h, frames = self.replaying[p].pop(0)
                self._learn_inits(p, h)
                part = {"p": p, "seq": h["seq"], "epoch": self.table.epochs[p], "o": group[0],
                        "e": h["e"]}
                seq.seq[p] = max(seq.seq[p], h["seq"])
                self.acked.note(p, self.table.epochs[p], h["seq"])
                hdr = wire.pack(wire.BATCH, h["t"], parts=[part])
                if self.log_policy is not None and p not in self.no_relog:
                    self.log_policy.append(actions, [part], h["t"], frames, h["time"], now)
                seq.send_group(group, [hdr, *frames], actions)
                self.meters.counters["replayed"] += 1
            if not self.replaying.get(p):
                self.replaying.pop(p, None)
                self.no_relog.discard(p)

    def _learn_inits(self, p: int, h: dict) -> None:
        """A replayed INIT entry of a tensor this broker does not know yet enters the catalog."""
        for e in h["e"]:
            layout = self.catalog.init_entry(e)
            if layout is not None:
                self.table.account(p, layout.block_bytes(split_key(e["key"])[1]))

    def tick(self, now: float, actions: list) -> None:
        if self.replay is not None and len(self.replay_done) < len(self.replay.by_p):
            self.replay_orphans()
        if self.log_policy is not None:
            self.log_policy.tick(actions, now)

    def validate_state(self) -> list[str]:
        problems = []
        for p in self.replaying:
            if self.table.owners[p] is None:
                problems.append(f"partition {p} replays with no primary")
        if not self.no_relog <= set(self.replaying):
            problems.append(f"partitions {sorted(self.no_relog - set(self.replaying))} marked "
                            "as replaying from the own log but not replaying")
        return problems
