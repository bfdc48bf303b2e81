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
class Reconnect:
    """A broker pair: leave this broker (``why``) for the other one (protocol section 23)."""
    why: str
