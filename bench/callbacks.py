"""How long a push's callback waits for its answer, as the ways of waiting mix.

A thread waiting in a push's ``result()`` reads the broker's answers off the local link itself
(workers/reader.py), and the link stays lent to such callers a while after the last one left.
A push whose Future only has a callback is answered through the client's I/O thread instead.
This pushes small ``acks=1`` gradients from one client to a local cluster (the shard inside the
broker's process, shared memory on), one at a time, and times push to callback:

  callbacks_only       every push waited on only through its callback
  after_a_waited_push  each such push right after one waited on with ``result()``
  waited_with_callback a push given a callback, then waited on with ``result()`` (the
                       client's I/O thread is woken once for the callback)

One JSON line per pattern: p50, p90 and max milliseconds from push to its callback, and the
client's CPU per push.

Usage: python bench/callbacks.py [--pushes 300] [--size 4K]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

import gradbus
from gradbus.cluster import LocalCluster

PATTERNS = ("callbacks_only", "after_a_waited_push", "waited_with_callback")
SIZES = {"4K": 4 << 10, "64K": 64 << 10}


def _timed(c, g, wait: bool) -> float:
    """One push, seconds from push to its callback (``wait``: also ``result()`` on it)."""
    done = threading.Event()
    t0 = time.perf_counter()
    took: list = []
    fut = c.push({"w": g}, acks=1)
    fut.add_done_callback(lambda _f: (took.append(time.perf_counter() - t0), done.set()))
    if wait:
        fut.result(30)
    if not done.wait(30):
        raise TimeoutError("a push's callback did not run in 30 s")
    return took[0]


def run(pattern: str, pushes: int, nbytes: int) -> dict:
    n = nbytes // 4
    with LocalCluster(1, inproc=True, quiet=True) as cluster, \
            gradbus.connect(cluster.url, timeout=60) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-6))
        g = np.ones(n, np.float32)
        times = []
        cpu0 = time.process_time()
        for _ in range(pushes):
            if pattern == "after_a_waited_push":
                c.push({"w": g}, acks=1).result(30)
            times.append(_timed(c, g, wait=pattern == "waited_with_callback"))
        cpu = time.process_time() - cpu0
        c.flush(60)
    times.sort()
    per = pushes * (2 if pattern == "after_a_waited_push" else 1)
    return {"bench": "callbacks", "pattern": pattern, "bytes": nbytes, "pushes": pushes,
            "callback_p50_ms": round(1e3 * times[len(times) // 2], 3),
            "callback_p90_ms": round(1e3 * times[int(len(times) * 0.9)], 3),
            "callback_max_ms": round(1e3 * times[-1], 3),
            "client_cpu_us_per_push": round(1e6 * cpu / per, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=300)
    ap.add_argument("--size", choices=sorted(SIZES), default="4K")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    a = ap.parse_args(argv)
    patterns = a.patterns.split(",")
    bad = [p for p in patterns if p not in PATTERNS]
    if bad or a.pushes < 1:
        ap.error(f"unknown patterns {bad}" if bad else "--pushes must be at least 1")
    for p in patterns:
        print(json.dumps(run(p, a.pushes, SIZES[a.size])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
