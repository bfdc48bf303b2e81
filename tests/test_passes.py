"""A shard's passes over a big block split over threads (gradbus/codecs/passes.py): the pool's own
rules, and a shard with 4 pass threads holding the same bits as one with a single thread for
every optimizer, whether it steps onto its weights board (the primary's one-pass step) or in
place (a standby), with batches of one to three pushes, scaled pushes, a frame whose checksum
is wrong and a gradient that is not finite (each refused exactly, as by one thread)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gradbus.codecs import cores, passes, shm, wire
from gradbus.codecs.errors import Code

from .rigs import CheckedShard, init_one_block, unpack

pytestmark = pytest.mark.usefixtures("shm_dir")

N = (1 << 20) + 17               # a 4 MiB block (4 pieces with 4 threads) and a short end
OPTS = [{"name": "sgd", "lr": 0.5, "momentum": 0.0},
        {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        {"name": "adam", "lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8},
        {"name": "adagrad", "lr": 0.1, "eps": 1e-10}]


# ----------------------------------------------------------------------------- the pool
def test_ranges_cover_the_elements_once_on_chunk_boundaries():
    p = passes.Passes(4)
    for n in (0, 1, 1000, 65536 * 4, 65536 * 4 + 1, N):
        rs = p.ranges(n, 4, 65536)
        assert len(rs) <= 4
        assert [r.start for r in rs[1:]] == [r.stop for r in rs[:-1]]
        assert rs[0].start == 0 and rs[-1].stop == n
        assert all(r.start % 65536 == 0 for r in rs)


def test_pieces_follow_the_bytes_and_the_threads():
    assert passes.Passes(1).pieces(64 << 20) == 1
    four = passes.Passes(4)
    assert four.pieces(256 << 10) == 1                   # too small to hand out
    assert four.pieces(1 << 20) == 2
    assert four.pieces(16 << 20) == 4


def test_run_returns_results_in_order_and_ends_its_threads():
    p = passes.Passes(3)
    names = []

    def task(i):
        names.append(threading.current_thread().name)
        return i * i
    try:
        assert p.run([lambda i=i: task(i) for i in range(7)]) == [i * i for i in range(7)]
        assert any(n.startswith("gradbus-pass") for n in names)
    finally:
        p.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("gradbus-pass")]


def test_a_task_that_raises_is_raised_after_the_others_ended():
    p = passes.Passes(2)
    ended = threading.Event()

    def slow():
        ended.wait(5)
        return 1

    def bad():
        ended.set()
        raise ValueError("piece failed")
    try:
        with pytest.raises(ValueError, match="piece failed"):
            p.run([slow, bad])
        assert ended.is_set()
    finally:
        p.close()


def test_bad_thread_counts_are_refused():
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError):
            passes.Passes(bad)


def test_shared_pools_are_one_per_size_and_end_with_their_last_user():
    a, b = passes.shared(3), passes.shared(3)
    assert a is b and a.users == 2
    a.run([lambda: 1, lambda: 2, lambda: 3])
    passes.release(a)
    assert a._pool is not None                      # b still uses it
    passes.release(b)
    assert a._pool is None
    assert not [t for t in threading.enumerate() if t.name.startswith("gradbus-pass")]


def test_the_thread_count_follows_the_host():
    assert cores.pass_threads(cores=16, environ={}) == 8            # capped
    assert cores.pass_threads(cores=16, host_shards=4, environ={}) == 4
    assert cores.pass_threads(cores=16, environ={cores.HOST_SHARDS_ENV: "2"}) == 8
    assert cores.pass_threads(cores=12, environ={cores.HOST_SHARDS_ENV: "4"}) == 3
    assert cores.pass_threads(cores=2, environ={}) == 1             # a small host: none
    assert cores.pass_threads(cores=2, environ={cores.THREADS_ENV: "4"}) == 4   # forced
    assert cores.pass_threads(3, cores=64, environ={cores.THREADS_ENV: "5"}) == 3
    with pytest.raises(ValueError, match=cores.THREADS_ENV):
        cores.pass_threads(cores=16, environ={cores.THREADS_ENV: "many"})


# ----------------------------------------------------------------------------- the shard
@pytest.fixture
def board():
    b = shm.Board("5e1f0c2a", segment_bytes=16 << 20)
    yield b
    b.close()


def _init(sc, opt) -> None:
    init_one_block(sc, opt, N)


def _batch(seq: int, grads, scales=None, bad: int | None = None, chain: str = "raw") -> list:
    encs = [wire.encode_tensor("w/0", g, chain) for g in grads]
    descs = [d for d, _ in encs]
    entries = [{"op": "push", "i": i, "c": "c", "m": 10 * seq + i} for i in range(len(grads))]
    for e, w in zip(entries, scales or ()):
        if w is not None:
            e["w"] = w
    frames = [bytes(b) for _, b in encs]
    head = wire.pack(wire.BATCH, descs, parts=[{"p": 0, "seq": seq, "epoch": 1, "o": "p0",
                                                 "e": entries}])
    if bad is not None:
        frames[bad] = bytes(frames[bad][:-4]) + bytes(4 * [0x7F])   # its checksum no longer
    return [head, *frames]


def _errors(out) -> list:
    head = unpack(out[0][0])           # the APPLIED, then the UPDATEs
    return [e for part in head["parts"] for e in part.get("errors") or []]


# frames read piece by piece (raw), and frames decoded whole first (zstd): summed apart
CASES = [(o, "raw") for o in OPTS] + [(OPTS[0], "raw|zstd"), (OPTS[2], "raw|zstd")]


@pytest.mark.parametrize("opt,chain", CASES,
                         ids=["sgd", "momentum", "adam", "adagrad", "sgd-zstd", "adam-zstd"])
def test_four_pass_threads_give_the_bits_of_one(board, opt, chain):
    one, four = CheckedShard("p0", threads=1), CheckedShard("p0", threads=4)
    standby = CheckedShard("s1", threads=4)               # steps in place, split too
    one_board = shm.Board("5e1f0c2b", segment_bytes=16 << 20)
    try:
        one.publisher.board, four.publisher.board = one_board, board
        assert four.passes.threads == 4 and one.passes.threads == 1
        for sc in (one, four, standby):
            _init(sc, opt)
        rng = np.random.default_rng(3)
        for seq in range(2, 8):
            grads = [rng.normal(size=N).astype(np.float32) for _ in range(1 + seq % 3)]
            scales = [0.5 if (seq + i) % 4 == 0 else None for i in range(len(grads))]
            bad = 1 if seq == 5 else None                  # one frame damaged in a batch
            if seq == 6:
                grads[0][N // 2] = np.nan                  # refused, the others applied
            msgs = _batch(seq, grads, scales, bad, chain)
            outs = [sc.handle(list(msgs)) for sc in (one, four, standby)]
            errs = [_errors(o) for o in outs]
            assert errs[0] == errs[1] == errs[2]
            if bad is not None:
                assert [e[1] for e in errs[0]] == [Code.BAD_CHECKSUM.value]
            if seq == 6:
                assert [e[1] for e in errs[0]] == [Code.NOT_FINITE.value]
            a, b = one.store.blocks["w/0"], four.store.blocks["w/0"]
            c = standby.store.blocks["w/0"]
            assert np.array_equal(a.newest, b.newest) and np.array_equal(a.newest, c.value)
            assert a.version == b.version == c.version
            for name, arr in a.state.items():
                assert np.array_equal(np.asarray(b.state[name]), np.asarray(arr)), name
        assert four.passes.stats["split_passes"] > 0        # the split path ran
        assert (one.replication.partition_digest(0) == four.replication.partition_digest(0)
                == standby.replication.partition_digest(0))
        one.publisher.board = four.publisher.board = None
    finally:
        for sc in (one, four, standby):
            sc.close()
        one_board.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("gradbus-pass")]


# ----------------------------------------------------------------------------- the client
def test_copies_in_pieces_are_whole_and_hash_as_the_wire_does():
    p = passes.Passes(4)
    try:
        src = np.random.default_rng(0).integers(0, 255, (3 << 20) + 5, np.uint8)
        dst = bytearray(src.nbytes)
        assert p.copy_hashing(memoryview(dst), src) == wire.checksum(src)
        assert bytes(dst) == src.tobytes()
        dst2 = bytearray(src.nbytes)
        p.copy(memoryview(dst2), memoryview(src))
        assert bytes(dst2) == src.tobytes()
        assert p.stats["split_passes"] == 2
        small = bytearray(1000)                       # below a piece: not split, not hashed
        assert p.copy_hashing(memoryview(small), bytes(range(200)) * 5) is None
        p.copy(memoryview(small), bytes(range(200)) * 5)
        assert bytes(small) == bytes(range(200)) * 5 and p.stats["split_passes"] == 2
    finally:
        p.close()


def test_the_client_copy_threads_follow_the_host():
    assert cores.client_threads(cores=2, environ={}) == 1
    assert cores.client_threads(cores=16, environ={}) == 2
    assert cores.client_threads(cores=128, environ={}) == 4
    assert cores.client_threads(cores=2, environ={cores.CLIENT_THREADS_ENV: "3"}) == 3
    assert cores.client_threads(6, cores=2, environ={}) == 6


def test_a_client_with_copy_threads_pushes_and_pulls_the_known_answer(make_cluster):
    import gradbus
    cluster = make_cluster(1, processes=False)
    n = 3 << 20                               # 12 MiB: blocks of 4 MiB, each in 8 pieces
    with gradbus.connect(cluster.url, timeout=30, threads=4) as c:
        assert c.passes is not None and c.passes.threads == 4 and c.shm is not None
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        g = np.random.default_rng(2).standard_normal(n).astype(np.float32)
        vers = [c.push({"w": g}).result(30)["ver"] for _ in range(3)]
        w = c.pull(["w"], min_version=max(vers), timeout=30)["w"]
        want = -(g + g + g)
        assert np.array_equal(w, want)
        assert c.passes.stats["split_passes"] > 0     # the ring's and the board's copies
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="threads"):
            gradbus.Client("tcp://127.0.0.1:1", threads=bad, timeout=0.1)
