"""What shards say, and what it changes across the components: a registration (a new shard,
a returning one, copies adopted, fenced, or bringing a lost partition back; a takeover of a
live shard's id refused), APPLIED (publishes, versions, settlement), a catch-up's state and its
end, and a shard's death (failover, failed work)."""
from __future__ import annotations

import logging

from gradbus.codecs import hops, wire
from gradbus.codecs.errors import Code

from .actions import INLINE_REPLY, Capture, Publish, ToShard
from .rebalance import state_req

log = logging.getLogger("gradbus.broker")



class ShardEvents:
    def __init__(self, core):
        c = core
        self.P = c.P
        self.settings, self.meters = c.settings, c.meters
        self.members, self.table, self.catalog = c.members, c.table, c.catalog
        self.sequencer, self.settlement, self.reads = c.sequencer, c.settlement, c.reads
        self.rebalance, self.recovery = c.rebalance, c.recovery
        self.acked, self.admission = c.acked, c.admission
        self.delivery = c.delivery
        self.unpublished: list = []   # (p, seq) a registration took as published, no UPDATE
        self._core = c

    @property
    def shm_on(self) -> bool:
        """The broker offers shared memory (its loop set ``core.shm``)."""
        return self._core.shm is not None

    def _table_msg(self) -> Publish:
        return Publish(self.table.message())

    def _publish(self, p: int, seq: int, pub: list, refs: bool) -> Publish:
        """A part's UPDATE on events; where clients follow p by conflated delivery, also
        handed back to the core once published (:class:`~.actions.Capture`), with the
        followers whose pushes it applied."""
        frames = [wire.topic_partition(p), *pub]
        if not self.delivery.followed(p):
            return Publish(frames, refs)
        b = self.sequencer.inflight.get((p, seq))
        owners = self.delivery.owners(p, b.refs) if b is not None else ()
        return Capture(frames, refs, p, seq, owners)

    # ------------------------------------------------------------------ registration
    def register(self, identity: bytes, h, now: float, key: str | None = None) -> list:
        """A typed REGISTER (its id and holds were checked when it was unpacked) from
        connection ``identity``, sent with CURVE ``key`` (None: CURVE off)."""
        sid = h.shard
        known = self.members.shards.get(sid)
        refused = self.admission.register_refusal(known, identity, key, h.token, now,
                                                  self.settings.shard_deadline)
        if refused is not None:      # the live shard keeps its id and its partitions
            return [ToShard(identity, [wire.error(Code.SHARD_ID_IN_USE, refused)])]
        holds = {p: (epoch, seq) for p, epoch, seq in h.holds}
        rec, tb = self.recovery, self.table
        if holds or h.rejoin:
            rec.restarted = True    # shards from an earlier life: this broker may miss tensors
        elif rec.restarted is None:
            rec.restarted = False   # the first shard is new and holds nothing: a fresh cluster
        s = self.members.shards.get(sid)
        actions = []
        drop = []
        if s is None:
            s = self.members.new_shard(sid, identity, now)
            log.info("shard %s registered", sid)
            if self.settings.auto_rebalance and not holds and any(
                    x.partitions for x in self.members.shards.values()):
                self.rebalance.wanted = True     # a new, empty shard: give it a share
        else:
            if s.alive:
                actions += self.shard_dead(s, now, "re-registered")
            # A sole owner that comes back without its partitions lost them, unless the update
            # log holds them from the start; one that comes back behind is brought up to date.
            own_log: list = []        # this broker's log, read once for all its partitions
            for p in list(s.partitions):
                if p in tb.lost and p in holds and self._revive(s, p, holds[p], own_log):
                    continue
                if tb.owners[p] == sid and p not in holds:
                    if rec.replay_own_log(p, 0, own_log):
                        tb.lost.discard(p)
                    else:
                        tb.lost.add(p)
                elif tb.owners[p] != sid:
                    tb.forget(s, p)
                elif holds[p][1] < self.sequencer.seq[p] and rec.replay_own_log(
                        p, holds[p][1], own_log):
                    log.info("shard %s is behind on partition %d (seq %d < %d): replaying "
                             "the update log", sid, p, holds[p][1], self.sequencer.seq[p])
            self.members.revive(s, identity, now)
            log.info("shard %s re-registered", sid)
        held_bytes = self.catalog.learn_registration(h)
        for p in sorted(holds):
            if tb.owners[p] == sid:
                continue            # its only copy: it comes back with its data
            if p in tb.lost and self._revive(s, p, holds[p], None, held_bytes.get(p, 0)):
                continue            # a copy of a lost partition, new enough: it takes it
            if not self._adopt(s, p, holds[p], held_bytes.get(p, 0)):
                drop.append(p)      # failed over while it was away, or older: fenced
        for other, p in rec.pending_drops:   # copies a newer registration replaced
            sh = self.members.shards[other]
            rec.stale_holders.setdefault(p, set()).add(other)
            if sh.alive:
                actions.append(ToShard(sh.identity, [wire.pack(wire.DROP, ps=[p])]))
        rec.pending_drops.clear()
        for p in drop:
            rec.stale_holders.setdefault(p, set()).add(sid)
        if drop:
            self.meters.counters["fenced_partitions"] += len(drop)
            log.warning("shard %s: dropping %d partitions it holds from an older epoch",
                        sid, len(drop))
        self.members.by_identity[identity] = sid
        tb.bump()
        s.shm = h.shm and self.shm_on
        if s.key is None:
            s.key = key             # with CURVE, the name is this key's from now on
        s.token = h.token           # the process that holds the name now
        bepoch = {"bepoch": self._core.broker_epoch} if self._core.broker_epoch else {}
        actions.append(ToShard(identity, [wire.pack(wire.REGISTERED, shard=sid,
                                                    partitions=self.P, shm=s.shm, **bepoch)]))
        if rec.replay is not None:
            rec.replay_orphans()
        for p, seq in self.unpublished:      # copies taken over: caches cannot vouch for them
            actions += self.delivery.unpublished(p, seq)
        self.unpublished.clear()
        if drop:
            actions.append(ToShard(identity, [wire.pack(wire.DROP, ps=drop)]))
        actions.append(self._table_msg())
        return actions

    def claim(self, identity: bytes, h, key: str | None, now: float) -> str | None:
        """Why a REGISTER of shard id ``h.shard`` would be refused SHARD_ID_IN_USE, else None
        (see :meth:`~.admission.Admission.claim`)."""
        return self.admission.claim(self.members.shards.get(h.shard), identity, key, h.token,
                                    now, self.settings.shard_deadline)

    def rebuild_voters(self, lacking: list[int], now: float) -> list:
        """A pair's active broker short of the votes for ``lacking`` partitions (protocol
        section 23): catch up again the shards that registered here holding a copy of one of
        them that was dropped as stale, the partition's own voters, so that their votes count
        once they hold it. No other shard is given a copy (two sides of a cut could each
        build a majority so), and no write is taken meanwhile."""
        out: list = []
        tb, stale = self.table, self.recovery.stale_holders
        for p in lacking:
            for sid in sorted(stale.pop(p, ())):
                t = self.members.shards.get(sid)
                if (t is None or not t.alive or tb.owners[p] is None or tb.holds(sid, p)
                        or sid in tb.syncing.get(p, {}) or not tb.live(tb.owners[p])):
                    continue
                log.warning("partition %d lacks its votes: catching up shard %s, which held "
                            "a stale copy", p, sid)
                self.meters.counters["voters_rebuilt"] += 1
                out += self.rebalance.start_catch_up(p, t, now)
        return out

    def _adopt(self, s, p: int, state: tuple, nbytes: int) -> bool:
        """Whether a registering shard's copy of partition p (at ``state`` = (epoch, seq))
        becomes a replica: taken as the primary when this broker never placed p, as an in-sync
        standby when it equals the primary's registered copy and nothing was sent since, and
        as the new primary when it is newer than that copy. Otherwise it is stale."""
        epoch, seq = state
        tb, sq, rec = self.table, self.sequencer, self.recovery
        owner = tb.owners[p]
        if owner is None:
            tb.adopt_primary(s, p, epoch)
            sq.seq[p] = max(sq.seq[p], seq)
            if seq:
                sq.published_seq[p] = seq
                self.unpublished.append((p, seq))
            rec.adopted[p] = state
            self.acked.note(p, *state)
            tb.set_bytes(p, nbytes)
            self.meters.counters["partitions_adopted"] += 1
            rec.schedule_replay(p, seq)
            return True
        known = rec.adopted.get(p)
        if known is None or sq.seq[p] != known[1] or tb.holds(s.id, p):
            return False       # batches went out since: a copy from before them is stale
        if state == known and 1 + len(tb.standbys[p]) < tb.replicas:
            tb.add_standby(s, p)
            return True
        if state > known:      # newer than the copy adopted first: it takes over
            rec.adopted[p] = state
            self.acked.note(p, *state)
            sq.seq[p] = seq
            sq.published_seq[p] = seq
            self.unpublished.append((p, seq))
            for sid in tb.take_over(s, p, epoch):
                rec.pending_drops.append((sid, p))
            return True
        return False

    def _revive(self, s, p: int, state: tuple, own_log: list | None, nbytes: int = 0) -> bool:
        """A lost partition comes back on a registering shard whose copy (at ``state``) holds
        everything acknowledged for it, or (its old owner) one this broker's update log brings
        up to date from there. The copy becomes the primary; an old owner that lost it lets it
        go."""
        epoch, seq = state
        if not self.acked.covers(p, state):
            if own_log is None or not self.recovery.replay_own_log(p, seq, own_log):
                log.warning("shard %s holds lost partition %d at seq %d: too old (%s)", s.id, p,
                            seq, self.acked.lost_message(p))
                return False
        self.table.revive(s, p, epoch, nbytes)
        sq = self.sequencer
        sq.seq[p] = max(sq.seq[p], seq)
        self.meters.counters["partitions_revived"] += 1
        log.info("partition %d is back on shard %s (epoch %d, seq %d)", p, s.id, epoch, seq)
        return True

    # ------------------------------------------------------------------ applied
    def applied(self, s, h, updates: list, now: float) -> list:
        """A typed APPLIED; ``updates``: each part's embedded UPDATE frames (None: none)."""
        actions = []
        s.inflight = max(0, s.inflight - 1)
        tb, sq, handover = self.table, self.sequencer, self.rebalance.handover
        for part, pub in zip(h.parts, updates):
            p, seq = part.p, part.seq
            primary = s.id == tb.owners[p]
            ho = handover.get(p)
            if ho is not None and ho[0] == s.id and not primary and s.id not in tb.standbys[p]:
                if seq <= ho[1] and pub is not None:     # sent to it as the primary
                    actions.append(self._publish(p, seq, pub, s.shm))
                    sq.published_seq[p] = max(seq, sq.published_seq.get(p, 0))
                if seq >= ho[1]:
                    del handover[p]
                continue
            if not primary and s.id not in tb.standbys[p]:
                if s.id not in tb.syncing.get(p, ()):
                    self.meters.errors[Code.FENCED.value] += 1   # not a replica of p (any more)
                continue
            if primary:
                if pub is not None:
                    actions.append(self._publish(p, seq, pub, s.shm))
                    b = sq.inflight.get((p, seq))
                    pending = self.settlement.pending
                    for ref in (b.refs if b is not None and not b.primary_done else ()):
                        pend = pending.get(ref)
                        if pend is not None and pend.kind == "push":
                            self.meters.h_visible.observe(now - pend.t0)
                # Even unpublished (applied as a standby just before a failover), the seq is
                # named in heartbeats, so subscribers see they missed it and re-snapshot.
                if seq > sq.published_seq.get(p, 0):
                    sq.published_seq[p] = seq
                    if pub is None:
                        actions += self.delivery.unpublished(p, seq)
                tr, vers = part.tr, part.vers
                if tr is not None:
                    grown = self.catalog.learn_rows(p, tr)
                    if grown:
                        tb.account(p, grown)
                if vers:
                    self.catalog.learn_versions(vers)
            b = sq.inflight.get((p, seq))
            if b is None:
                continue
            if b.errors is None:
                b.errors = {e[0]: (e[1], e[2]) for e in part.errors}
            b.waiting.discard(s.id)
            if hops.ON:
                msgs = [r[1] for r in b.refs]
                hops.stamp_woke("broker_wake_applied", msgs)
                hops.stamp("broker_applied", msgs)
            actions += self.settlement.progress(p, seq, b)
        return actions

    # ------------------------------------------------------------------ catch-ups
    def forward_state(self, s, h, frames: list) -> list:
        """A primary's export of partition p for a standby catching up: pass it on."""
        p, to = h.p, h.to
        target = self.members.shards.get(to)
        if (s.id != self.table.owners[p] or target is None
                or not target.alive or to not in self.table.syncing.get(p, ())):
            self.meters.counters["states_discarded"] += 1
            return []
        self.meters.counters["state_bytes"] += sum(d.get("n", 0) for d in h.t
                                                   if type(d) is dict and type(d.get("n")) is int)
        if not wire.has_refs(h.t):
            return [ToShard(target.identity, frames)]
        self.meters.counters["shm_states"] += 1
        if target.shm:
            return [ToShard(target.identity, frames)]
        # a standby without shared memory: the bytes copied out, or asked again as frames
        return [ToShard(target.identity, frames, INLINE_REPLY,
                        torn=state_req(s, p, target, False))]

    def state_torn(self, s, h) -> list:
        """A standby could not read a STATE whole (``SHM_TORN`` with ``p``): nothing was
        installed; the primary is asked again, with frames this time."""
        p = h.header.get("p")
        if (type(p) is not int or not 0 <= p < self.P
                or s.id not in self.table.syncing.get(p, ())):
            return []
        owner = self.members.shards.get(self.table.owners[p])
        if owner is None or not owner.alive:
            return []
        self.meters.counters["shm_states_torn"] += 1
        return [state_req(owner, p, s, False)]

    def synced(self, s, h, now: float) -> list:
        p = h.p
        since = self.table.synced(p, s.id)
        if since is None:
            return []
        self.meters.counters["standbys_synced"] += 1
        log.info("shard %s in sync for partition %d at seq %d (%.3fs)", s.id, p, h.seq,
                 now - since)
        actions = []
        mv = self.rebalance.moves.get(p)
        if mv is not None and mv["to"] == s.id:
            actions += self.rebalance.finish_move(p, mv, h.seq, now)
        return [*actions, self._table_msg()]

    # ------------------------------------------------------------------ death
    def shard_dead(self, s, now: float, why: str) -> list:
        log.warning("shard %s declared dead (%s)", s.id, why)
        s.alive = False
        self.meters.counters["shards_lost"] += 1
        tb, rb = self.table, self.rebalance
        actions = []
        err = (Code.SHARD_UNAVAILABLE.value, f"shard {s.id} died before applying ({why})")
        for p, seq in rb.end_handovers(lambda ho: ho[0] == s.id):
            actions += self.delivery.unpublished(p, seq)
        for p in range(self.P):
            tb.cancel_catch_up(p, s.id)
            if s.id in tb.standbys[p]:
                tb.drop_standby(p, s)
            if tb.owners[p] != s.id:
                continue
            new = tb.fail_over(p, s)
            if new is None:
                # No copy left: what was in flight or queued for p fails; the partition waits
                # for this shard to come back (or is lost).
                actions += self.settlement.fail(self.sequencer.fail_partition(p), err)
                continue
            # Failover: the in-sync standby has every batch the primary was sent, in order.
            for sid in list(tb.syncing.get(p, ())):
                # its state was to come from the dead primary: start again from the new one
                tb.cancel_catch_up(p, sid)
                sh = self.members.shards[sid]
                if sh.alive:
                    actions.append(ToShard(sh.identity, [wire.pack(wire.DROP, ps=[p])]))
            self.meters.counters["failovers"] += 1
            rb.failovers.append({"p": p, "from": s.id, "to": new, "epoch": tb.epochs[p],
                                 "at": now, "silent_s": round(now - s.last_seen, 3)})
        del rb.failovers[:-256]
        rb.cancel_moves(s.id)
        actions += self.settlement.applied_by(s.id)
        actions += self.reads.shard_gone(s, err[1])
        s.inflight = 0
        tb.bump()
        actions.append(self._table_msg())
        return actions

    def silent(self, now: float) -> list:
        """Shards silent past liveness are declared dead."""
        actions = []
        for s in self.members.silent_shards(now):
            actions += self.shard_dead(s, now, f"silent {now - s.last_seen:.2f}s")
        return actions
