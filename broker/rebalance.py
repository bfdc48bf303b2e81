"""Replicas, moves and drain: catch-ups that give every partition its standbys, partition
moves that balance bytes and update rates over the shards (or empty a draining one), paced so
that moving uses at most about half of the shards' time, and the hand-over of a moved primary's
last publishes."""
from __future__ import annotations

import logging
import math

import numpy as np

from gradbus.codecs import wire
from gradbus.codecs.errors import Code

from .actions import Adopt, Publish, ToClient, ToShard
from .settings import RATE_TAU

log = logging.getLogger("gradbus.broker")


def state_req(owner, p: int, t, shm: bool) -> ToShard:
    """The STATE_REQ asking ``owner`` for partition p's state for ``t``; ``shm``: it may come
    through the owner's reply area (both read shared memory)."""
    refs = {"shm": True} if shm and owner.shm and t.shm else {}
    return ToShard(owner.identity, [wire.pack(wire.STATE_REQ, p=p, to=t.id, **refs)])


class Rebalance:
    def __init__(self, partitions: int, settings, meters, members, table, sequencer,
                 settlement, now: float):
        self.P = partitions
        self.settings = settings
        self.meters = meters
        self.members = members
        self.table = table
        self.sequencer = sequencer
        self.settlement = settlement
        # p -> {"from", "to", "since"}: the copy catches up like a standby, then takes the
        # place of "from" (the primary's with a new epoch).
        self.moves: dict[int, dict] = {}
        self.next_move_at = 0.0          # moves are paced (MOVE_PACE)
        self.move_log: list[dict] = []
        self.failovers: list[dict] = []  # the most recent ones
        self.wanted = False              # a rebalance was asked for (or a new shard came)
        self.draining: set[str] = set()
        # A moved primary still publishes the batches it was sent as primary: p -> (its id,
        # the last such seq, since). Subscribers then see no gap, and re-fetch nothing.
        self.handover: dict[int, tuple[str, int, float]] = {}
        self.prate = np.zeros(partitions)   # gradients per second per partition (RATE_TAU)
        self.prate_at = now

    # ------------------------------------------------------------------ catch-ups
    def start_catch_up(self, p: int, t, now: float) -> list:
        """Shard ``t`` starts catching up on p: a snapshot of the primary at its seq S, then
        the batches after S, which ``t`` receives from now on."""
        self.table.start_catch_up(p, t, now)
        owner = self.members.shards[self.table.owners[p]]
        return [Adopt(t.identity, [wire.pack(wire.ADOPT, p=p)], p=p),
                state_req(owner, p, t, t.shm)]

    def sync_room(self, p: int) -> bool:
        """Whether another copy of partition p may start catching up now: fewer than
        ``max_syncs`` copies are, holding at most ``max_sync_bytes`` with p's (or none is)."""
        syncing, pbytes = self.table.syncing, self.table.pbytes
        busy = sum(len(v) for v in syncing.values())
        if not busy:
            return True
        held = sum(pbytes[q] * len(v) for q, v in syncing.items())
        return (busy < self.settings.max_syncs
                and held + pbytes[p] <= self.settings.max_sync_bytes)

    def repair(self, now: float) -> list:
        """Give every partition ``replicas`` copies: a catch-up on the live shard holding
        fewest bytes for each partition short of standbys."""
        tb = self.table
        if tb.replicas <= 1:
            return []
        live = self.members.live_shards()
        if len(live) < 2:
            return []
        actions = []
        for p in range(self.P):
            owner = tb.owners[p]
            if owner is None or p in tb.lost or not tb.live(owner):
                continue
            have = 1 + len(tb.standbys[p]) + len(tb.syncing.get(p, ()))
            while have < tb.replicas and self.sync_room(p):
                cands = [x for x in live if not tb.holds(x.id, p)]
                if not cands:
                    break
                t = min(cands, key=lambda x: (x.bytes, len(x.partitions), x.id))
                actions += self.start_catch_up(p, t, now)
                self.meters.counters["syncs_started"] += 1
                have += 1
        return actions

    # ------------------------------------------------------------------ moves
    def start_move(self, p: int, src: str, dst: str, now: float) -> list:
        actions = self.start_catch_up(p, self.members.shards[dst], now)
        self.table.start_leaving(p, src)       # counted where it is going, from now on
        self.moves[p] = {"from": src, "to": dst, "since": now}
        self.meters.counters["moves_started"] += 1
        return actions

    def finish_move(self, p: int, mv: dict, synced_seq: int, now: float) -> list:
        """The new copy is in sync: it takes the old one's place (as primary with the next
        epoch when the old one led), and the old one drops the partition."""
        del self.moves[p]
        src, dst = mv["from"], mv["to"]
        was_primary = src == self.table.owners[p]
        if not self.table.finish_move(p, src, dst):
            return []      # the old copy is gone already (it died): the new one just stays
        seq = self.sequencer.seq[p]
        if was_primary and seq > self.sequencer.published_seq.get(p, 0):
            # Every batch sent so far names the old primary as its publisher (the new one
            # applies them silently): the old one still publishes those it has not reported.
            self.handover[p] = (src, seq, now)
        actions = []
        for (bp, bseq), b in list(self.sequencer.inflight.items()):
            if bp != p:
                continue
            if bseq > synced_seq:
                b.waiting.add(dst)    # sent to it while it caught up: it applies them next
            if src in b.waiting:
                b.waiting.discard(src)
                actions += self.settlement.progress(p, bseq, b)
        old = self.members.shards[src]
        if old.alive:
            actions.append(ToShard(old.identity, [wire.pack(wire.DROP, ps=[p])]))
        self.meters.counters["moves"] += 1
        self.next_move_at = max(self.next_move_at,
                                now + self.settings.move_pace * (now - mv["since"]))
        self.move_log.append({"p": p, "from": src, "to": dst, "bytes": self.table.pbytes[p],
                              "seconds": round(now - mv["since"], 3), "at": now})
        del self.move_log[:-256]
        log.info("partition %d moved %s -> %s in %.3fs", p, src, dst, now - mv["since"])
        if src in self.draining:
            actions += self.maybe_drained(old)
        return actions

    def cancel_moves(self, sid: str) -> None:
        """Moves to or from a dead shard, or whose catch-up was cancelled, are forgotten."""
        for p, mv in list(self.moves.items()):
            if sid in (mv["from"], mv["to"]) or p not in self.table.syncing:
                del self.moves[p]
                self.table.stop_leaving(p)     # the source keeps its copy after all
        self.draining.discard(sid)

    def maybe_drained(self, s) -> list:
        if s.partitions or any(m["from"] == s.id for m in self.moves.values()):
            return []
        self.draining.discard(s.id)
        log.info("shard %s drained: stopping it", s.id)
        self.meters.counters["shards_drained"] += 1
        return [ToShard(s.identity, [wire.pack(wire.STOP)])] if s.alive else []

    def release_standby(self, p: int, s) -> list:
        self.table.drop_standby(p, s)
        for (bp, _seq), b in list(self.sequencer.inflight.items()):
            if bp == p and s.id in b.waiting:
                b.waiting.discard(s.id)
        self.table.bump()
        return [ToShard(s.identity, [wire.pack(wire.DROP, ps=[p])])]

    def end_handovers(self, which) -> list[tuple[int, int]]:
        """Give up on moved primaries' last publishes (``which(handover)`` true): heartbeats
        name the seq they were to reach, so subscribers that missed some re-snapshot. Returns
        the ``(p, seq)`` so counted as published without an UPDATE."""
        published = self.sequencer.published_seq
        out = []
        for p, ho in list(self.handover.items()):
            if which(ho):
                del self.handover[p]
                if ho[1] > published.get(p, 0):
                    published[p] = ho[1]
                    out.append((p, ho[1]))
        return out

    # ------------------------------------------------------------------ planning
    def fold_rates(self, now: float) -> None:
        """Each partition's update rate: an exponentially weighted count of the gradients
        batched into it (time constant RATE_TAU), brought up to ``now``."""
        decay = math.exp(-max(0.0, now - self.prate_at) / RATE_TAU)
        self.prate = self.prate * decay + np.asarray(self.sequencer.pcount) / RATE_TAU
        self.sequencer.pcount = [0] * self.P
        self.prate_at = now

    def loads(self, now: float) -> tuple[dict, dict]:
        """Per partition ``(share of all parameter bytes, share of all updates per second)``,
        and per shard the sums over its copies (a copy moving away counts where it goes)."""
        self.fold_rates(now)
        rates = self.prate.tolist()
        pbytes, owners = self.table.pbytes, self.table.owners
        tb, tr = sum(pbytes), sum(rates)
        w = {p: (pbytes[p] / tb if tb else 0.0, rates[p] / tr if tr else 0.0)
             for p in range(self.P) if owners[p] is not None}
        leaving = {(mv["from"], p) for p, mv in self.moves.items()}
        load = {}
        for s in self.members.shards.values():
            held = [w[p] for p in s.partitions if (s.id, p) not in leaving and p in w]
            load[s.id] = [sum(x[0] for x in held), sum(x[1] for x in held)]
        return w, load

    def _movable(self, p: int) -> bool:
        tb = self.table
        return p not in self.moves and p not in tb.syncing and tb.live(tb.owners[p])

    def _best_move(self, w: dict, load: dict, targets: list):
        """The move that most lowers the sum over shards of (bytes share)^2 + (rate share)^2,
        from one of the two most loaded shards to one of the two least: ``(p, src, dst)``,
        or None when no move lowers it by more than ``min_gain``."""
        order = sorted(targets, key=lambda x: (sum(load[x.id]), x.id))
        best, gain = None, -self.settings.min_gain
        for s in order[-2:]:
            bs, rs = load[s.id]
            for p in s.partitions:
                if p not in w or not self._movable(p):
                    continue
                b, r = w[p]
                for t in order[:2]:
                    if t is s or self.table.holds(t.id, p):
                        continue
                    bt, rt = load[t.id]
                    d = 2 * b * (b + bt - bs) + 2 * r * (r + rt - rs)
                    if d < gain:
                        best, gain = (p, s, t), d
        return best

    def plan(self, now: float) -> list:
        """Start moves while catch-ups may: everything off draining shards first, then from
        the most loaded shard to the least (load: bytes and update rate), each move only if
        it narrows the gap (so plans converge and never oscillate)."""
        actions = []
        tb = self.table
        targets = [x for x in self.members.shards.values()
                   if x.alive and x.id not in self.draining]
        if not targets or now < self.next_move_at:
            return actions
        w, load = self.loads(now)
        for sid in sorted(self.draining):
            src = self.members.shards[sid]
            for p in sorted(src.partitions):
                if tb.owners[p] is None or not self._movable(p):
                    continue
                if not self.sync_room(p):
                    return actions
                cands = [x for x in targets if not tb.holds(x.id, p)]
                if not cands:    # no other shard can take this copy: let it go (a standby)
                    if sid in tb.standbys[p]:
                        actions += self.release_standby(p, src)
                    continue
                dst = min(cands, key=lambda x: (sum(load[x.id]), x.id))
                actions += self.start_move(p, sid, dst.id, now)
                for i in (0, 1):
                    load[dst.id][i] += w.get(p, (0.0, 0.0))[i]
            actions += self.maybe_drained(src)
        if not (self.wanted and len(targets) > 1):
            return actions
        moved = False
        while True:
            mv = self._best_move(w, load, targets)
            if mv is None or not self.sync_room(mv[0]):
                moved = moved or mv is not None     # waits for room, not balanced yet
                break
            p, src, dst = mv
            actions += self.start_move(p, src.id, dst.id, now)
            for i in (0, 1):
                load[src.id][i] -= w[p][i]
                load[dst.id][i] += w[p][i]
            moved = True
        if not moved and not self.moves:
            self.wanted = False     # balanced
        return actions

    def validate_state(self) -> list[str]:
        problems = []
        for p, mv in self.moves.items():
            if mv["to"] not in self.table.syncing.get(p, ()):
                problems.append(f"move of {p} to {mv['to']} is not catching up")
            if self.table.leaving.get(p) != mv["from"]:
                problems.append(f"move of {p} from {mv['from']} not counted as leaving")
        for p in self.table.leaving:
            if p not in self.moves:
                problems.append(f"partition {p} leaves a shard but no move is under way")
        return problems

    def admin(self, identity: bytes, h, now: float) -> list:
        """Ops commands: ``rebalance``, ``drain`` (with ``shard``)."""
        op, req = h.op, h.req
        if op == "rebalance":
            self.wanted = True
            actions = self.plan(now)
            result = {"moves_started": sum(1 for a in actions if isinstance(a, Adopt))}
        else:    # "drain": the op was checked when the message was unpacked
            sid = h.shard
            s = self.members.shards.get(sid) if sid is not None else None
            if s is None or not s.alive:
                return [self.meters.err(identity, Code.BAD_REQUEST,
                                        f"drain: no live shard {sid!r}", req=req)]
            if not any(x.alive and x.id != sid for x in self.members.shards.values()):
                return [self.meters.err(identity, Code.BAD_REQUEST,
                                        f"drain: {sid} is the only live shard", req=req)]
            self.draining.add(sid)
            actions = self.plan(now)
            result = {"shard": sid, "partitions": len(s.partitions)}
        actions.append(ToClient(identity, [wire.pack(wire.ADMIN_REPLY, req=req, result=result)]))
        actions.append(Publish(self.table.message()))
        return actions
