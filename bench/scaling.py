"""Adding a shard under load: push rate before, during and after the partitions move.

A cluster starts with one shard; ``--workers`` processes push gradients of one tensor that
fills ``--partitions`` partitions of ``--mib`` MiB each, as fast as their credit windows allow,
recording when each push is acknowledged. After ``--phase`` seconds a second shard joins; the
broker moves half the partitions to it (catch-up, then the owner flips) while the pushes go on.
One JSON line per phase:

    before / after  pushes_per_s (the steady rate)
    during          pushes_per_s, min_1s_ratio (the lowest rate in any 1 s window of the move,
                    over the "before" rate; target >= 0.5), max_ack_gap_s (longest time with no
                    push acknowledged), moves, moved_mib, longest_move_s (catch-up + flip of
                    one partition; pushes to it continue meanwhile), longest_pause_s (the
                    longest time between two acknowledged pushes that touched a moving
                    partition: every push touches every partition here; compare with the
                    "before" phase's max_ack_gap_s, the gap with nothing moving)

With ``--probe ELEMS`` the workers push only a small tensor with a block of ELEMS elements in
every partition, while a bulk tensor (never pushed) fills the partitions to ``--mib``: pushes
are then frequent, and ``longest_pause_s`` is the longest any partition went without an
acknowledged push while ``--mib`` MiB of it moved (target: under 200 ms for 64 MiB).

Usage: python bench/scaling.py [--mib 16] [--partitions 8] [--phase 5] [--workers 2] [--probe N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np

BLOCK_BYTES = 1 << 20    # the bulk tensor's blocks: many per partition, so each fills evenly


def _worker(url, n, stop, q, probe=0, partitions=1):
    import gradbus
    acks = []
    with gradbus.connect(url, timeout=120, window=4, block_bytes=BLOCK_BYTES) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-9))
        grads = {"w": np.ones(n, np.float32)}
        if probe:       # small pushes that touch every partition; "w" is only the bulk to move
            grads = {"probe": np.ones(_probe_size(probe, partitions), np.float32)}
            with gradbus.connect(url, timeout=120, block_bytes=probe * 4) as small:
                small.init({"probe": np.zeros_like(grads["probe"])},
                           optimizer=gradbus.SGD(lr=1e-9))
        futs = []
        while not stop.is_set():
            f = c.push(grads)
            f.add_done_callback(lambda f: acks.append(time.time()))
            futs.append(f)
            if len(futs) > 64:
                futs = [x for x in futs if not x.done()]
        c.flush(120)
    q.put(sorted(acks))


def _probe_size(block: int, partitions: int) -> int:
    """Elements of a tensor of ``block``-element blocks with a block in every partition."""
    from gradbus.codecs.partition import block_key, partition_of
    n, seen = 0, set()
    while len(seen) < partitions:
        seen.add(partition_of(block_key("probe", n), partitions))
        n += 1
    return n * block


def _rate(ts, a, b):
    return sum(1 for t in ts if a <= t < b) / max(b - a, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=16, help="MiB per partition")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--phase", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--probe", type=int, default=0, metavar="ELEMS",
                    help="push only a small tensor of ELEMS-element blocks, one in every "
                         "partition, while the partitions hold --mib each: the ack gaps are "
                         "then the pause a partition sees while it moves")
    args = ap.parse_args()
    from gradbus import admin
    from gradbus.cluster import LocalCluster
    hb = ["--heartbeat-interval", "0.1", "--liveness", "10"]
    block = BLOCK_BYTES // 4     # float32 elements per block; blocks hash to partitions
    nblocks = int(args.mib * args.partitions * (1 << 20) // BLOCK_BYTES)
    n = nblocks * block
    cluster = LocalCluster(1, port=0, partitions=args.partitions, broker_args=hb,
                           shard_args=hb).start()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    try:
        procs = [ctx.Process(target=_worker, args=(cluster.url, n, stop, q, args.probe,
                                                   args.partitions))
                 for _ in range(args.workers)]
        for p in procs:
            p.start()
        while not admin.status(cluster.url)["counters"].get("pushes_applied"):
            time.sleep(0.1)                        # the workers created the tensors
        join_at = time.time() + 1 + args.phase     # 1 s of warm-up, then "before"
        while time.time() < join_at:
            time.sleep(0.05)
        cluster.add_shard("shard-1")
        t_join = time.time()
        quiet_since = None      # moves start a few at a time: done when none ran for 1 s
        while True:
            st = admin.status(cluster.url)
            busy = st["moves_in_progress"] or not st["counters"].get("moves", 0)
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.time()
            elif time.time() - quiet_since >= 1.0:
                break
            if time.time() > t_join + 50:
                raise SystemExit("moves did not finish in 50 s")
            time.sleep(0.05)
        t_done = quiet_since     # the last move finished before this
        moves = st["moves"]
        after_end = t_done + args.phase
        # stop the workers after the "after" phase
        while time.time() < after_end:
            time.sleep(0.05)
        stop.set()
        acks = []
        for _ in procs:
            acks += q.get(timeout=120)
        for p in procs:
            p.join(120)
    finally:
        cluster.stop()
    acks.sort()
    before = _rate(acks, join_at - args.phase, join_at)
    during = _rate(acks, t_join, t_done)
    after = _rate(acks, t_done, after_end)
    window = [_rate(acks, a, a + 1.0) for a in np.arange(t_join, max(t_done - 1.0, t_join) + 1e-9,
                                                           0.1)]
    gaps = np.diff([t for t in acks if t_join <= t <= t_done]) if acks else []
    steady = np.diff([t for t in acks if join_at - args.phase <= t < join_at])
    base = {"bench": "scaling", "mib_per_partition": args.mib, "partitions": args.partitions,
            "workers": args.workers, "probe_elems": args.probe}
    print(json.dumps({**base, "phase": "before", "pushes_per_s": round(before, 2),
                      "max_ack_gap_s": round(float(max(steady)), 3) if len(steady) else None}))
    print(json.dumps({**base, "phase": "during", "seconds": round(t_done - t_join, 2),
                      "pushes_per_s": round(during, 2),
                      "min_1s_ratio": round(min(window) / before, 3) if before else None,
                      "max_ack_gap_s": round(float(max(gaps)), 3) if len(gaps) else None,
                      "longest_pause_s": round(float(max(gaps)), 3) if len(gaps) else None,
                      "moves": len(moves),
                      "moved_mib": round(sum(m["bytes"] for m in moves) / (1 << 20), 1),
                      "longest_move_s": max(m["seconds"] for m in moves) if moves else None}))
    print(json.dumps({**base, "phase": "after", "pushes_per_s": round(after, 2)}))


if __name__ == "__main__":
    main()
