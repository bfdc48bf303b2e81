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
    shm    only headers go through the broker: each worker copies its gradient into a slot of
           its own shared-memory ring (as many slots as gradbus's default credit window, 32
           pushes and 128 MiB, allows), the shard steps its weights reading the slot in place,
           writes them to a shared-memory board behind a seqlock and acks; on every ack the
           worker copies the weights out of the board. No checksum, no sequencing. Segments are
           files in /dev/shm named ``gradbus-bench-*``, removed at the end (bench/peers.py
           runs this variant beside gradbus and PyTorch RPC)

The broker and shard keep the memory they free, as gradbus's do (gradbus/memory.py).

In the same run it measures ``zmq.proxy`` as bench/throughput.py does, and prints one JSON line
per work level with the pipeline's pushes per second and its ratio to the proxy. A gradbus
ratio near the ``raw`` line's is gradbus adding little to the work itself.

Usage: python bench/floor.py [--size 4M] [--work none,raw,bf16,shm] [--seconds S] [--repeat N]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import secrets
import statistics
import struct
import sys
import time

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


# ----------------------------------------------------------------------------- shm
SHM_DIR = "/dev/shm"
SHM_PREFIX = "gradbus-bench-"
RING_BYTES = 128 << 20      # gradbus's default credit window: 32 pushes and 128 MiB
BOARD_HEADER = 64           # the board's seqlock counter has its first cache line to itself
SLOT = struct.Struct("<HI")  # a push's header: the worker, the ring slot


