"""A shard's step of one big block on 1, 2, 4, 8 pass threads (gradbus/codecs/passes.py): what splitting
a block's passes over threads buys on this host.

A ShardCore (no sockets, no loop) holds one fp32 block of ``--size`` bytes and a weights board,
as a primary with shared memory does; each batch carries ``--pushes`` gradients of it as frames.
Per thread count and optimizer, the median over ``--repeat`` batches of the seconds ``handle``
takes for the batch: every frame's checksum, the sum, the finiteness check, the step and its
write onto the board (SGD: in one pass, numba's loop; Adam: summed, then stepped). One JSON line
per configuration:

    threads, opt, pieces      the pass threads asked for, the optimizer, the pieces the block
                              was cut into
    ms_per_step               median milliseconds per batch
    gb_per_s                  gradient bytes read per second (pushes x size / time)
    speedup                   over the same optimizer on 1 thread, this run
    cores                     usable cores of this process (os.sched_getaffinity)

Usage: python bench/passes.py [--size 16M] [--threads 1,2,4,8] [--pushes 1] [--repeat 15]
                              [--opts sgd,adam]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import msgpack
import numpy as np

from gradbus.codecs import cores, shm, wire
from gradbus.codecs.partition import TensorLayout
from gradbus.shards.core import ShardCore

SIZES = {"4M": 4 << 20, "16M": 16 << 20, "64M": 64 << 20}
OPTS = {"sgd": {"name": "sgd", "lr": 0.01, "momentum": 0.0},
        "adam": {"name": "adam", "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}}


def _batch(seq: int, frames: list, descs: list) -> list:
    return [wire.pack(wire.BATCH, descs, parts=[{
        "p": 0, "seq": seq, "epoch": 1, "o": "p0",
        "e": [{"op": "push", "i": i, "c": "c", "m": 1000 * seq + i}
              for i in range(len(frames))]}]), *frames]


def measure(nbytes: int, threads: int, opt: str, pushes: int, repeat: int) -> dict:
    n = nbytes // 4
    board = shm.Board(f"bench{threads:02d}", segment_bytes=3 * nbytes)
    sc = ShardCore("p0", threads=threads)
    try:
        sc.publisher.board = board
        layout = TensorLayout("w", "float32", (n,), nbytes)
        sc.handle([wire.pack(wire.BATCH, [], parts=[{
            "p": 0, "seq": 1, "epoch": 1, "o": "p0",
            "e": [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
                   "rule": {"name": "zeros"}, "opt": OPTS[opt]}]}])])
        rng = np.random.default_rng(0)
        encs = [wire.encode_tensor("w/0", rng.standard_normal(n).astype(np.float32) * 1e-3)
                for _ in range(pushes)]
        descs, frames = [d for d, _ in encs], [bytes(b) for _, b in encs]
        times = []
        for seq in range(2, repeat + 3):
            msg = _batch(seq, frames, descs)
            t0 = time.perf_counter()
            out = sc.handle(msg)
            times.append(time.perf_counter() - t0)
            errors = [e for part in msgpack.unpackb(out[0][0])["parts"] for e in part["errors"]]
            if errors:
                raise RuntimeError(f"the batch was refused: {errors}")
        times = times[1:]                       # the first: buffers allocated
        med = statistics.median(times)
        return {"bench": "passes", "threads": threads, "opt": opt, "pieces": sc.passes.pieces(nbytes),
                "size": nbytes, "pushes": pushes, "ms_per_step": round(med * 1e3, 3),
                "gb_per_s": round(pushes * nbytes / med / 1e9, 2),
                "cores": cores.usable_cores()}
    finally:
        sc.publisher.board = None
        sc.close()
        board.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="16M", choices=sorted(SIZES))
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--pushes", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--opts", default="sgd,adam")
    a = ap.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        ap.error("--threads is a list of whole numbers, e.g. 1,2,4,8")
    opts = a.opts.split(",")
    if not set(opts) <= set(OPTS) or min(threads) < 1 or a.pushes < 1 or a.repeat < 2:
        ap.error(f"--opts a list of {', '.join(OPTS)}; --threads >= 1; --pushes >= 1; "
                 "--repeat >= 2")
    for opt in opts:
        base = None
        for t in threads:
            line = measure(SIZES[a.size], t, opt, a.pushes, a.repeat)
            base = base or line["ms_per_step"]
            line["speedup"] = round(base / line["ms_per_step"], 2)
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
