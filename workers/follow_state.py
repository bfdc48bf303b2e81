"""Which partitions' updates the client's agent follows, and how: :class:`FollowState`.

A client that reads shared memory subscribes to a partition's topic on the events socket while
it holds the partition as frames, or while a pull waits on a live one (read from the shard's
board otherwise). A client that reads weights as frames follows its partitions by conflated
delivery (protocol section 22) over its DEALER: FOLLOW before it snapshots them, and a CREDIT
when its application reads them, except for a read of partitions it pushed to since its last
read of them (its own push's weights answer that read). A credit still unanswered while two
heartbeats name a newer seq is granted again (``again``): what answered it was lost.

Part of :class:`~.agent_state.AgentState` (``agent.follows``), which it reads its cache,
output and counters from; no socket, no clock.
"""
from __future__ import annotations

from gradbus.codecs import wire

from .actions import Send, Subscribe, Unsubscribe


class FollowState:
    def __init__(self, agent):
        self.a = agent                              # the AgentState this is part of
        self.conflated = agent.cache.conflated      # as the cache was made: no shared memory
        self.topic = wire.topic_partition_shm if agent.shm is not None else wire.topic_partition
        self.followed: set[int] = set()             # partitions whose updates we follow
        self.watched: dict[int, int] = {}           # live partition -> pulls waiting on it
        # conflated delivery: credits granted and not yet answered (p -> the seq held then),
        # partitions pushed to since their last read, credited partitions a heartbeat named a
        # newer seq of once
        self.credits: dict[int, int] = {}
        self.pushed: set[int] = set()
        self.behind: set[int] = set()

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
            self.credits[p] = part.last_seq
            ps.append(p)
            seqs.append(part.last_seq)
        if ps:
            self.a.stats["credits"] += len(ps)
            self.a.out.append(Send([wire.pack(wire.CREDIT, ps=ps, seqs=seqs)]))

    def heartbeat(self, ps, seqs) -> None:
        """An events heartbeat's last published seqs: a credit unanswered though a newer seq
        was published, at two heartbeats in a row, lost its answer: granted again."""
        if not self.credits:
            return
        cache = self.a.cache
        again, have = [], []
        for p, seq in zip(ps, seqs):
            held = self.credits.get(p)
            if held is None or seq <= held:
                continue
            if p not in self.behind:
                self.behind.add(p)
                continue
            self.behind.discard(p)
            part = cache.parts.get(p)
            if part is None or part.resync:
                del self.credits[p]       # the snapshot on its way answers it
                continue
            self.credits[p] = part.last_seq
            again.append(p)
            have.append(part.last_seq)
        if again:
            self.a.stats["credits_again"] += len(again)
            self.a.out.append(Send([wire.pack(wire.CREDIT, ps=again, seqs=have, again=True)]))

    def updated(self, p: int) -> None:
        """An UPDATE of ``p`` came: whatever came answers its credit."""
        if self.conflated:
            self.credits.pop(p, None)
            self.behind.discard(p)

    def broker_restarted(self) -> None:
        """Another broker process answers now: a conflated follower follows again (before its
        partitions are snapshot again), with no credit held."""
        if self.conflated and self.followed:
            self.credits.clear()
            self.behind.clear()
            self.pushed.clear()
            self.a.out.append(Send([wire.pack(wire.FOLLOW, ps=sorted(self.followed))]))
