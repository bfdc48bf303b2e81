"""The floor under bench/throughput.py: the least a push path of gradbus's shape can cost.

A bare pyzmq pipeline with gradbus's topology and none of its protocol: workers (DEALER, 32
pushes in flight) send one frame per push to a broker (a Python ROUTER-to-ROUTER loop), which
hands it to one shard (DEALER); the shard acks through the broker. Nothing is sequenced,
batched, validated or republished. ``--work`` says what each side does per push:

    none   forward only: the worker sends its own array, the shard drops the frame
    raw    the worker copies the gradient and checksums the copy (xxh3-64); the shard checksums
           the frame and takes an SGD step with it: the work every raw push needs (the caller
           may reuse its array; a frame is verified before it is applied)
    bf16   as raw, with the worker casting to bf16 instead of copying, and the shard widening
           the bits back to float32; both with gradbus's own codec (numba's one-pass loops
           where numba imports, as gradbus uses them)

The broker and shard keep the memory they free, as gradbus's do (gradbus/memory.py).

In the same run it measures ``zmq.proxy`` as bench/throughput.py does, and prints one JSON line
per work level with the pipeline's pushes per second and its ratio to the proxy. A gradbus
ratio near the ``raw`` line's is gradbus adding little to the work itself.

Usage: python bench/floor.py [--size 4M] [--work none,raw,bf16] [--seconds S] [--repeat N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys

import numpy as np
import zmq

from gradbus import memory
from gradbus.codecs import tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (the proxy measurement and the sizes)

WORKERS = 2
IN_FLIGHT = 32


def _broker(front: int, back: int) -> None:
    memory.keep_freed_memory()          # as gradbus's broker and shard processes do
    ctx = zmq.Context()
    f, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    f.bind(f"tcp://127.0.0.1:{front}")
    b.bind(f"tcp://127.0.0.1:{back}")
    poller = zmq.Poller()
    poller.register(f, zmq.POLLIN)
    poller.register(b, zmq.POLLIN)
    shard = None
    while True:
        ready = dict(poller.poll(1000))
        if b in ready:
            while True:
                try:
                    msg = b.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if shard is None:           # the shard's hello
                    shard = msg[0].bytes
                else:                       # an ack: [shard, client, ack]
                    f.send_multipart(msg[1:], copy=False)
        if f in ready and shard is not None:
            while True:
                try:
                    msg = f.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                b.send_multipart([shard, *msg], copy=False)


def _shard(back: int, n: int, work: str) -> None:
    import xxhash
    memory.keep_freed_memory()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{back}")
    s.send(b"hello")
    acc, w = np.empty(n, np.float32), np.zeros(n, np.float32)
    lr = np.asarray(-1e-6, np.float32)
    while True:
        client, frame = s.recv_multipart(copy=False)
        if work != "none":
            xxhash.xxh3_64_intdigest(frame.buffer)
            if work == "bf16":    # acc = -lr * widened bits, in one pass where numba imports
                pieces = tensor.pieces(frame.buffer, "bf16", "float32", (n,), 1 << 40)
                if not pieces.add_into(acc, True, lr):
                    np.multiply(pieces.values(pieces.data, np.empty(n, np.float32)), lr,
                                out=acc)
            else:
                np.multiply(np.frombuffer(frame.buffer, np.float32), lr, out=acc)
            w += acc                                        # an SGD step: w -= lr * g
        s.send_multipart([client, b"ack"])


def _worker(front: int, n: int, work: str, warmup: float, seconds: float, out) -> None:
    import xxhash
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{front}")
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    in_flight, meter = 0, throughput.Meter(warmup, seconds)
    while True:
        while in_flight < IN_FLIGHT:
            if work == "none":
                frame = g
            elif work == "bf16":
                frame = tensor.encode(g, "bf16")[1]
                xxhash.xxh3_64_intdigest(frame)
            else:
                frame = g.copy()
                xxhash.xxh3_64_intdigest(frame)
            s.send(frame, copy=False)
            in_flight += 1
        s.recv()
        in_flight -= 1
        if meter.tick():
            break
    out.put(meter.rate())
    s.close(linger=0)
    ctx.term()


def run_floor(nbytes: int, work: str, warmup: float, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    front, back = throughput.free_port(), throughput.free_port()
    n = nbytes // 4
    servers = [ctx.Process(target=_broker, args=(front, back), daemon=True),
               ctx.Process(target=_shard, args=(back, n, work), daemon=True)]
    for p in servers:
        p.start()
    out = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(front, n, work, warmup, seconds, out))
               for _ in range(WORKERS)]
    for p in workers:
        p.start()
    try:
        return sum(out.get(timeout=warmup + seconds + 60) for _ in workers)
    finally:
        for p in workers + servers:
            p.terminate()
            p.join(10)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4M", choices=sorted(throughput.SIZES))
    ap.add_argument("--work", default="none,raw,bf16")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args(argv)
    works = a.work.split(",")
    if a.repeat < 1 or not set(works) <= {"none", "raw", "bf16"}:
        ap.error("--repeat must be at least 1 and --work a list of none, raw, bf16")
    nbytes = throughput.SIZES[a.size]
    proxies, rates = [], {w: [] for w in works}
    for _ in range(a.repeat):         # interleaved with the proxy, as bench/throughput.py does
        proxies.append(throughput.run_proxy(nbytes, WORKERS, 1, a.warmup, a.seconds))
        for w in works:
            rates[w].append(run_floor(nbytes, w, a.warmup, a.seconds))
    for w, rs in rates.items():
        print(json.dumps({"bench": "floor", "size": a.size, "bytes": nbytes, "workers": WORKERS,
                          "work": w, "pushes_per_s": round(statistics.median(rs), 1),
                          "proxy_msgs_per_s": round(statistics.median(proxies), 1),
                          **throughput.ratio_fields(rs, proxies), "cpus": os.cpu_count()}),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