class Segments:
    """The shared-memory files of one run, which this object owns: made with O_CREAT|O_EXCL,
    mode 0600 and posix_fallocate under /dev/shm as ``gradbus-bench-<pid>-<token>-<label>``, and
    all removed when the ``with`` block ends, also on an error."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory, self.paths = directory, []
        self.stem = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"

    def make(self, label: str, nbytes: int) -> str:
        path = os.path.join(self.directory, self.stem + label)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.paths.append(path)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        return path

    def remove(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.paths = []

    def __enter__(self) -> "Segments":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class Samples:
    """One worker's round trips, in shared memory: for update k (a push, an RPC call) the
    ``time.monotonic()`` it was sent, acknowledged and the worker held fresh weights including
    it. The newest ``CAPACITY`` are kept (slot k mod CAPACITY); made before the worker starts
    and handed to it as an argument, read by the parent for a window of time."""

    CAPACITY = 1 << 17

    def __init__(self, ctx):
        self.t = ctx.RawArray("d", 3 * self.CAPACITY)

    def sent(self, k: int) -> None:
        i = 3 * (k % self.CAPACITY)
        self.t[i] = time.monotonic()
        self.t[i + 1] = self.t[i + 2] = 0.0

    def acked(self, k: int) -> None:
        self.t[3 * (k % self.CAPACITY) + 1] = time.monotonic()

    def fresh(self, k: int) -> None:
        self.t[3 * (k % self.CAPACITY) + 2] = time.monotonic()

    def window(self, t0: float, t1: float) -> tuple[list, list]:
        """Push-to-ack and push-to-fresh seconds of the updates made fresh in [t0, t1)."""
        a = np.frombuffer(self.t, np.float64).reshape(-1, 3).copy()
        done = a[(a[:, 2] >= t0) & (a[:, 2] < t1) & (a[:, 1] > 0)]
        return (done[:, 1] - done[:, 0]).tolist(), (done[:, 2] - done[:, 0]).tolist()


def map_segment(path: str) -> mmap.mmap:
    """The whole of an existing segment, mapped shared, read-write."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def ring_slots(nbytes: int) -> int:
    return max(1, min(IN_FLIGHT, RING_BYTES // nbytes))


class Ring:
    """A worker's gradient slots in one segment: push k is in slot k mod ``slots``, and a slot
    is written again only after the push in it was acked (the worker's credit is the slots)."""

    def __init__(self, path: str, n: int, slots: int):
        self.map = map_segment(path)
        self.slots = np.frombuffer(self.map, np.float32, slots * n).reshape(slots, n)

    @staticmethod
    def size(n: int, slots: int) -> int:
        return 4 * n * slots


class Board:
    """A block of float32 weights in one segment behind a seqlock, one writer, any readers.
    The writer makes the counter odd, writes the block, makes it even; a reader copies the block
    and keeps the copy only when the counter was even and the same before and after. The
    counter and the block are plain loads and stores: this relies on x86's store and load
    ordering (other machines would need fences)."""

    def __init__(self, path: str, n: int):
        self.map = map_segment(path)
        self.seq = np.frombuffer(self.map, np.uint64, 1)
        self.data = np.frombuffer(self.map, np.float32, n, BOARD_HEADER)

    @staticmethod
    def size(n: int) -> int:
        return BOARD_HEADER + 4 * n

    def write(self, block: np.ndarray) -> None:
        s = int(self.seq[0])
        self.seq[0] = s + 1
        np.copyto(self.data, block)
        self.seq[0] = s + 2

    def step_in_place(self, step, grad: np.ndarray, lr) -> None:
        """``step(weights, grad, lr)`` run on the block itself, as one write."""
        s = int(self.seq[0])
        self.seq[0] = s + 1
        step(self.data, grad, lr)
        self.seq[0] = s + 2

    def read(self, out: np.ndarray) -> int:
        """Copies the newest whole block into ``out``; returns its version (writes before it)."""
        while True:
            before = int(self.seq[0])
            if before & 1:
                os.sched_yield()
                continue
            np.copyto(out, self.data)
            if int(self.seq[0]) == before:
                return before >> 1


def _shm_shard(back: int, n: int, rings: list, board: str, slots: int,
               step: str = "numpy") -> None:
    memory.keep_freed_memory()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{back}")
    s.send(b"hello")

    def recv():
        client, header = s.recv_multipart(copy=False)
        return client, header.bytes

    shm_shard_loop(recv, lambda client, header: s.send_multipart([client, header]), n, rings,
                   board, slots, step)


STEPS = ("numpy", "onepass", "inplace")


def shm_shard_loop(recv, send, n: int, rings: list, board: str, slots: int,
                   step: str = "numpy") -> None:
    """The shard's work, whatever carries its messages: ``recv()`` gives ``(route, header)``
    for the next push, ``send(route, header)`` acks it. ``step``: ``numpy``, two numpy passes
    over private weights, then a copy onto the board; ``onepass``, one pass (numba's loop, as
    gradbus's shard steps), then the copy; ``inplace``, the weights live on the board and
    each step is written there in one pass, readers retrying while it writes."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, not {step!r}")
    rings = [Ring(path, n, slots) for path in rings]
    out = Board(board, n)
    acc, w = np.empty(n, np.float32), np.zeros(n, np.float32)
    lr = np.asarray(-1e-6, np.float32)
    out.write(w)
    loop, rate = (_sgd_loop() if step != "numpy" else None), lr[()]
    while True:
        route, header = recv()
        worker, slot = SLOT.unpack(header)
        grad = rings[worker].slots[slot]                        # the gradient, read in place
        if step == "inplace":
            out.step_in_place(loop, grad, rate)
        elif step == "onepass":
            loop(w, grad, rate)
            out.write(w)
        else:
            np.multiply(grad, lr, out=acc)
            w += acc                                            # an SGD step: w -= lr * g
            out.write(w)
        send(route, b"ack")


def _sgd_loop():
    """``step(w, g, lr)``: ``w += g * lr`` in one pass, compiled (uncached: nothing written)."""
    import numba

    @numba.njit(nogil=True)
    def step(w, g, lr):
        for i in range(w.size):
            w[i] += g[i] * lr
    return step


def _shm_worker(front: int, index: int, n: int, ring: str, board: str, slots: int,
                counters, stop, depth: int, lat: Samples | None) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{front}")
    try:
        shm_worker_loop(s.send, lambda: s.poll(200) and s.recv(), index, n, ring, board, slots,
                        counters, stop, depth, lat)
    finally:
        s.close(linger=0)
        ctx.term()


def shm_worker_loop(send, acked, index: int, n: int, ring: str, board: str, slots: int,
                    counters, stop, depth: int, lat: Samples | None) -> None:
    """A worker's work, whatever carries its messages: ``send(header)`` pushes, ``acked()``
    is true when the oldest push's ack came (acks come in order), false after a wait."""
    ring, weights = Ring(ring, n, slots), Board(board, n)
    g = np.random.default_rng(index).standard_normal(n).astype(np.float32)
    w = np.empty(n, np.float32)
    sent = done = 0
    depth = min(depth, slots)
    while not stop.value:
        while sent - done < depth:
            slot = sent % slots
            if lat is not None:
                lat.sent(sent)
            np.copyto(ring.slots[slot], g)
            send(SLOT.pack(index, slot))
            sent += 1
        if not acked():
            continue
        if lat is not None:
            lat.acked(done)
        weights.read(w)             # the fresh weights, as a training step would take them
        if lat is not None:
            lat.fresh(done)
        done += 1
        counters[index] += 1


def stop_processes(procs, grace: float = 10.0) -> None:
    """Terminates every multiprocessing child of ``procs`` still running, kills one that outlives
    ``grace`` seconds, and reaps them all."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


@contextlib.contextmanager
def shm_pipeline(nbytes: int, counters, stop, workers: int = WORKERS, depth: int = IN_FLIGHT,
                 lat: list | None = None, transport: str = "zmq", step: str = "numpy"):
    """The ``shm`` pipeline running: a broker, a shard and ``workers`` workers (spawned
    processes), each with at most ``depth`` pushes in flight; worker i adds one to
    ``counters[i]`` per push acked (and records its round trips in ``lat[i]``, a
    :class:`Samples`, when given) and stops when ``stop.value`` is set. ``transport``: ``zmq``
    (DEALER and ROUTER sockets over TCP) or ``link`` (gradbus's local links, bench/floor_link.py,
    what gradbus's processes of one host use). ``step``: how the shard steps its weights
    (:func:`shm_shard_loop`). Yields the processes; on leaving, every process is
    reaped and every segment removed."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, not {step!r}")
    ctx = mp.get_context("spawn")
    n, slots = nbytes // 4, ring_slots(nbytes)
    if transport == "zmq":
        front, back = throughput.free_port(), throughput.free_port()
        broker, shard, worker = (_broker, (front, back)), (_shm_shard, back), (_shm_worker, front)
    elif transport == "link":
        import floor_link
        name = floor_link.address()
        broker, shard, worker = ((floor_link.broker, (name, workers)), (floor_link.shard, name),
                                 (floor_link.worker, name))
    else:
        raise ValueError(f"transport must be zmq or link, not {transport!r}")
    procs = []
    with Segments() as segs:
        try:
            rings = [segs.make(f"ring{i}", Ring.size(n, slots)) for i in range(workers)]
            board = segs.make("board", Board.size(n))
            procs = [ctx.Process(target=broker[0], args=broker[1], daemon=True),
                     ctx.Process(target=shard[0], daemon=True,
                                 args=(shard[1], n, rings, board, slots, step))]
            procs += [ctx.Process(target=worker[0], daemon=True,
                                  args=(worker[1], i, n, rings[i], board, slots, counters, stop,
                                        depth, lat[i] if lat else None))
                      for i in range(workers)]
            for p in procs:
                p.start()
            yield procs
        finally:
            stop.value = 1
            for p in procs[2:]:
                if p.pid is not None:
                    p.join(10)
            stop_processes(procs)


def count_window(counters, alive, warmup: float, seconds: float, sample=None,
                 ready_timeout: float = 120.0) -> dict:
    """Counts events in a window: waits until every worker counted one (``alive()`` true all
    along), waits ``warmup`` seconds, then takes ``seconds``. ``sample()``, if given, is called
    at both ends of the window. Returns the events, the window's seconds and both samples."""
    deadline = time.monotonic() + ready_timeout
    while min(counters) == 0:
        if not alive():
            raise RuntimeError("a process of the configuration ended before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every worker counted an event in {ready_timeout:.0f}s")
        time.sleep(0.05)
    time.sleep(warmup)
    first = sample() if sample else None
    c0, t0 = sum(counters), time.perf_counter()
    time.sleep(seconds)
    c1, t1 = sum(counters), time.perf_counter()
    last = sample() if sample else None
    if not alive():
        raise RuntimeError("a process of the configuration ended during the window")
    return {"events": c1 - c0, "seconds": t1 - t0, "first": first, "last": last}


def run_floor_shm(nbytes: int, warmup: float, seconds: float) -> float:
    """The ``shm`` pipeline's pushes acked per second, all workers."""
    ctx = mp.get_context("spawn")
    counters, stop = ctx.RawArray("q", WORKERS), ctx.RawValue("b", 0)
    with shm_pipeline(nbytes, counters, stop) as procs:
        win = count_window(counters, lambda: all(p.exitcode is None for p in procs),
                           warmup, seconds)
    return win["events"] / win["seconds"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4M", choices=sorted(throughput.SIZES))
    ap.add_argument("--work", default="none,raw,bf16")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args(argv)
    works = a.work.split(",")
    if a.repeat < 1 or not set(works) <= {"none", "raw", "bf16", "shm"}:
        ap.error("--repeat must be at least 1 and --work a list of none, raw, bf16, shm")
    nbytes = throughput.SIZES[a.size]
    proxies, rates = [], {w: [] for w in works}
    for _ in range(a.repeat):         # interleaved with the proxy, as bench/throughput.py does
        proxies.append(throughput.run_proxy(nbytes, WORKERS, 1, a.warmup, a.seconds))
        for w in works:
            rates[w].append(run_floor_shm(nbytes, a.warmup, a.seconds) if w == "shm"
                            else run_floor(nbytes, w, a.warmup, a.seconds))
    for w, rs in rates.items():
        print(json.dumps({"bench": "floor", "size": a.size, "bytes": nbytes, "workers": WORKERS,
                          "work": w, "pushes_per_s": round(statistics.median(rs), 1),
                          "proxy_msgs_per_s": round(statistics.median(proxies), 1),
                          **throughput.ratio_fields(rs, proxies), "cpus": os.cpu_count()}),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
