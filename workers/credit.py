"""The client's credit window: how many pushes, and how many of their bytes, are unsettled.

``push()`` takes a slot (waiting on the shared condition while the window is full); the agent
releases slots as ACKs and ERRORs settle pushes. The byte total is kept as a running sum, so a
push costs no walk over the window.
"""
from __future__ import annotations

import threading
import time

from gradbus.codecs.errors import BackPressureError


class CreditWindow:
    """At most ``window`` pushes and ``window_bytes`` bytes held (a push larger than
    ``window_bytes`` goes alone). Every change happens under ``cond``, which waiters share
    with the rest of the client."""

    def __init__(self, window: int, window_bytes: int, cond: threading.Condition):
        if window < 1 or window_bytes < 1:
            raise ValueError("window and window_bytes must be >= 1")
        self.window = window
        self.window_bytes = window_bytes
        self.cond = cond
        self.held: dict[int, int] = {}     # msg -> bytes, pushes sent and not yet settled
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.held)

    def full(self, nbytes: int) -> bool:
        held = self.held
        return len(held) >= self.window or (bool(held) and self.bytes + nbytes > self.window_bytes)

    def take(self, nbytes: int, timeout: float, next_id, check_open, stats) -> int:
        """Wait for a slot (``timeout`` seconds, then BackPressureError); returns the push's
        msg id, drawn from ``next_id()`` once the slot is held."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.full(nbytes):
                check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    stats["window_full"] += 1
                    raise BackPressureError(
                        f"credit window ({len(self.held)} pushes, {self.bytes} B unacknowledged;"
                        f" limits {self.window} pushes, {self.window_bytes} B) still full after "
                        f"{timeout}s")
                self.cond.wait(min(left, 0.1))
            msg = next_id()
            self.held[msg] = nbytes
            self.bytes += nbytes
            return msg

    def release(self, msgs) -> None:
        """Return the slots of settled pushes (unknown ids are ignored) and wake the waiters."""
        with self.cond:
            for m in msgs:
                n = self.held.pop(m, None)
                if n is not None:
                    self.bytes -= n
            self.cond.notify_all()

    def validate_state(self) -> None:
        assert self.bytes == sum(self.held.values()), (self.bytes, self.held)
        assert all(n >= 0 for n in self.held.values())
