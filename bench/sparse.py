"""Embedding rows through the cluster: row pushes per second with 1, 2 and 4 shards.

Each push carries gradients for ``--ids`` row ids (1,024 by default) of a table of dim ``--dim``
(64), the ids drawn from a Zipf distribution (exponent ``--zipf``) over ``--space`` ids (10M),
scrambled so the hot ids spread over the partitions. Duplicate ids in a draw are summed before
sending, as the SDK does. ``--workers`` processes push for ``--seconds`` each as fast as their
credit windows allow (Adagrad rows); then each reads ``--ids`` rows a few times to time a
``pull_rows``. One JSON line per shard count:

    shards, workers, pushes_per_s, rows_per_s (unique rows sent per second), ids_per_push
    (unique ids per push, mean), rows_held (rows created on the shards), pull_ms_p50 and
    pull_ms_p90 (a pull_rows of --ids ids), wire_mib_per_s

Usage: python bench/sparse.py [--shards 1,2,4] [--seconds 6] [--workers 2] [--spread S]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np


def draw(rng, n: int, space: int, zipf: float) -> np.ndarray:
    """n ids from a Zipf law over ``space`` ids, scrambled (the hot ids are not 0, 1, ...)."""
    from gradbus.codecs.partition import mix64
    raw = (rng.zipf(zipf, n) - 1) % space
    return (mix64(raw.astype(np.uint64)) % np.uint64(space)).astype(np.int64)


def _worker(url, args, seed, start, q):
    import gradbus
    rng = np.random.default_rng(seed)
    with gradbus.connect(url, timeout=120, window=8) as c:
        c.init_table("emb", args.dim, gradbus.Normal(std=0.01), gradbus.Adagrad(lr=0.05),
                     spread=args.spread)
        batches = [draw(rng, args.ids, args.space, args.zipf) for _ in range(64)]
        grads = rng.normal(size=(args.ids, args.dim)).astype(np.float32)
        start.wait()
        distinct = [len(np.unique(ids)) for ids in batches]    # counted before the clock runs
        n, uniq, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            c.push_rows("emb", batches[n % len(batches)], grads)
            uniq += distinct[n % len(batches)]
            n += 1
        c.flush(120)
        dt = time.perf_counter() - t0
        pulls = []
        for i in range(10):
            t = time.perf_counter()
            c.pull_rows("emb", batches[i])
            pulls.append(time.perf_counter() - t)
        q.put({"pushes": n, "rows": uniq, "seconds": dt, "pulls": pulls,
               "wire": c.stats["push_bytes"]})


def run(shards: int, args) -> dict:
    from gradbus.cluster import LocalCluster
    with LocalCluster(shards, port=0, partitions=args.partitions) as cl:
        ctx = mp.get_context("spawn")
        start, q = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(cl.url, args, 100 + i, start, q))
                 for i in range(args.workers)]
        for p in procs:
            p.start()
        start.set()             # each worker's clock starts after its connect and init
        res = [q.get(timeout=args.seconds + 300) for _ in procs]
        for p in procs:
            p.join(60)
        import gradbus
        with gradbus.connect(cl.url) as c:
            st = c.status()
    pulls = np.array([x for r in res for x in r["pulls"]]) * 1e3
    secs = max(r["seconds"] for r in res)
    return {"bench": "sparse", "shards": shards, "workers": args.workers, "dim": args.dim,
            "ids": args.ids, "partitions": args.partitions, "spread": args.spread,
            "pushes_per_s": round(sum(r["pushes"] for r in res) / secs, 1),
            "rows_per_s": round(sum(r["rows"] for r in res) / secs),
            "ids_per_push": round(sum(r["rows"] for r in res) / max(1, sum(r["pushes"]
                                                                          for r in res)), 1),
            "rows_held": sum(t["rows"] for t in st["tables"]),
            "pull_ms_p50": round(float(np.percentile(pulls, 50)), 2),
            "pull_ms_p90": round(float(np.percentile(pulls, 90)), 2),
            "wire_mib_per_s": round(sum(r["wire"] for r in res) / secs / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--ids", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--space", type=int, default=10_000_000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--partitions", type=int, default=256)
    ap.add_argument("--spread", type=int, default=0,
                    help="partitions the table's rows are placed in (0: all)")
    args = ap.parse_args()
    for n in (int(x) for x in args.shards.split(",")):
        print(json.dumps(run(n, args)), flush=True)


if __name__ == "__main__":
    main()
