"""The shard's registration with the broker and its liveness, as a state machine without
sockets or clocks.

The server loop feeds it events with the time they happened (its injected monotonic clock)
and carries out the typed actions it returns, in order:

* :meth:`Registration.start` -> :class:`Connect`: HELLO on the broker's client URL (retried
  with back-off until its timeout), then a DEALER connected to the backend port it names,
  under a fresh random routing id (a routing id is no credential: its REGISTER binds it);
* :meth:`Registration.connected` (the HELLO was answered with WELCOME and the socket is
  connected) -> :class:`Register`: send REGISTER; ``rejoin`` once this process was registered
  with a broker before, so a broker hearing it first knows it restarted;
* :meth:`Registration.heard`, every message from the broker: REGISTERED registers; an ERROR
  NOT_REGISTERED (declared dead while alive, a stall) unregisters and -> :class:`Register`
  again, at most once per liveness window (several messages sent meanwhile each get one);
  with a broker pair (protocol section 23), an ERROR NOT_ACTIVE (a standby) -> a
  :class:`Connect` to the next broker, and a REGISTERED naming a lower broker epoch than one
  this shard saw (a deposed broker) -> :class:`Fence` it, then the next broker;
* :meth:`Registration.sent`, every message the shard sent other than a heartbeat;
* :meth:`Registration.tick`, once per loop turn -> :class:`Heartbeat` every heartbeat
  interval, busy or not, and :class:`Connect` (with how long the broker was silent) when
  nothing came for ``liveness`` intervals;
* :meth:`Registration.lost`, the connection failed before the broker was heard on it (a send
  that could not go out by its deadline, a failed handshake) -> :class:`Connect`, as for a
  silent broker.

An action is carried out when it is returned: the time of the event is the time of the send.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from gradbus.codecs import timing, wire
from gradbus.codecs.errors import Code


class Phase(enum.Enum):
    DISCONNECTED = "disconnected"   # no socket to the backend: a Connect is under way
    REGISTERING = "registering"     # REGISTER sent, REGISTERED not heard yet
    REGISTERED = "registered"


@dataclass(frozen=True, slots=True)
class Connect:
    """HELLO the broker and (re)open the backend socket, closing any old one."""
    silent_for: float | None = None   # seconds the broker was silent (None: the first connect)
    lost: bool = False                # the connection failed (rather than fell silent)
    next: bool = False                # a broker pair: try the other broker first
    why: str = ""


@dataclass(frozen=True, slots=True)
class Fence:
    """Tell a deposed broker the highest broker epoch this shard saw (ERROR FENCED)."""
    epoch: int


@dataclass(frozen=True, slots=True)
class Register:
    """Send REGISTER with ``rejoin``."""
    rejoin: bool


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Send a HEARTBEAT with the shard's counters."""


class Registration:
    def __init__(self, heartbeat_interval: float = timing.HEARTBEAT_INTERVAL,
                 liveness: int = timing.LIVENESS):
        self.hb_interval = heartbeat_interval
        self.liveness = liveness
        self.phase = Phase.DISCONNECTED
        self.joined = False        # registered with a broker at least once
        self.registered_at = float("-inf")   # when the last REGISTER was sent
        self.last_heard: float | None = None
        self.last_sent: float | None = None
        self.last_info: float | None = None  # when the last HEARTBEAT was sent
        self.bepoch = 0            # the highest broker epoch seen (a broker pair's)

    @property
    def window(self) -> float:
        """Seconds of silence after which a peer counts as gone."""
        return self.hb_interval * self.liveness

    @property
    def registered(self) -> bool:
        return self.phase is Phase.REGISTERED

    # -- events --------------------------------------------------------------------------------
    def start(self) -> list:
        self.phase = Phase.DISCONNECTED
        return [Connect()]

    def connected(self, now: float) -> list:
        """The broker answered HELLO and the backend socket is connected."""
        self.phase = Phase.REGISTERING
        self.last_heard = now
        if self.last_sent is None:     # the first connection: the heartbeat clock starts
            self.last_sent = self.last_info = now
        return [self._register(now)]

    def heard(self, now: float, kind: str | None, code: str | None = None,
              bepoch: int = 0) -> list:
        """A message from the broker (``kind`` None when its header did not parse;
        ``bepoch``: a REGISTERED's broker epoch)."""
        self.last_heard = now
        if kind == wire.REGISTERED:
            if bepoch < self.bepoch:         # a deposed broker of a pair
                self.phase = Phase.DISCONNECTED
                return [Fence(self.bepoch),
                        Connect(next=True, why=f"broker epoch {bepoch} < {self.bepoch}")]
            self.bepoch = bepoch
            self.phase = Phase.REGISTERED
            self.joined = True
        elif kind == wire.ERROR and code == Code.NOT_ACTIVE.value:
            if self.phase is Phase.DISCONNECTED:
                return []          # a Connect is under way (several sends were answered)
            self.phase = Phase.DISCONNECTED
            return [Connect(next=True, why="the broker is a standby")]
        elif kind == wire.ERROR and code == Code.NOT_REGISTERED.value:
            self.phase = Phase.REGISTERING
            if now - self.registered_at > self.window:
                return [self._register(now)]
        return []

    def lost(self, now: float) -> list:
        """The connection failed before the broker was heard on it: a new one, as after a
        silent broker."""
        self.phase = Phase.DISCONNECTED
        return [Connect(silent_for=now - self.last_heard, lost=True)]

    def sent(self, now: float) -> None:
        """The shard sent a message (a reply), which the broker also reads as a sign of life."""
        self.last_sent = now

    def tick(self, now: float) -> list:
        """Time passed: a heartbeat when one is due, a new connection when the broker has been
        silent for the liveness window."""
        out = []
        if now - self.last_sent >= self.hb_interval or now - self.last_info >= self.hb_interval:
            self.last_sent = self.last_info = now
            out.append(Heartbeat())
        if now - self.last_heard > self.window:
            self.phase = Phase.DISCONNECTED
            out.append(Connect(silent_for=now - self.last_heard))
        return out

    # -- questions -----------------------------------------------------------------------------
    def quiet(self, now: float) -> bool:
        """Nothing sent for a heartbeat interval: a loop busy with messages stops to let a
        heartbeat out."""
        return now - self.last_sent >= self.hb_interval

    def _register(self, now: float) -> Register:
        self.registered_at = now
        return Register(rejoin=self.joined)
