"""Which partitions' updates the client's agent follows, and how: :class:`FollowState`.

A client that reads shared memory subscribes to a partition's topic on the events socket while
it holds the partition as frames, or while a pull waits on a live one (read from the shard's
board otherwise). A client that reads weights as frames follows its partitions by conflated
delivery (protocol section 22) over its DEALER: FOLLOW before it snapshots them, and a CREDIT
when its application reads them, except for a read of partitions it pushed to since its last
read of them (its own push's weights answer that read). A credit still unanswered while
heartbeats name a newer seq is granted again (``again``): what answered it was lost, or is
still on its way. Which one the client cannot tell, so it waits as long as answers take, as the
push resend timer does (:mod:`.resend`): heartbeats are its clock (no other clock here). Each
answer to a credit granted once is a sample of how many heartbeats naming a newer seq passed
before it came (RFC 6298's smoothed time and variation; an answer to a credit granted again is
no sample, Karn's rule); a credit is granted again after the larger of ``AGAIN_BEATS`` and that
estimate, and each time it is granted again the wait for it doubles, up to
``AGAIN_MAX_BEATS``; the doubled wait is where the next credits start until a sample comes
(else, on a slow link, every credit would be granted again and no sample would ever come).
On a link that takes seconds to bring a model's weights, a credit is then waited for, not
granted again every half second (each of which the broker answers with the whole model once
more, filling the link with weights nobody reads).

Part of :class:`~.agent_state.AgentState` (``agent.follows``), which it reads its cache,
output and counters from; no socket, no clock.
"""
from __future__ import annotations

import math

from gradbus.codecs import wire

from .actions import Send, Subscribe, Unsubscribe
from .resend import RoundTrip


class _Credit:
    """A credit granted and not answered yet."""
    __slots__ = ("held", "beats", "wait", "again")

    def __init__(self, held: int, wait: int):
        self.held = held        # the seq held when it was granted (again)
        self.beats = 0          # heartbeats naming a newer seq since
        self.wait = wait        # heartbeats it is waited for
        self.again = False      # granted again: its answer is no sample


AGAIN_BEATS = 2           # heartbeats naming a newer seq before a credit is granted again ...
AGAIN_MAX_BEATS = 240     # ... at least; doubling per grant again up to this (60 s at 0.25 s)


