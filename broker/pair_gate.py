"""A broker pair's side of the broker loop (protocol section 23): which messages reach the
core, whether this broker acts (the voters' rule, :mod:`.quorum`), what the pair link brought.

:class:`PairGate` owns the pair's state in the loop: the :class:`~.pair.Pair`, its
:class:`~.pair_link.PairLink`, and the votes as last judged (``quorate``, the partitions
``lacking`` them, and whether a REGISTER or BYE asks them to be judged again). The loop
(:mod:`.server`) calls :meth:`admits` for each message, :meth:`tick` and :meth:`acts` each
tick, and is told through ``deposed(deposed, why)`` when a newer epoch deposed this broker.
"""
from __future__ import annotations

import logging

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError

from . import quorum
from .actions import ToClient, ToShard
from .pair import Pair
from .pair_link import PairLink

log = logging.getLogger("gradbus.broker")


class PairGate:
    def __init__(self, core, pair: Pair, link: PairLink, clock, do, deposed):
        """``do(actions)`` carries out actions; ``deposed(deposed, why)`` ends the loop."""
        s = core.settings
        self.core, self.pair, self.link = core, pair, link
        self.clock, self._do, self._deposed = clock, do, deposed
        self.lease = quorum.lease(s.heartbeat_interval, s.liveness)
        pair.vote_after = s.recovery_grace
        self.quorate = False      # this broker, active, has the votes to act
        self.lacking: list[int] = []    # the partitions short of them, when it has not
        self.rejudge = False      # ... to be judged again before the next batch goes out
        core.pair_status = lambda now: {**pair.status(now),
                                        "quorum": pair.active and self.quorate}

    def admits(self, backend: bool, identity: bytes, frames: list) -> bool:
        """Whether a message goes on to the core: all do on the active broker but a shard's
        FENCED (which may depose it); on the standby a shard's HELLO does, and a REGISTER
        that makes it the active one. Everything else is answered NOT_ACTIVE."""
        pair = self.pair
        try:
            h = wire.unpack_header(frames[0], wire.BACKEND_KINDS if backend
                                   else wire.FRONTEND_KINDS)
        except (WireError, IndexError):
            return pair.active           # the core counts and answers it
        kind = h["kind"]
        if kind in ((wire.REGISTER, wire.BYE) if backend else (wire.INIT,)):
            self.rejudge = True       # copies placed or gone: the votes judged again
        if backend and kind == wire.ERROR and h["code"] == Code.FENCED.value \
                and type(h.get("bepoch")) is int:
            self._deposed(pair.fenced(h["bepoch"]), f"a shard has seen epoch {h['bepoch']}")
            return False
        if backend and kind == wire.REGISTER:
            seen, was = h.get("bepoch"), pair.active
            epoch = pair.claim(self.clock(), seen if type(seen) is int else 0)
            if epoch is not None:
                if not was:
                    self._took_over(epoch, h.get("shard"))
                return True
            if was:       # the shard has seen a newer epoch: this broker was deposed
                self._deposed(pair.deposed, f"shard {h.get('shard')!r} has seen epoch {seen}")
        elif pair.active and (backend or self.quorate):
            return True
        elif (kind == wire.HELLO and h.get("role") == "shard") or kind == wire.STATUS:
            return True          # a shard finds its backend; ops see the standby's role
        if kind == wire.BYE:
            return False
        ids = {k: v for k in ("msg", "req") if type(v := h.get(k)) is int}
        why = ("this broker of a pair lacks the votes to act (a majority of its partitions' "
               "copies, with its peer when they are even)" if pair.active
               else "this broker is the standby of its pair")
        err = [wire.error(Code.NOT_ACTIVE, f"{why}; try the other", **ids)]
        self.core.meters.errors[Code.NOT_ACTIVE.value] += 1
        self._do([ToShard(identity, err)] if backend else [ToClient(identity, err)])
        return False

    def acts(self, now: float) -> bool:
        """Whether this broker of a pair acts now: active, with the votes of protocol section
        23 for every partition it holds a counted copy of."""
        if not self.pair.active:
            self.quorate = False
            return False
        core = self.core
        lack = quorum.lacking(now, core.settings.replicas, self.lease,
                              ((s.last_seen, s.alive, s.partitions)
                               for s in core.members.shards.values()),
                              self.pair.peer_votes(now))
        if (not lack) != self.quorate:
            if lack:
                log.warning("broker pair: %d partitions lack a majority of their voters "
                            "(first %d): acting for none until they have it", len(lack),
                            lack[0])
            else:
                log.warning("broker pair: every partition has a majority of its voters: "
                            "acting")
        self.quorate, self.rejudge, self.lacking = not lack, False, lack
        return self.quorate

    def may_flush(self, now: float) -> bool:
        """Whether batches may go out now: the votes as judged, judged again first when a
        REGISTER or BYE may have placed copies or taken them away since."""
        return self.acts(now) if self.rejudge else self.quorate

    def without_votes(self, now: float) -> list:
        """The tick of an active broker without the votes: only the catch-ups of its lacking
        partitions' own voters whose stale copies it dropped (section 23)."""
        return self.core.shard_events.rebuild_voters(self.lacking, now)

    def _took_over(self, epoch: int, shard) -> None:
        core, now = self.core, self.clock()
        core.broker_epoch = epoch
        core.recovery.started = core.recovery.now = now   # hearing from its shards from now
        why = ("both were standby, and this one ranks higher" if self.pair.peer_alive(now)
               else "the peer is silent")
        log.warning("broker pair: this broker is active now, epoch %d (shard %r registered; "
                    "%s)", epoch, shard, why)
        self.link.beat(self.pair.beat())

    def tick(self, now: float, beat: bool = True) -> None:
        """What the pair link brought (``beat``: and say this broker's role)."""
        pair, lnk = self.pair, self.link
        for up in lnk.events():
            pair.link(up)
        for h in lnk.heard():
            self._deposed(pair.peer(now, h.role, h.epoch, h.run),
                          f"the peer is active at epoch {h.epoch}")
        if pair.deposed is not None:
            self._deposed(pair.deposed, "a shard registered naming a newer epoch")
        if beat:
            lnk.beat(pair.beat())


__all__ = ["PairGate"]
