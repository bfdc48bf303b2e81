"""What the client's agent state decides and the agent loop (:mod:`.agent`) carries out: one
frozen dataclass per action."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``frames`` to the broker (over the local link where there is one, else the
    DEALER)."""
    frames: list


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Subscribe the events socket to ``topic``."""
    topic: bytes


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """Unsubscribe the events socket from ``topic``."""
    topic: bytes


@dataclass(frozen=True, slots=True)
class AskTable:
    """Subscribe the events socket to the partition table again: the broker publishes its
    table on every such subscription (protocol section 6.14), after any it published before."""


@dataclass(frozen=True, slots=True)
class Reconnect:
    """A broker pair: leave this broker (``why``) for the other one (protocol section 23)."""
    why: str
