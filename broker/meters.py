"""The broker's counters, error counts and histograms: written by every component, read by
status and metrics."""
from __future__ import annotations

from collections import defaultdict

from gradbus.codecs import stats, wire
from gradbus.codecs.errors import Code

from .actions import ToClient


class Meters:
    __slots__ = ("counters", "errors", "h_batch", "h_visible", "h_ack", "h_staleness")

    def __init__(self):
        self.counters: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.h_batch = stats.Histogram(stats.COUNT_BUCKETS)      # entries per batch part
        self.h_visible = stats.Histogram()     # push received -> its weights published
        self.h_ack = stats.Histogram()         # push received -> acknowledged
        self.h_staleness = stats.Histogram(stats.COUNT_BUCKETS)  # versions behind, on arrival

    def err(self, identity: bytes, code: Code, message: str, **fields) -> ToClient:
        """An ERROR reply to a client, counted by code."""
        self.errors[code.value] += 1
        return ToClient(identity, [wire.error(code, message, **fields)])
