"""The codecs from many threads of one process: every codec chain pushed by several SDK clients
in threads against an in-process cluster (whose shards decode in threads of the same process),
and the shard's decoders run by several threads at once.

A codec state shared between threads (a zstd context, say) can corrupt memory rather than
raise, so each workload runs in a child interpreter: a crash or a hang there is a failed test
with the child's output, not a lost test run.
"""
from __future__ import annotations

import itertools
import math
import threading

import numpy as np

from gradbus.codecs import tensor as tcodec
from gradbus.codecs import wire

from .child import in_child

CHILD_TIMEOUT = 600          # seconds: the hang detector (a healthy run takes a fraction)
FRACTION = "0.25"
#: every chain the grammar of gradbus.codecs.tensor allows, each stage with one setting
CHAINS = ["|".join(p for p in (sparse, coder, shuffle, z) if p)
          for sparse, coder, shuffle, z in itertools.product(
              ("", f"topk:{FRACTION}", f"randomk:{FRACTION}"), tcodec.PRECISION,
              ("", "shuffle"), ("", "zstd"))]
CLIENTS = 4
ROUNDS = 2                   # pushes of each chain per client
N = 1 << 18                  # values per tensor: 1 MiB of float32, one block


def _in_child(workload: str, *args) -> str:
    return in_child("tests.test_threads", workload, *args, timeout=CHILD_TIMEOUT)


def _gradient(chain: str) -> np.ndarray:
    """A gradient every stage of ``chain`` carries exactly but randomk's choice: values +-127
    (int8's scale is then 1, sign's mean |x| is 127, fp16 and bf16 hold them); for topk exactly
    its k entries are non-zero, so it keeps those."""
    rng = np.random.default_rng(CHAINS.index(chain))
    g = np.where(rng.random(N) < 0.5, np.float32(-127), np.float32(127)).astype(np.float32)
    if chain.startswith("topk"):
        keep = math.ceil(float(FRACTION) * N)
        g[rng.permutation(N)[keep:]] = 0
    return g


def _threads(n: int, target) -> list:
    """Run ``target(i)`` in ``n`` threads at once; the exceptions they raised."""
    errors: list = []
    start = threading.Barrier(n)

    def run(i):
        try:
            start.wait(60)
            target(i)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append((i, repr(e)))
    threads = [threading.Thread(target=run, args=(i,), name=f"test-thread-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def cluster_workload() -> None:
    """Several clients, one per thread, push every chain ROUNDS times each, in different orders,
    to an in-process cluster (broker and two shards in threads of this process). With SGD(lr=1)
    and no error feedback, each tensor ends at minus the sum of what its pushes decode to:
    exactly -(CLIENTS * ROUNDS) * g for every chain but randomk; for randomk, each entry at
    -m * g with m a whole number of pushes that kept it, and the m adding up to every push's
    k entries."""
    import gradbus
    from gradbus.cluster import LocalCluster
    from tests.rigs import cluster_cores, state_problems

    cluster = LocalCluster(2, port=0, processes=False).start()
    try:
        grads = {chain: _gradient(chain) for chain in CHAINS}
        names = {chain: f"t{i}" for i, chain in enumerate(CHAINS)}
        with gradbus.connect(cluster.url, block_bytes=4 << 20) as c:
            c.init({names[ch]: np.zeros(N, np.float32) for ch in CHAINS},
                   optimizer=gradbus.SGD(lr=1.0))

        def client(i):
            order = CHAINS[i * 7:] + CHAINS[:i * 7]
            with gradbus.connect(cluster.url, block_bytes=4 << 20, error_feedback=False,
                                 seed=i) as c:
                for _ in range(ROUNDS):
                    futures = [c.push({names[ch]: grads[ch]}, codec=ch) for ch in order]
                    for f in futures:
                        f.result(120)
                c.flush(120)
        errors = _threads(CLIENTS, client)
        assert not errors, f"pushes failed: {errors}"
        pushes = CLIENTS * ROUNDS
        with gradbus.connect(cluster.url, block_bytes=4 << 20) as c:
            got = c.pull(list(names.values()), min_version=pushes, timeout=120)
        wrong = []
        for chain in CHAINS:
            w, g = got[names[chain]], grads[chain]
            if chain.startswith("randomk"):
                m = -w / g
                k = math.ceil(float(FRACTION) * N)
                ok = (np.array_equal(m, np.round(m)) and m.min() >= 0 and m.max() <= pushes
                      and int(m.sum()) == pushes * k)
            else:
                ok = np.array_equal(w, -pushes * g)
            if not ok:
                wrong.append(chain)
        assert not wrong, f"wrong weights after concurrent pushes with {wrong}"
    finally:
        cores = cluster_cores(cluster)
        cluster.stop()
    problems = state_problems(cores)
    assert not problems, f"cluster state after the run: {problems}"
    print("OK", len(CHAINS), "chains")


def _frames(chain: str):
    """Frames of ``chain`` as a shard receives them: (desc, frame) for float32 and float64
    tensors, one large (the zstd and chunked loops do real work) and one small."""
    rng = np.random.default_rng(len(chain))
    out = []
    for dtype, n in ((np.float32, 300_001), (np.float64, 1000)):
        a = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)
        d, buf = wire.encode_tensor(f"k{n}", a, chain, rng=rng)
        out.append((wire.parse_desc(d), bytes(memoryview(buf).cast("B"))))
    return out


def _decode_all(frames) -> list:
    """What a shard's decoders make of the frames: the whole decode, the staged decode with
    the CPU backend's values, and the piece-by-piece reader."""
    from gradbus.shards.backend import NumpyBackend
    out = []
    for desc, frame in frames:
        out.append(np.array(wire.decode_tensor(desc, frame)))
        idx, arrays, coder, dt, k = wire.decode_tensor_staged(desc, frame)
        out.append(None if idx is None else np.array(idx))
        out.append(np.array(NumpyBackend.decode_values(arrays, coder, dt, k)))
        stream = wire.stream_tensor(desc, frame)
        if stream is not None:
            scratch = np.empty(4096, desc.dtype)
            parts = [np.array(stream.read(lo, min(lo + 4096, stream.pieces.n), scratch))
                     for lo in range(0, stream.pieces.n, 4096)]
            assert stream.verified()
            out.append(np.concatenate(parts))
    return out


def decoders_workload(threads: int = 6, rounds: int = 3) -> None:
    """Every chain's frames decoded in one thread, then by several threads at once, each
    thread many times: every result is bit for bit the single-thread one."""
    frames = {chain: _frames(chain) for chain in CHAINS}
    want = {chain: _decode_all(fr) for chain, fr in frames.items()}

    def decode(i):
        for _ in range(rounds):
            for chain in CHAINS[i:] + CHAINS[:i]:
                got = _decode_all(frames[chain])
                for a, b in zip(got, want[chain], strict=True):
                    if not (a is None and b is None or np.array_equal(a, b, equal_nan=True)):
                        raise AssertionError(f"{chain}: a decode differs from one thread's")
    errors = _threads(threads, decode)
    assert not errors, f"concurrent decodes failed: {errors}"
    print("OK", len(CHAINS), "chains")


def test_every_chain_pushed_from_client_threads_lands_exactly():
    assert len(CHAINS) == 60
    assert "OK" in _in_child("cluster_workload")


def test_shard_decoders_in_threads_match_one_thread():
    assert "OK" in _in_child("decoders_workload")
