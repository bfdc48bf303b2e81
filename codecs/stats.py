"""Plain, dependency-free measurements that the processes' loops keep (cheap enough for the hot
path) and that ``gradbus.metrics`` exports to Prometheus from a snapshot.

A snapshot is a dict ``{name: metric}`` where a metric is one of::

    ("counter", help, {labels tuple: value})
    ("gauge", help, {labels tuple: value})
    ("histogram", help, label names, {labels tuple: (bucket bounds, counts, sum)})

Labels are tuples of ``(name, value)`` pairs; ``()`` for an unlabelled metric. Names follow
Prometheus conventions (``gradbus_<process>_<what>[_<unit>]``, counters without ``_total``:
the exporter adds it).
"""
from __future__ import annotations

from bisect import bisect_left

#: seconds, for latencies from 100 us to 10 s
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
#: counts (entries per batch, versions of staleness)
COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


class Histogram:
    """Cumulative-on-export histogram: ``observe`` is one bisect and two additions."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds=LATENCY_BUCKETS):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)    # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple:
        return self.bounds, list(self.counts), self.sum

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (None when empty)."""
        n = self.count
        if not n:
            return None
        want, seen = q * n, 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts):
            seen += c
            if seen >= want:
                return bound
        return float("inf")


def counter(help_: str, value) -> tuple:
    return ("counter", help_, {(): value})


def gauge(help_: str, value) -> tuple:
    return ("gauge", help_, {(): value})


def labelled(kind: str, help_: str, label: str, values: dict) -> tuple:
    """A counter or gauge with one label: ``values`` maps the label's value to the metric's."""
    return (kind, help_, {((label, str(k)),): v for k, v in values.items()})


def histogram(help_: str, h: Histogram) -> tuple:
    return ("histogram", help_, (), {(): h.snapshot()})
