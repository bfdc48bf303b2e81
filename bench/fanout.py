"""The weight bytes each worker receives per byte it pushes, for workers that read weights as
frames (on other hosts, or with shared memory off), at several numbers of workers.

``gradbus up --shards 1`` (broker and shard with shared memory, as on a server host) and W
worker processes with ``GRADBUS_SHM=0``. Each worker follows one float32 tensor of ``--mib``
MiB (one block per MiB), waits until every worker is ready, then pushes ``--pushes`` times with
acks=1 and after each push pulls the weights that include it
(``pull(["w"], min_version=ack["ver"])``), as a worker that trains on its last push's weights
does. Its client counters say what it received: weight updates (``updates_received``) and
their tensor bytes (``recv_bytes``), against the bytes it pushed (``push_bytes``).

One JSON line per number of workers:

    recv_per_push       received update bytes / pushed bytes, per worker (in worker order),
                        and their median and max
    updates_per_push    updates received / pushes, per worker, median and max
    snapshots           snapshots each worker's cache took (the first pull's, and any after a
                        gap)
    seconds             wall time of the pushing phase (the slowest worker's)

A PyTorch RPC parameter server returns the weights to the caller only: 1.0 at any W.

Usage: python bench/fanout.py [--workers 1,2,4,8] [--mib 1] [--pushes 100] [--repeat N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (gradbus up's start and end, the environment helper)
import throughput  # noqa: E402  (free ports)

READY_TIMEOUT = 120.0


def _worker(url: str, index: int, nbytes: int, pushes: int, barrier, out) -> None:
    import gradbus
    n = nbytes // 4
    with gradbus.connect(url, timeout=120) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-6))
        c.pull(["w"])                       # follow the tensor
        g = np.random.default_rng(index).standard_normal(n).astype(np.float32)
        barrier.wait(READY_TIMEOUT)
        base = {k: c.stats[k] for k in ("updates_received", "recv_bytes", "push_bytes",
                                        "pushes")}
        t0 = time.monotonic()
        for _ in range(pushes):
            ack = c.push({"w": g}, acks=1).result(120)
            c.pull(["w"], min_version=ack["ver"])      # weights that include the push
        seconds = time.monotonic() - t0
        got = {k: c.stats[k] - v for k, v in base.items()}
        out.put({"index": index, "seconds": seconds, "snapshots": c.cache.stats["snapshots"],
                 **got})
        barrier.wait(READY_TIMEOUT)         # nobody leaves while others still push


def measure(url: str, workers: int, nbytes: int, pushes: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    with peers.environment(GRADBUS_SHM="0"):
        procs = [ctx.Process(target=_worker, args=(url, i, nbytes, pushes, barrier, out),
                             daemon=True) for i in range(workers)]
        for p in procs:
            p.start()
    try:
        got = sorted((out.get(timeout=READY_TIMEOUT + 60 * pushes) for _ in procs),
                     key=lambda r: r["index"])
    finally:
        for p in procs:
            p.join(60)
        peers.stop_processes(procs)
    recv = [r["recv_bytes"] / r["push_bytes"] for r in got]
    upd = [r["updates_received"] / r["pushes"] for r in got]
    return {"recv_per_push": [round(x, 3) for x in recv],
            "updates_per_push": [round(x, 3) for x in upd],
            "snapshots": [r["snapshots"] for r in got],
            "seconds": round(max(r["seconds"] for r in got), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8", help="numbers of workers, a list")
    ap.add_argument("--mib", type=int, default=1, help="the tensor's size in MiB")
    ap.add_argument("--pushes", type=int, default=100, help="pushes per worker")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; lines give medians")
    a = ap.parse_args(argv)
    try:
        counts = [int(w) for w in a.workers.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or a.mib < 1 or a.pushes < 1 or a.repeat < 1:
        ap.error("--workers must be a list of positive ints; --mib, --pushes and --repeat "
                 "positive")
    nbytes = a.mib << 20
    for w in counts:
        rounds = []
        for _ in range(a.repeat):
            with tempfile.NamedTemporaryFile("w+", prefix="gradbus-fanout-up-",
                                             suffix=".log") as log:
                # a fresh cluster per round: every round starts from the same weights
                up = subprocess.Popen([sys.executable, "-m", "gradbus", "up", "--shards", "1",
                                       "--port", str(throughput.free_port())],
                                      stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, "GRADBUS_SHM": "1"})
                try:
                    url = peers._wait_ready(up, log.name, READY_TIMEOUT)
                    rounds.append(measure(url, w, nbytes, a.pushes))
                finally:
                    peers._end_group(up)
        per_round = [statistics.median(r["recv_per_push"]) for r in rounds]
        best = rounds[per_round.index(statistics.median_low(per_round))]
        line = {"bench": "fanout", "workers": w, "bytes": nbytes, "pushes": a.pushes,
                "recv_per_push": best["recv_per_push"],
                "recv_per_push_median": round(statistics.median(best["recv_per_push"]), 3),
                "recv_per_push_max": max(best["recv_per_push"]),
                "updates_per_push": best["updates_per_push"],
                "updates_per_push_max": max(best["updates_per_push"]),
                "snapshots": best["snapshots"], "seconds": best["seconds"],
                "cpus": os.cpu_count()}
        if a.repeat > 1:
            line["repeats"] = a.repeat
            line["rounds_recv_per_push_median"] = [round(x, 3) for x in per_round]
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