class FollowState:
    def __init__(self, agent):
        self.a = agent                              # the AgentState this is part of
        self.conflated = agent.cache.conflated      # as the cache was made: no shared memory
        self.topic = wire.topic_partition_shm if agent.shm is not None else wire.topic_partition
        self.followed: set[int] = set()             # partitions whose updates we follow
        self.watched: dict[int, int] = {}           # live partition -> pulls waiting on it
        # conflated delivery: credits granted and not yet answered; partitions pushed to
        # since their last read
        self.credits: dict[int, _Credit] = {}
        self.pushed: set[int] = set()
        self.rtt = RoundTrip()  # heartbeats an answer takes
        self.backed = 0         # the wait a credit granted again doubled to, until a sample

    def pushed_to(self, parts) -> None:
        """A push to ``parts`` was sent: its own weights answer the next read of them."""
        if parts and self.conflated:
            self.pushed.update(parts)

    def track(self, new) -> None:
        """Partitions the cache tracks now: followed before they are snapshot (the Clone
        pattern)."""
        if self.conflated:
            if new:
                self.followed.update(new)
                self.a.out.append(Send([wire.pack(wire.FOLLOW, ps=new)]))
        else:
            for p in new:
                self.follow(p, True)

    def watch(self, parts, on: bool) -> None:
        """A pull starts (``on``) or stops waiting on ``parts``."""
        cache = self.a.cache
        for p in parts:
            n = self.watched.get(p, 0) + (1 if on else -1)
            if n > 0:
                self.watched[p] = n
            else:
                self.watched.pop(p, None)
            part = cache.parts.get(p)
            self.follow(p, n > 0 or part is None or not part.live)

    def follow(self, p: int, on: bool) -> None:
        """Subscribe to partition ``p``'s updates, or not (live partitions are read from the
        board and followed only while a pull waits on them)."""
        if on and p not in self.followed:
            self.followed.add(p)
            self.a.out.append(Subscribe(self.topic(p)))
        elif not on and p in self.followed:
            self.followed.discard(p)
            self.a.out.append(Unsubscribe(self.topic(p)))

    def went_live(self) -> None:
        """Partitions a snapshot made live: their updates are no longer followed."""
        cache = self.a.cache
        for p in cache.newly_live:
            if p not in self.watched:
                self.follow(p, False)
        cache.newly_live.clear()

    def read(self, parts, seen, waiting: bool) -> None:
        """The application read (``waiting``: waits for newer) weights of ``parts`` at seqs
        ``seen``: a credit for each followed one that has none unanswered and received
        nothing since (what came is unread yet, or wakes the waiter), unless it read a
        partition it pushed to since its last read of it (the push's own weights answered
        that read)."""
        if not self.conflated:
            return
        cache = self.a.cache
        ps, seqs = [], []
        for p, at in zip(parts, seen):
            if p not in self.followed:
                continue
            if not waiting and p in self.pushed:
                self.pushed.discard(p)
                continue
            part = cache.parts.get(p)
            if p in self.credits or part is None or part.resync or part.last_seq != at:
                continue         # an answer (or the snapshot) is on its way, or came
            self.credits[p] = _Credit(part.last_seq, self.patience())
            ps.append(p)
            seqs.append(part.last_seq)
        if ps:
            self.a.stats["credits"] += len(ps)
            self.a.out.append(Send([wire.pack(wire.CREDIT, ps=ps, seqs=seqs)]))

    def patience(self) -> int:
        """Heartbeats naming a newer seq that a credit granted now is waited for."""
        rto = self.rtt.bound()
        est = AGAIN_BEATS if rto is None else math.ceil(rto)
        return max(AGAIN_BEATS, min(AGAIN_MAX_BEATS, max(est, self.backed)))

    def heartbeat(self, ps, seqs) -> None:
        """An events heartbeat's last published seqs: a credit unanswered though newer seqs
        were published, for as many heartbeats as it is waited for, is granted again (and
        waited for twice as long)."""
        if not self.credits:
            return
        cache = self.a.cache
        again, have = [], []
        for p, seq in zip(ps, seqs):
            c = self.credits.get(p)
            if c is None or seq <= c.held:
                continue
            c.beats += 1
            if c.beats < c.wait:
                continue
            part = cache.parts.get(p)
            if part is None or part.resync:
                del self.credits[p]       # the snapshot on its way answers it
                continue
            c.held, c.beats, c.wait, c.again = (part.last_seq, 0,
                                                min(AGAIN_MAX_BEATS, 2 * c.wait), True)
            self.backed = max(self.backed, c.wait)
            again.append(p)
            have.append(part.last_seq)
        if again:
            self.a.stats["credits_again"] += len(again)
            self.a.out.append(Send([wire.pack(wire.CREDIT, ps=again, seqs=have, again=True)]))

    def updated(self, p: int) -> None:
        """An UPDATE of ``p`` came: whatever came answers its credit (a credit granted once
        makes a sample of the heartbeats an answer takes)."""
        c = self.credits.pop(p, None) if self.conflated else None
        if c is not None and not c.again:
            self.backed = 0
            self.rtt.sample(c.beats)

    def validate_state(self) -> None:
        """Raise AssertionError at the first broken invariant of the credits' waits."""
        for p, c in self.credits.items():
            assert 0 <= c.beats < c.wait <= AGAIN_MAX_BEATS, (p, c.beats, c.wait)
        assert 0 <= self.backed <= AGAIN_MAX_BEATS, self.backed
        assert AGAIN_BEATS <= self.patience() <= AGAIN_MAX_BEATS

    def broker_restarted(self) -> None:
        """Another broker process answers now: a conflated follower follows again (before its
        partitions are snapshot again), with no credit held."""
        if self.conflated and self.followed:
            self.credits.clear()
            self.pushed.clear()
            self.rtt, self.backed = RoundTrip(), 0
            self.a.out.append(Send([wire.pack(wire.FOLLOW, ps=sorted(self.followed))]))
