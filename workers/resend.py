"""Resending what the broker has not settled: pushes and inits, by their msg id.

The broker's ``(client, msg)`` duplicate window applies a message once however often it
arrives, so the SDK may send again whatever it has not heard back about. The timer is one for
the whole window and backs off: a message unsettled ``delay`` seconds after it was last sent is
sent again, and every round that resends something doubles ``delay`` (from ``RESEND_AFTER`` up
to ``RESEND_MAX``); any settlement (an ACK, INIT_OK or ERROR) shows the broker answering and
resets it to ``RESEND_AFTER``. A broker down for a while thus sees the window again after 5,
10, 20, 40, then every 60 seconds, not every 5. A message refused with RECOVERING (a restarted
broker still hearing from its shards) is sent again after ``RECOVERING_RETRY`` instead. One
refused with BUSY (the broker at its byte cap kept nothing of it) is sent again after its own
back-off: ``BUSY_RETRY`` doubled per refusal in a row, up to ``BUSY_MAX``, spread by the msg id
so that producers refused together do not come back together; the round timer's delay is not
reset by a BUSY (it is no settlement), so what the broker does hold is not sent again sooner.
"""
from __future__ import annotations

import collections

RESEND_AFTER = 5.0           # seconds before an unsettled push or init is first sent again ...
RESEND_MAX = 60.0            # ... doubling per resend round up to this, until an answer comes
RECOVERING_RETRY = 0.2       # seconds before a push or init refused with RECOVERING is resent
BUSY_RETRY = 0.05            # seconds before a push or init refused with BUSY is resent, ...
BUSY_MAX = 2.0               # ... doubling per BUSY in a row up to this


class ResendTimer:
    """No I/O: :meth:`due` returns the frames to send again; the caller sends them."""

    def __init__(self, base: float = RESEND_AFTER, cap: float = RESEND_MAX,
                 recovering: float = RECOVERING_RETRY):
        if not base > 0 or cap < base:
            raise ValueError("resend delays must be positive, cap >= base")
        self.base, self.cap, self.recovering = base, cap, recovering
        self.delay = base
        # msg -> [frames, last sent]; ordered by last sent (a resend moves it to the end)
        self.unsettled: collections.OrderedDict = collections.OrderedDict()
        self.soon: dict[int, float] = {}   # msg -> when, refused with RECOVERING or BUSY
        self.busy: dict[int, int] = {}     # msg -> BUSY refusals in a row

    def __contains__(self, msg: int) -> bool:
        return msg in self.unsettled

    def __len__(self) -> int:
        return len(self.unsettled)

    def sent(self, msg: int, frames: list, now: float) -> None:
        self.unsettled[msg] = [frames, now]

    def settled(self, msg: int) -> None:
        """The broker answered ``msg``: forget it, and back to the first delay."""
        self.unsettled.pop(msg, None)
        self.soon.pop(msg, None)
        self.busy.pop(msg, None)
        self.delay = self.base

    def refused_recovering(self, msg: int, now: float) -> bool:
        """Send ``msg`` again shortly; False when it is not waiting (answered already)."""
        if msg not in self.unsettled:
            return False
        self.soon[msg] = now + self.recovering
        return True

    def refused_busy(self, msg: int, now: float) -> bool:
        """The broker kept nothing of ``msg`` (BUSY): send it again after its back-off; False
        when it is not waiting (answered already)."""
        if msg not in self.unsettled:
            return False
        n = self.busy[msg] = self.busy.get(msg, 0) + 1
        delay = min(BUSY_RETRY * 2 ** min(n - 1, 30), BUSY_MAX)
        self.soon[msg] = now + delay * (1.0 + (msg * 2654435761 % 1024) / 2048)  # x [1, 1.5)
        return True

    def all(self, now: float) -> list[list]:
        """Every unsettled message's frames, to send again at once (as sent ``now``)."""
        out = []
        for ent in self.unsettled.values():
            ent[1] = now
            out.append(ent[0])
        self.soon.clear()
        return out

    def next_at(self) -> float | None:
        """When :meth:`due` next has something to send (None: nothing waits)."""
        if not self.unsettled:
            return None
        first = next(iter(self.unsettled.values()))[1] + self.delay
        return min(first, *self.soon.values()) if self.soon else first

    def due(self, now: float) -> list[list]:
        """The frames to send again at ``now`` (oldest first); a round that resends anything
        past the delay doubles the delay."""
        out = []
        if self.soon:
            for msg in [m for m, t in self.soon.items() if t <= now]:
                del self.soon[msg]
                ent = self.unsettled[msg]
                ent[1] = now
                self.unsettled.move_to_end(msg)
                out.append(ent[0])
        unsettled, limit = self.unsettled, now - self.delay
        backed_off = False
        while unsettled:
            msg, ent = next(iter(unsettled.items()))
            if ent[1] > limit:
                break
            ent[1] = now
            unsettled.move_to_end(msg)
            self.soon.pop(msg, None)
            out.append(ent[0])
            backed_off = True
        if backed_off:
            self.delay = min(self.delay * 2, self.cap)
        return out

    def validate_state(self) -> None:
        times = [t for _, t in self.unsettled.values()]
        assert times == sorted(times), "unsettled messages out of send order"
        assert self.soon.keys() <= self.unsettled.keys()
        assert self.busy.keys() <= self.unsettled.keys()
        assert self.base <= self.delay <= self.cap
