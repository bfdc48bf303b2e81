"""The broker's and a shard's cores in one process, no sockets and no loops: what their own
logic costs per push, apart from the processes, crossings and wake-ups around them.

A BrokerCore and a ShardCore are wired in memory (a push goes in as its frames, the batch the
broker flushes goes to the shard, the shard's APPLIED back to the broker); a client pushes one
fp32 tensor of ``--size`` bytes at a time (frames, not shared memory), each acknowledged before
the next, as at depth 1. One JSON line per size: the microseconds per push spent in the broker
core's calls and in the shard core's, and per header unpacked (``wire.unpack_header``) by kind,
medians of ``--repeat`` runs of ``--pushes`` pushes.

``--boards none,copy,step`` (interleaved in each repeat) gives the shard a weights board as it
has with shared memory: ``copy`` steps the block in place, then copies it onto the board;
``step`` steps it straight into the board's next version (what a primary does).

The same header unpacked in a tight loop takes a few microseconds; here, between other work, it
takes several times that, and in a process woken once per message on a shared core more again:
most of a message's cost is bringing code and data back into the caches.

Usage: python bench/cores.py [--sizes 64K,4M] [--pushes 3000] [--repeat 3] [--boards none]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import numpy as np

from gradbus import memory
from gradbus.broker.actions import ToShard
from gradbus.broker.core import BrokerCore
from gradbus.codecs import shm, wire
from gradbus.codecs.partition import TensorLayout
from gradbus.shards.core import ShardCore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (the sizes)

SGD = {"name": "sgd", "lr": 1e-6}
BOARDS = ("none", "copy", "step")


class Wired:
    """A broker core and one shard core, messages between them delivered at once, the time in
    each core's calls summed."""

    def __init__(self, nbytes: int, board: str = "none"):
        self.broker, self.shard = BrokerCore(16, now=0.0), ShardCore("s0")
        self.board = None
        if board != "none":
            self.board = shm.Board(shm.cluster_tag(f"bench-cores-{os.getpid()}"))
            self.shard.publisher.board = self.board
            if board == "copy":                 # published by a copy after each step
                self.shard.store.use_board(None)
        self.spent = {"broker": 0.0, "shard": 0.0}
        self.headers: dict = collections.defaultdict(lambda: [0, 0.0])
        self._deliver(self.broker.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0")], 0.0))
        n = nbytes // 4
        layout = TensorLayout("w", "float32", (n,), max(nbytes, 1 << 20))
        d, buf = wire.encode_tensor("w/0", np.zeros(n, np.float32))
        self.client([wire.pack(wire.INIT, [d], msg=1, opt=SGD,
                               tensors=[{**layout.to_wire(), "init": {"name": "given"}}]),
                     bytes(buf)])
        self.grad, self.msg = np.ones(n, np.float32), 1

    def _timed(self, who: str, call, *args):
        t = time.perf_counter()
        out = call(*args)
        self.spent[who] += time.perf_counter() - t
        return out

    def _deliver(self, actions) -> None:
        for a in actions:
            if type(a) is not ToShard:
                continue
            for out in self._timed("shard", self.shard.handle, [bytes(f) for f in a.frames]):
                self._deliver(self._timed("broker", self.broker.on_backend, b"s0",
                                          [bytes(f) for f in out], 0.0))

    def client(self, frames) -> None:
        self._deliver(self._timed("broker", self.broker.on_frontend, b"c", frames, 0.0))
        self._deliver(self._timed("broker", self.broker.flush, 0.0))

    def push(self) -> None:
        self.msg += 1
        d, buf = wire.encode_tensor("w/0", self.grad)
        self.client([wire.pack(wire.PUSH, [d], msg=self.msg, acks=1), bytes(buf)])


def run(nbytes: int, pushes: int, board: str = "none") -> dict:
    """One run: microseconds per push in each core, and per header unpacked by kind."""
    wired = Wired(nbytes, board)
    try:
        return _run(wired, pushes)
    finally:
        if wired.board is not None:
            wired.board.close()


def _run(wired: Wired, pushes: int) -> dict:
    for _ in range(min(200, pushes)):        # warm: first batches, scratch buffers
        wired.push()
    unpack, headers = wire.unpack_header, wired.headers

    def timed_unpack(frame, kinds):
        t = time.perf_counter()
        h = unpack(frame, kinds)
        e = headers[h["kind"]]
        e[0] += 1
        e[1] += time.perf_counter() - t
        return h

    wired.spent = {"broker": 0.0, "shard": 0.0}
    wire.unpack_header = timed_unpack
    try:
        for _ in range(pushes):
            wired.push()
    finally:
        wire.unpack_header = unpack
    wired.broker.validate_state()
    return {"broker_us": wired.spent["broker"] / pushes * 1e6,
            "shard_us": wired.spent["shard"] / pushes * 1e6,
            "header_us": {k: t / n * 1e6 for k, (n, t) in headers.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,4M")
    ap.add_argument("--pushes", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--boards", default="none", help="none, copy, step (comma-separated)")
    a = ap.parse_args(argv)
    sizes, boards = a.sizes.split(","), a.boards.split(",")
    memory.keep_freed_memory()          # as the broker and shard processes do
    if a.pushes < 1 or a.repeat < 1 or not set(sizes) <= set(throughput.SIZES):
        ap.error(f"--pushes and --repeat at least 1, --sizes of {sorted(throughput.SIZES)}")
    if not set(boards) <= set(BOARDS):
        ap.error(f"--boards of {', '.join(BOARDS)}")
    for size in sizes:
        runs = {b: [] for b in boards}
        for _ in range(a.repeat):             # interleaved: each board's runs see alike load
            for b in boards:
                runs[b].append(run(throughput.SIZES[size], a.pushes, b))
        for b in boards:
            report(size, b, runs[b], a)
    return 0



def report(size: str, board: str, runs: list, a) -> None:
    kinds = sorted({k for r in runs for k in r["header_us"]})
    print(json.dumps({
        "bench": "cores", "size": size, "board": board, "pushes": a.pushes,
        "repeats": a.repeat,
        "broker_core_us_per_push": round(statistics.median(r["broker_us"] for r in runs), 1),
        "shard_core_us_per_push": round(statistics.median(r["shard_us"] for r in runs), 1),
        "unpack_header_us": {k: round(statistics.median(r["header_us"][k] for r in runs
                                                       if k in r["header_us"]), 2)
                             for k in kinds}}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
