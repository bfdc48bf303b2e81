"""CPU per push in the broker and in one client, by depth: what a push costs each process when
it is its own batch, and when several ride together.

One broker with its shard in its process (``gradbus broker --inproc-shards 1``, shared memory
on), one SDK client on the same host pushing a ``--size`` float32 tensor with ``acks=1`` and
``--depth`` pushes in flight (it waits for the oldest when that many are unanswered), for
``--pushes`` pushes after a warm-up of ``--warmup``. Each depth is run ``--rounds`` times,
interleaved with the others, against the same broker. One JSON line per depth: the medians
over rounds of wall time per push (``us_per_push``; the round trip at depth 1), the broker's
and the client's CPU per push (microseconds: the broker's utime + stime from ``/proc``, by
``peers.cpu_seconds``, in clock ticks, so a round wants a second or more; this process's own
``process_time``) and their voluntary context switches per push (every thread), and each
round's figures. Times move with the
machine's load: compare depths, or a change and the commit before it, within one run or in
alternating runs.

Usage: python bench/push_cpu.py [--size 4K] [--depths 1,16] [--pushes 4000] [--warmup 500]
                                [--rounds 3]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from gradbus.cluster import end_processes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (a command's URL from its log; CPU from /proc; ending it)
import throughput  # noqa: E402  (free ports)

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20}
READY_TIMEOUT = 60.0


def _switches(pid: int | str) -> int:
    """Voluntary context switches of every thread of process ``pid``."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        n += int(line.split()[1])
        except FileNotFoundError:     # a thread that ended meanwhile
            pass
    return n


def _pushes(c, g, count: int, depth: int) -> None:
    waiting: collections.deque = collections.deque()
    for _ in range(count):
        waiting.append(c.push({"w": g}, acks=1))
        if len(waiting) >= depth:
            waiting.popleft().result(60)
    for fut in waiting:
        fut.result(60)


def _round(c, g, broker: int, depth: int, pushes: int, warmup: int) -> dict:
    _pushes(c, g, warmup, depth)
    b0, s0, w0 = peers.cpu_seconds(), _switches(broker), _switches("self")
    t0, c0 = time.perf_counter(), time.process_time()
    _pushes(c, g, pushes, depth)
    wall, c1 = time.perf_counter() - t0, time.process_time()
    b1, s1, w1 = peers.cpu_seconds(), _switches(broker), _switches("self")
    return {"us_per_push": 1e6 * wall / pushes,
            "broker_cpu_us": 1e6 * peers.cpu_between(b0, b1) / pushes,   # the one child
            "client_cpu_us": 1e6 * (c1 - c0) / pushes,
            "broker_switches": (s1 - s0) / pushes,
            "client_switches": (w1 - w0) / pushes}


def run(nbytes: int, depths: list[int], pushes: int, warmup: int, rounds: int):
    """Yield one result per depth (see the module's docstring)."""
    import gradbus
    port = throughput.free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="gradbus-push-cpu-", suffix=".log") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gradbus", "broker", "--port", str(port),
                                 "--inproc-shards", "1"], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "GRADBUS_SHM": "1"})
        try:
            url = peers._wait_ready(proc, log.name, READY_TIMEOUT, "listening: ")
            n = nbytes // 4
            with gradbus.connect(url, timeout=60) as c:
                c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-6))
                g = np.ones(n, np.float32)
                got: dict[int, list] = {d: [] for d in depths}
                for _ in range(rounds):
                    for d in depths:
                        got[d].append(_round(c, g, proc.pid, d, pushes, warmup))
            for d in depths:
                rs = got[d]
                yield {**{k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]},
                       "depth": d, "rounds": [{k: round(v, 2) for k, v in r.items()} for r in rs]}
        finally:
            end_processes([proc], 60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4K", choices=sorted(SIZES))
    ap.add_argument("--depths", default="1,16")
    ap.add_argument("--pushes", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        depths = [int(d) for d in a.depths.split(",") if d]
    except ValueError:
        ap.error(f"--depths must be positive ints, not {a.depths!r}")
    if not depths or min(depths) < 1:
        ap.error(f"--depths must be positive ints, not {a.depths!r}")
    if a.pushes < 1 or a.warmup < 0 or a.rounds < 1:
        ap.error("--pushes and --rounds must be positive, --warmup not negative")
    for res in run(SIZES[a.size], depths, a.pushes, a.warmup, a.rounds):
        print(json.dumps({"bench": "push_cpu", "size": a.size, "pushes": a.pushes,
                          "cpus": os.cpu_count(), **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
