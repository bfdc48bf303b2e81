"""Passes over big buffers spread over a fixed pool of threads: a shard's over a batch's
blocks, a client's copies into its push ring and out of the weights boards.

A block is at most 4 MiB; its passes (each frame's checksum, the sum of its gradients, the
finiteness check, the optimizer step and its write onto the weights board) are elementwise, so
a block's element range can be cut into pieces stepped at once by several threads, each piece
with its own scratch, while other threads hash the block's frames whole. numpy releases the
interpreter lock inside its ufuncs and copies, and the numba loops run with ``nogil``, so the
pieces run on as many cores as there are threads; xxhash releases it while it hashes.

:class:`Passes` is that pool: ``threads - 1`` helper threads (the calling thread runs a share
too), started on first use and ended by :meth:`Passes.close`. With one thread (a host short of
cores, or ``--threads 1``) nothing is split and no thread is started: the shard takes the same
one-pass path it takes without a pool. Shards that share a process (the broker's in-process
shards, which its one loop runs in turn) share one pool (:func:`shared`).

The results are the same bits as one thread's: every piece computes the same expressions on
its elements in the same order (a sum over a batch's gradients still runs in batch order per
element), only the elements are split.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from . import cores

MIN_PIECE_BYTES = 512 << 10      # a piece's pass must outweigh handing it to a thread (~20 us)
ALIGN = 4096                     # copies cut on page boundaries


def _bytes(buf) -> np.ndarray:
    """A byte buffer as a flat uint8 array over the same memory (numpy's copies release the
    interpreter lock; a memoryview's do not)."""
    return np.frombuffer(memoryview(buf).cast("B"), np.uint8)


class Passes:
    """Runs a list of callables at once on ``threads`` threads (the caller's included)."""

    def __init__(self, threads: int):
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be an int >= 1, not {threads!r}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.users = 0                       # shards sharing it (see shared())
        self.stats = {"split_passes": 0, "pieces": 0}

    def pieces(self, nbytes: int) -> int:
        """How many pieces a pass over ``nbytes`` bytes is cut into (1: not split)."""
        if self.threads == 1:
            return 1
        return max(1, min(self.threads, nbytes // MIN_PIECE_BYTES))

    def ranges(self, n: int, parts: int, align: int) -> list[slice]:
        """``range(n)`` as at most ``parts`` consecutive slices, each boundary a multiple of
        ``align`` elements (a cache chunk, so each piece walks whole chunks as one thread
        would)."""
        per = -(-n // max(1, parts))
        per = max(align, -(-per // align) * align)
        return [slice(lo, min(lo + per, n)) for lo in range(0, n, per)] or [slice(0, 0)]

    def run(self, tasks: list) -> list:
        """Each of ``tasks`` (callables without arguments) called once, at once where there
        are threads for it, the last in the calling thread; their results in order. The first
        exception raised is raised here, once every task ended."""
        if len(tasks) <= 1 or self.threads == 1:
            return [t() for t in tasks]
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads - 1,
                                                    thread_name_prefix="gradbus-pass")
                pool = self._pool
        futs = [pool.submit(t) for t in tasks[:-1]]
        err = None
        try:
            last = tasks[-1]()
        except BaseException as e:     # the others still end before this returns
            err, last = e, None
        out = []
        for f in futs:
            try:
                out.append(f.result())
            except BaseException as e:
                err = err or e
                out.append(None)
        if err is not None:
            raise err
        self.stats["split_passes"] += 1
        self.stats["pieces"] += len(tasks)
        return [*out, last]

    def copy(self, dst, src) -> None:
        """``dst[:] = src`` (byte buffers of one size), in pieces at once where it is big."""
        pieces = self.pieces(memoryview(dst).nbytes)
        if pieces == 1:
            memoryview(dst).cast("B")[:] = memoryview(src).cast("B")
            return
        d, s = _bytes(dst), _bytes(src)
        self.run([lambda sl=sl: np.copyto(d[sl], s[sl])
                  for sl in self.ranges(d.size, pieces, ALIGN)])

    def copy_hashing(self, dst, src) -> int | None:
        """:meth:`copy`, and the xxh3-64 of ``src`` hashed whole beside the pieces (None
        where the copy is not split: the caller hashes as it copies)."""
        pieces = self.pieces(memoryview(dst).nbytes)
        if pieces == 1:
            return None
        d, s = _bytes(dst), _bytes(src)
        got = self.run([*(lambda sl=sl: np.copyto(d[sl], s[sl])
                          for sl in self.ranges(d.size, pieces, ALIGN)),
                        lambda: xxhash.xxh3_64_intdigest(s)])
        return got[-1]

    def close(self) -> None:
        """End the helper threads (they finish what they run first)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


_shared: dict[int, Passes] = {}
_shared_lock = threading.Lock()


def shared(threads: int | None = None) -> Passes:
    """The process's pool of ``threads`` threads (None or 0: :func:`cores.pass_threads`),
    shared by the shards of one process; give it back with :func:`release`."""
    n = cores.pass_threads(threads)
    with _shared_lock:
        p = _shared.get(n)
        if p is None:
            p = _shared[n] = Passes(n)
        p.users += 1
        return p


def release(p: Passes) -> None:
    """One user of a :func:`shared` pool less; the last ends its threads."""
    with _shared_lock:
        p.users -= 1
        if p.users > 0:
            return
        if _shared.get(p.threads) is p:
            del _shared[p.threads]
    p.close()
