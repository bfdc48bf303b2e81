"""Resending what the broker has not settled: pushes and inits, by their msg id.

The broker's ``(client, msg)`` duplicate window applies a message once however often it
arrives, so the SDK may send again whatever it has not heard back about. The timer is one for
the whole window and backs off: a message unsettled ``delay`` seconds after it was last sent is
sent again, and every round that resends something doubles ``delay`` (from ``RESEND_AFTER`` up
to ``RESEND_MAX``); any settlement (an ACK, INIT_OK or ERROR) shows the broker answering and
resets it to ``RESEND_AFTER``. A broker down for a while thus sees the window again after 5,
10, 20, 40, then every 60 seconds, not every 5. The timer is the fall-back: a client that hears
a restarted broker (a new run id) sends everything unsettled again at once
(:meth:`ResendTimer.all_now`), so what was lost with the old broker waits for no round. A
message refused with RECOVERING (a restarted broker still hearing from its shards) is sent
again as soon as the partition table changes (a shard registered: :meth:`recovering_now`), or
after ``RECOVERING_RETRY`` if no change comes first. One
refused with BUSY (the broker at its byte cap kept nothing of it) is sent again after its own
back-off: ``BUSY_RETRY`` doubled per refusal in a row, up to ``BUSY_MAX``, spread by the msg id
so that producers refused together do not come back together; the round timer's delay is not
reset by a BUSY (it is no settlement), so what the broker does hold is not sent again sooner.

The first delay is never shorter than the answers take: each settlement of a message sent once
is a round-trip sample, kept as a smoothed time and variation (RFC 6298's estimator; a message
sent again is timed from its first send, which can only make the estimate longer, never
short as an answer to the first send timed from the resend would), and a settlement resets
the delay to the larger of
``RESEND_AFTER`` and that estimate (smoothed + 4 x variation, at most ``RESEND_MAX``). On a
link slower than the window's bytes take at 5 s (a window of 8 MiB pushes over 100 Mbit), a
push queued behind the others is then waited for, not sent again while it is on its way.
"""
from __future__ import annotations

import collections

RESEND_AFTER = 5.0           # seconds before an unsettled push or init is first sent again ...
RESEND_MAX = 60.0            # ... doubling per resend round up to this, until an answer comes
RECOVERING_RETRY = 0.2       # seconds before a push or init refused with RECOVERING is resent
BUSY_RETRY = 0.05            # seconds before a push or init refused with BUSY is resent, ...
BUSY_MAX = 2.0               # ... doubling per BUSY in a row up to this


class RoundTrip:
    """How long answers take, from samples: RFC 6298's smoothed time and its variation (the
    resend timer's in seconds, conflated delivery's credits' in heartbeats)."""
    __slots__ = ("srtt", "rttvar")

    def __init__(self):
        self.srtt: float | None = None     # None: no sample yet
        self.rttvar = 0.0

    def sample(self, x: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = float(x), x / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - x)
            self.srtt = 0.875 * self.srtt + 0.125 * x

    def bound(self) -> float | None:
        """Smoothed time + 4 x variation: what an answer is waited for (None: no sample)."""
        return None if self.srtt is None else self.srtt + 4 * self.rttvar


class ResendTimer:
    """No I/O: :meth:`due` returns the frames to send again; the caller sends them."""

    def __init__(self, base: float = RESEND_AFTER, cap: float = RESEND_MAX,
                 recovering: float = RECOVERING_RETRY):
        if not base > 0 or cap < base:
            raise ValueError("resend delays must be positive, cap >= base")
        self.base, self.cap, self.recovering_after = base, cap, recovering
        self.delay = base
        self.rtt = RoundTrip()             # the round trip of messages sent once
        # msg -> [frames, last sent, first sent]; ordered by last sent (a resend moves it to
        # the end)
        self.unsettled: collections.OrderedDict = collections.OrderedDict()
        self.soon: dict[int, float] = {}   # msg -> when, refused with RECOVERING or BUSY
        self.busy: dict[int, int] = {}     # msg -> BUSY refusals in a row
        self.recovering: set[int] = set()  # msgs of ``soon`` refused with RECOVERING

    def __contains__(self, msg: int) -> bool:
        return msg in self.unsettled

    def __len__(self) -> int:
        return len(self.unsettled)

    def sent(self, msg: int, frames: list, now: float) -> None:
        self.unsettled[msg] = [frames, now, now]

    def settled(self, msg: int, now: float | None = None) -> None:
        """The broker answered ``msg``: forget it, and back to the first delay (no shorter
        than the answers take: ``now`` makes a round-trip sample, from its first send)."""
        ent = self.unsettled.pop(msg, None)
        self.soon.pop(msg, None)
        self.busy.pop(msg, None)
        self.recovering.discard(msg)
        if ent is not None and now is not None:
            self.rtt.sample(min(self.cap, max(0.0, now - ent[2])))
        self.delay = self.first_delay()

    def first_delay(self) -> float:
        """The delay a settlement resets to: ``base``, or the answers' round trip with its
        variation where that is longer (at most ``cap``)."""
        rto = self.rtt.bound()
        return self.base if rto is None else min(self.cap, max(self.base, rto))

    @property
    def srtt(self) -> float | None:
        return self.rtt.srtt

    def refused_recovering(self, msg: int, now: float) -> bool:
        """Send ``msg`` again shortly; False when it is not waiting (answered already)."""
        if msg not in self.unsettled:
            return False
        self.soon[msg] = now + self.recovering_after
        self.recovering.add(msg)
        return True

    def refused_busy(self, msg: int, now: float) -> bool:
        """The broker kept nothing of ``msg`` (BUSY): send it again after its back-off; False
        when it is not waiting (answered already)."""
        if msg not in self.unsettled:
            return False
        n = self.busy[msg] = self.busy.get(msg, 0) + 1
        self.recovering.discard(msg)
        delay = min(BUSY_RETRY * 2 ** min(n - 1, 30), BUSY_MAX)
        self.soon[msg] = now + delay * (1.0 + (msg * 2654435761 % 1024) / 2048)  # x [1, 1.5)
        return True

    def all_now(self, now: float) -> list[list]:
        """Every unsettled message's frames, to send again now, oldest first (the broker
        restarted, or the local link closed); the delay starts again from the first one."""
        out = []
        for ent in self.unsettled.values():
            ent[1] = now
            out.append(ent[0])
        self.soon.clear()
        self.recovering.clear()
        self.delay = self.first_delay()
        return out

    def recovering_now(self, now: float) -> list[list]:
        """The partition table changed (a shard registered with a restarted broker): the
        frames of the messages refused with RECOVERING, to send again now."""
        out = []
        for msg in sorted(self.recovering, key=lambda m: self.unsettled[m][1]):
            del self.soon[msg]
            ent = self.unsettled[msg]
            ent[1] = now
            self.unsettled.move_to_end(msg)
            out.append(ent[0])
        self.recovering.clear()
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
                self.recovering.discard(msg)
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
            self.recovering.discard(msg)
            out.append(ent[0])
            backed_off = True
        if backed_off:
            self.delay = min(self.delay * 2, self.cap)
        return out

    def validate_state(self) -> None:
        times = [ent[1] for ent in self.unsettled.values()]
        assert times == sorted(times), "unsettled messages out of send order"
        assert self.soon.keys() <= self.unsettled.keys()
        assert self.busy.keys() <= self.unsettled.keys()
        assert self.recovering <= self.soon.keys()
        assert self.base <= self.delay <= self.cap
