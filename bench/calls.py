"""Python calls per push in each process: a count that a busy machine does not move.

A push's round trip at small sizes is per-message Python in every process it crosses
(docs/performance.md). Times and rates move from run to run on a shared machine; the number of
function calls each process makes per push does not. This runs one worker at depth 1 (push,
wait for its ACK, pull the weights that include it) against a cluster whose server processes
run under ``cProfile``, twice, with ``--pushes`` and with ``--pushes`` plus ``--more``, and
reports the difference per push, so that start-up and shutdown cancel out. The worker's calls,
both its threads, are counted with a profile hook set before it connects.

Configurations: ``inproc`` (``gradbus broker --inproc-shards 1``: the shard inside the broker's
process) and ``shard_process`` (``gradbus broker`` and one ``gradbus shard``). One JSON line per
configuration: calls per push by process (builtins included), and the broker's ten Python
functions called most per push.

Usage: python bench/calls.py [--size 64K] [--pushes 500] [--more 2000]
                             [--configs inproc,shard_process]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from gradbus.cluster import end_processes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (a gradbus command's URL from its log)
import throughput  # noqa: E402  (free ports)

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20}
READY_TIMEOUT = 60.0


def _spawn(args: list, out: str, log) -> subprocess.Popen:
    """``gradbus ARGS`` under cProfile, its statistics written to ``out`` at its exit."""
    return subprocess.Popen([sys.executable, "-m", "cProfile", "-o", out, "-m", "gradbus",
                             *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, "GRADBUS_SHM": "1"})


class _Counter:
    """Calls (Python and C) made by every thread of this process while installed."""

    def __init__(self):
        self.n = 0

    def __call__(self, frame, event, arg):
        if event == "call" or event == "c_call":
            self.n += 1

    def __enter__(self):
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def _run(config: str, nbytes: int, pushes: int, work: str) -> dict:
    """One cluster, ``pushes`` pushes: the servers' pstats files and the worker's calls."""
    import gradbus
    from gradbus import admin, connect  # before counting: the SDK is imported lazily
    port = throughput.free_port()
    url = f"tcp://127.0.0.1:{port}"
    procs, logs, stats = [], [], {}
    try:
        blog = os.path.join(work, f"{config}-{pushes}-broker.log")
        logs.append(open(blog, "w"))
        stats["broker"] = os.path.join(work, f"{config}-{pushes}-broker.prof")
        extra = ["--inproc-shards", "1"] if config == "inproc" else []
        procs.append(_spawn(["broker", "--port", str(port), *extra], stats["broker"], logs[-1]))
        peers._wait_ready(procs[0], blog, READY_TIMEOUT, "listening: ")
        if config == "shard_process":
            slog = os.path.join(work, f"{config}-{pushes}-shard.log")
            logs.append(open(slog, "w"))
            stats["shard"] = os.path.join(work, f"{config}-{pushes}-shard.prof")
            procs.append(_spawn(["shard", "--broker", url, "--id", "s0"], stats["shard"],
                                logs[-1]))
            deadline = time.monotonic() + READY_TIMEOUT
            while not any(s["alive"] for s in admin.status(url, timeout=5)["shards"]):
                if time.monotonic() > deadline:
                    raise TimeoutError("the shard did not register")
                time.sleep(0.1)
        n = nbytes // 4
        # counted from before the client starts its I/O thread (a thread started earlier would
        # not be): its start and end are the same in both runs and cancel out
        with _Counter() as counted, connect(url, timeout=60) as c:
            c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-6))
            c.pull(["w"])
            g = np.ones(n, np.float32)
            for _ in range(pushes):
                ack = c.push({"w": g}, acks=1).result(60)
                c.pull(["w"], min_version=ack["ver"])
        return {"worker": counted.n, **stats}
    finally:
        for p in reversed(procs):       # the shard first: its statistics are written at exit
            end_processes([p], 60)
        for f in logs:
            f.close()


def _calls(path: str) -> tuple[int, collections.Counter]:
    st = pstats.Stats(path).stats
    by = collections.Counter({f"{os.path.basename(f)}:{line} {name}": v[1]
                              for (f, line, name), v in st.items()})
    return sum(by.values()), by


def measure(config: str, nbytes: int, pushes: int, more: int, work: str) -> dict:
    small = _run(config, nbytes, pushes, work)
    large = _run(config, nbytes, pushes + more, work)
    out = {"worker": round((large["worker"] - small["worker"]) / more, 1)}
    top = None
    for role in ("broker", "shard"):
        if role in small:
            (a, by_a), (b, by_b) = _calls(small[role]), _calls(large[role])
            out[role] = round((b - a) / more, 1)
            if role == "broker":
                by_b.subtract(by_a)
                top = [[k, round(v / more, 2)] for k, v in by_b.most_common()
                       if not k.startswith("~:")][:10]      # Python functions, not builtins
    return {"calls_per_push": out, "broker_top": top}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="64K", choices=sorted(SIZES))
    ap.add_argument("--pushes", type=int, default=500)
    ap.add_argument("--more", type=int, default=2000)
    ap.add_argument("--configs", default="inproc,shard_process")
    a = ap.parse_args(argv)
    configs = [c for c in a.configs.split(",") if c]
    bad = [c for c in configs if c not in ("inproc", "shard_process")]
    if bad or not configs:
        ap.error(f"unknown configuration(s): {bad or a.configs!r}")
    if a.pushes < 1 or a.more < 1:
        ap.error("--pushes and --more must be positive")
    with tempfile.TemporaryDirectory(prefix="gradbus-calls-") as work:
        for config in configs:
            print(f"calls: {config}: {a.pushes} pushes, then {a.pushes + a.more}",
                  file=sys.stderr, flush=True)
            res = measure(config, SIZES[a.size], a.pushes, a.more, work)
            print(json.dumps({"bench": "calls", "config": config, "size": a.size,
                              "pushes": a.more, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
