"""What a move of names between broker tier members costs the workers pushing them.

A tier of 2 members on this host (each a broker with one in-process shard), a model of
``--tensors`` tensors of ``--size`` bytes with Adam, ``--workers`` clients pushing the whole
model without pause (``acks=1``, each client's default window). After ``--before`` seconds
member 0 is drained (every name it holds moves to member 1: ``gradbus tier drain 0``), then
the workers push ``--after`` seconds more. One JSON line: how long the move took and how many
bytes it copied; updates/s before, during and after it; the slowest push (push to its ack)
in each window; pushes the SDK sent again after a MOVED and those refused RECOVERING.
Every push is checked applied at the end (each tensor's version = the pushes made).

Usage: python bench/tier_move.py [--tensors 8] [--size 1M] [--workers 2] [--before 3]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

import gradbus
from gradbus import tier_admin
from gradbus.tier_cluster import TierCluster

SIZES = {"64K": 64 << 10, "1M": 1 << 20, "4M": 4 << 20}


def _worker(url: str, names, n: int, stop: threading.Event, out: list) -> None:
    times, lat = [], []
    with gradbus.connect(url, timeout=120) as c:
        g = {k: np.full(n, 1e-3, np.float32) for k in names}

        def ack(f, t0):
            f.result()
            lat.append((t0, time.perf_counter() - t0))
        while not stop.is_set():
            t0 = time.perf_counter()
            f = c.push(g)
            f.add_done_callback(lambda f, t0=t0: ack(f, t0))
            times.append(t0)
        c.flush(120)
        out.append({"pushes": times, "lat": lat, "moved": c.stats_moved,
                    "recovering": c.stats["recovering_retries"]})


def _rate(times, lo, hi) -> float:
    return sum(1 for t in times if lo <= t < hi) / max(hi - lo, 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--size", default="1M", choices=sorted(SIZES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--before", type=float, default=3.0)
    ap.add_argument("--after", type=float, default=3.0)
    a = ap.parse_args(argv)
    n = SIZES[a.size] // 4
    names = [f"layer{i}" for i in range(a.tensors)]
    with TierCluster(2, 1, inproc=True, quiet=True) as tier:
        with gradbus.connect(tier.url, timeout=60) as c:
            c.init({k: np.zeros(n, np.float32) for k in names}, optimizer=gradbus.Adam(lr=1e-3))
            moving = [k for k in names if c.tier.owner(k) == 0]
        stop, out = threading.Event(), []
        threads = [threading.Thread(target=_worker, args=(tier.urls[w % 2], names, n, stop, out))
                   for w in range(a.workers)]
        for t in threads:
            t.start()
        time.sleep(a.before)
        t0 = time.perf_counter()
        done = tier_admin.rebalance(tier.url, members=[1])
        t1 = time.perf_counter()
        time.sleep(a.after)
        stop.set()
        for t in threads:
            t.join(300)
        pushes = sum(len(o["pushes"]) for o in out)
        with gradbus.connect(tier.urls[1], timeout=60) as c:
            c.pull(names, timeout=60)
            versions = {k: c.version(k) for k in names}
        if versions != dict.fromkeys(names, pushes):
            print(f"pushes lost or applied twice: {versions} for {pushes}", file=sys.stderr)
            return 1
    times = [t for o in out for t in o["pushes"]]
    lat = [x for o in out for x in o["lat"]]
    start = min(times)
    end = max(times)

    def slowest(lo, hi):
        got = [d for t, d in lat if lo <= t < hi]
        return round(max(got) * 1e3, 1) if got else None
    print(json.dumps({
        "bench": "tier_move", "tensors": a.tensors, "size": a.size, "workers": a.workers,
        "optimizer": "adam", "names_moved": len(done["names"]), "expected_moved": len(moving),
        "move_s": round(t1 - t0, 3), "move_bytes": done["bytes"],
        "updates_per_s_before": round(_rate(times, start, t0), 1),
        "updates_per_s_during": round(_rate(times, t0, t1), 1),
        "updates_per_s_after": round(_rate(times, t1, end), 1),
        "slowest_push_ms_before": slowest(start, t0), "slowest_push_ms_during": slowest(t0, t1),
        "slowest_push_ms_after": slowest(t1, end),
        "pushes_sent_again_after_moved": sum(o["moved"] for o in out),
        "pushes_refused_recovering": sum(o["recovering"] for o in out),
        "pushes": pushes, "all_applied_once": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
