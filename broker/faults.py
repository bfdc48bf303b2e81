"""Fault injection at the broker's transport, for tests: a seeded fraction of the pushes that
arrive is dropped before the core sees them, and of the ACK messages the core sends, before
they go out. Both are counted in the core's counters (``fault_dropped_pushes``,
``fault_dropped_acks``)."""
from __future__ import annotations

import random

from gradbus.codecs import wire
from gradbus.codecs.errors import WireError

from .actions import AckClient


class FaultInjector:
    """Wraps a core's event handlers: ``on_frontend``, ``on_backend``, ``on_tick`` and
    ``flush`` as the core's, with the drops applied."""

    def __init__(self, core, drop: float = 0.0, seed: int = 0):
        if not 0.0 <= drop < 1.0:
            raise ValueError("fault_drop must be in [0, 1)")
        self.core = core
        self.drop = drop
        self.rng = random.Random(seed)

    def _drops_push(self, frames: list) -> bool:
        try:
            kind = wire.unpack_header(frames[0], wire.FRONTEND_KINDS)["kind"] if frames else None
        except WireError:
            return False            # the core answers it
        return kind == wire.PUSH and self.rng.random() < self.drop

    def outbound(self, actions: list) -> list:
        """The actions with a seeded fraction of the ACK messages left out."""
        if not self.drop:
            return actions
        out = []
        for a in actions:
            if isinstance(a, AckClient) and self.rng.random() < self.drop:
                self.core.counters["fault_dropped_acks"] += len(a.msgs)
                continue
            out.append(a)
        return out

    def on_frontend(self, identity: bytes, frames: list, now: float, **kw) -> list:
        if self.drop and self._drops_push(frames):
            self.core.counters["frontend_msgs"] += 1
            self.core.counters["fault_dropped_pushes"] += 1
            return []
        return self.outbound(self.core.on_frontend(identity, frames, now, **kw))

    def on_backend(self, identity: bytes, frames: list, now: float, **kw) -> list:
        return self.outbound(self.core.on_backend(identity, frames, now, **kw))

    def on_tick(self, now: float) -> list:
        return self.outbound(self.core.on_tick(now))

    def flush(self, now: float) -> list:
        return self.outbound(self.core.flush(now))
