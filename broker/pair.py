"""A broker pair's roles: which of two brokers is active, as a state machine without sockets
or a clock (protocol section 23).

Two brokers started with each other's pair address tell each other, every heartbeat
interval, their role, their broker epoch and their run id (PAIR, on the pair link). One is
*active*: it serves clients and shards. The other is *standby*: it answers a shard's HELLO (so
that a shard can find its backend) and nothing else; a client or a shard that reaches it is
told ``NOT_ACTIVE`` and tries the next broker it knows.

The shards decide a take-over, not the brokers alone (the zguide's Binary Star, with the
shards as the voters): a shard leaves the active only when it finds it gone (its connection
closed, or silent past liveness), and a standby becomes active only when a shard registers
with it while the peer is silent (:meth:`Pair.claim`). A link cut between the brokers alone
changes nothing: the shards still hear the active and never come. A take-over raises the
broker epoch above every one known (the peer's, the registering shard's); each shard
records the highest it saw and refuses a broker below it (``FENCED``). A broker that learns
of a higher epoch than its own while active (from its peer, or from a shard's ``FENCED``)
is deposed: its loop ends, and it starts again as the standby, holding nothing
(:class:`Deposed`).

When both are standby and alive (a fresh pair), the one with the higher ``(epoch, run)``
takes the first shard that comes; the other sends it on.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradbus.codecs import timing

from . import quorum

ACTIVE, STANDBY = "active", "standby"


@dataclass(frozen=True, slots=True)
class Deposed:
    """A broker with a higher epoch is active: this one stops serving and starts again as
    the standby."""
    epoch: int


class Pair:
    def __init__(self, run: int, epoch: int = 0, *, now: float = 0.0,
                 heartbeat_interval: float = timing.HEARTBEAT_INTERVAL,
                 liveness: int = timing.LIVENESS):
        self.run = run
        self.role = STANDBY
        self.epoch = epoch             # this broker's epoch while active; else the highest known
        self.window = heartbeat_interval * liveness
        self.peer_role: str | None = None
        self.peer_epoch = 0
        self.peer_run: int | None = None
        self.peer_heard: float | None = None
        self.peer_connected = False    # the pair link is up (the loop's monitor says)
        self.takeovers = 0
        self.refused = 0               # registrations sent on while the peer was alive
        self.deposed: Deposed | None = None
        self.started = now
        # the peer's vote (protocol section 23): counted while heard within ``vote_lease``,
        # once it has stood ``vote_after`` seconds without a break
        self.vote_lease = quorum.lease(heartbeat_interval, liveness)
        self.vote_after = 0.0
        self.voting_since: float | None = None

    # ------------------------------------------------------------------ questions
    def peer_alive(self, now: float) -> bool:
        """Heard within liveness on a link that is up."""
        return (self.peer_connected and self.peer_heard is not None
                and now - self.peer_heard <= self.window)

    def peer_votes(self, now: float) -> bool:
        """The peer votes for this broker (protocol section 23, :mod:`.quorum`): heard within
        the vote's lease, as the standby naming this broker's epoch (it has heard this one
        active at it), without a break for ``vote_after`` seconds (so that, after a take-over
        or a healed cut, the shards that were away register before one copy and the peer's
        vote are enough)."""
        if self.voting_since is not None and not (
                self.peer_connected and now - self.peer_heard <= self.vote_lease):
            self.voting_since = None
        return (self.role == ACTIVE and self.voting_since is not None
                and now - self.voting_since >= self.vote_after)

    @property
    def active(self) -> bool:
        return self.role == ACTIVE

    def beat(self) -> dict:
        """What this broker tells its peer every interval."""
        return {"role": self.role, "epoch": self.epoch, "run": self.run}

    def status(self, now: float) -> dict:
        return {"role": self.role, "epoch": self.epoch, "takeovers": self.takeovers,
                "peer": {"role": self.peer_role if self.peer_alive(now) else "silent",
                         "epoch": self.peer_epoch}}

    # ------------------------------------------------------------------ events
    def link(self, up: bool) -> None:
        """The pair link connected, or disconnected (the peer's process went away)."""
        self.peer_connected = up
        if not up:
            self.peer_heard = None
            self.voting_since = None

    def peer(self, now: float, role: str, epoch: int, run: int) -> Deposed | None:
        """A PAIR from the peer. An active peer with a higher ``(epoch, run)`` than this
        active broker deposes it."""
        self.peer_connected = True
        self.peer_votes(now)               # a vote whose lease ran out is broken
        self.peer_role, self.peer_epoch, self.peer_run = role, epoch, run
        self.peer_heard = now
        if role != STANDBY or epoch != self.epoch:
            self.voting_since = None
        elif self.voting_since is None:
            self.voting_since = now
        if role == ACTIVE and (epoch, run) > (self.epoch, self.run):
            if self.role == ACTIVE:
                return self._depose(epoch)
            self.epoch = max(self.epoch, epoch)
        return None

    def fenced(self, epoch: int) -> Deposed | None:
        """A shard refused this broker: it has seen ``epoch``."""
        if epoch > self.epoch and self.role == ACTIVE:
            return self._depose(epoch)
        self.epoch = max(self.epoch, epoch)
        return None

    def claim(self, now: float, seen: int = 0) -> int | None:
        """A shard registers (it saw broker epoch ``seen`` at most): this broker's epoch when it
        is, or now becomes, the active one; None when the shard belongs with the peer."""
        if self.role == ACTIVE:
            if seen > self.epoch:        # a newer broker was active since: this one is not
                self._depose(seen)
                return None
            return self.epoch
        if self.peer_alive(now):
            if self.peer_role == ACTIVE or (self.peer_epoch, self.peer_run or 0) > (self.epoch,
                                                                                    self.run):
                self.refused += 1
                return None
        self.role = ACTIVE
        self.voting_since = None
        self.epoch = max(self.epoch, self.peer_epoch, seen) + 1
        self.takeovers += 1
        return self.epoch

    def _depose(self, epoch: int) -> Deposed:
        self.role = STANDBY
        self.voting_since = None
        self.epoch = max(self.epoch, epoch)
        self.deposed = Deposed(self.epoch)
        return self.deposed
