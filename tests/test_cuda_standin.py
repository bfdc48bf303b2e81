"""The CuPy code paths on the CUDA stand-in (tests/fake_cuda.py), on any machine: the CuPy
backend's Python around its kernels (the kernels themselves run as numpy equivalents), the
device codec on (stand-in) CuPy arrays, and a cluster whose shards run the CuPy backend.

What runs here and not on a GPU is said in fake_cuda's docstring; the kernels' CUDA source is
tested against numpy by the ``-m gpu`` tests of test_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import gradbus
from gradbus.codecs import device, shm, tensor, wire
from gradbus.codecs.partition import TensorLayout
from gradbus.shards import backend
from gradbus.shards.core import ShardCore

from . import fake_cuda
from .rigs import (
    DETERMINISTIC,
    NUMPY,
    SPECS,
    backend_steps,
    coded,
    data,
    device_gradient,
    shard_after_coded_batch,
    steps_beside_numpy,
    wait_for,
)


@pytest.fixture
def cp(monkeypatch):
    return fake_cuda.install(monkeypatch)


@pytest.fixture
def gpu(cp, monkeypatch):
    monkeypatch.setenv("GRADBUS_BACKEND", "cupy")
    return backend.load()


def test_the_standin_is_loaded_as_cupy_and_refuses_implicit_host_copies(gpu, cp):
    assert gpu.name == "cupy" and gpu.xp is cp
    a = gpu.asarray(np.arange(4.0))
    assert device.is_device(a) and device.array_module(a) is cp
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError):
        a + np.ones(4)            # a host array is no operand of a device ufunc
    assert np.array_equal(gpu.to_host(a * 2), [0, 2, 4, 6])


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_cupy_backend_steps_are_numpys(gpu, name, dtype, k):
    """One gradient per step, and a list summed inside the step's kernel: numpy's bits."""
    for what, got, want in steps_beside_numpy(gpu, name, 1003, dtype, k):
        assert np.array_equal(got, want), what
    w0, grads = data(1003, dtype)         # the batch's sum inside the step's kernel
    w = gpu.asarray(w0)
    backend_steps(gpu, name, w, [[gpu.asarray(g) for g in grads]], len(grads))
    ref_w = w0.copy()
    backend_steps(NUMPY, name, ref_w, [NUMPY.sum_into(np.empty_like(w0), grads)], len(grads))
    assert np.array_equal(gpu.to_host(w), ref_w)
    with pytest.raises(ValueError, match="1 to 8 gradients"):
        backend_steps(gpu, name, w, [[gpu.asarray(grads[0])] * 9], 9)


@pytest.mark.parametrize("count", [1, 8, 19])
def test_cupy_sum_into_and_scatter_add(gpu, count):
    _, grads = data(1001, np.float32, steps=count)
    out = gpu.xp.full(1001, np.nan, np.float32)             # the first group must overwrite
    gpu.sum_into(out, [gpu.asarray(g) for g in grads])
    assert np.array_equal(gpu.to_host(out), NUMPY.sum_into(np.empty_like(grads[0]), grads))
    dense = gpu.asarray(np.zeros(10, np.float32))
    gpu.scatter_add(dense, gpu.asarray(np.array([3, 0, 3, -1, 10, 9])),
                    gpu.asarray(np.array([1, 2, 3, 7, 7, 4], np.float32)))
    assert np.array_equal(gpu.to_host(dense), [2, 0, 0, 4, 0, 0, 0, 0, 0, 4])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", ["raw", "fp16", "bf16", "int8", "sign"])
def test_cupy_decode_values_are_the_host_decoders(gpu, chain, dtype):
    arrays, coder, dt, k, want = coded(chain, dtype, 1025)
    got = gpu.decode_values(arrays, coder, dt, k)
    assert type(got) is gpu.xp.ndarray and got.dtype == want.dtype
    assert np.array_equal(gpu.to_host(got), want, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", DETERMINISTIC)
def test_device_codec_on_cupy_arrays_gives_the_host_frames(cp, chain, dtype):
    x = device_gradient(dtype=dtype)
    before = device.device_fallbacks
    a1, b1, d1 = tensor.encode(x, chain, want_decoded=True)
    a2, b2, d2 = device.encode(cp.asarray(x), chain, want_decoded=True)
    assert device.device_fallbacks == before
    assert a1 == a2 and bytes(memoryview(b1)) == bytes(memoryview(b2))
    assert type(d2) is cp.ndarray and np.array_equal(d1, cp.asnumpy(d2), equal_nan=True)


def test_shard_core_on_cupy_applies_coded_pushes_as_on_numpy(gpu):
    """A ShardCore on the CuPy backend and one on numpy, fed the same batch of coded pushes
    (test_gpu.shard_after_coded_batch), Adam: equal to rounding (the numpy shard sums its raw
    and bf16 frames first, as it reads them; the CuPy one in batch order)."""
    opt = {"name": "adam", "lr": 0.01}
    np.testing.assert_allclose(shard_after_coded_batch(gpu, 7001, opt),
                               shard_after_coded_batch(NUMPY, 7001, opt), rtol=1e-5, atol=1e-7)


def test_cluster_on_cupy_shards_gives_the_known_answer(gpu, make_cluster):
    """An in-process cluster whose shards run the CuPy backend (GRADBUS_BACKEND=cupy): 2
    clients, 10 pushes each of g with SGD(lr) on a tensor cut into blocks of both shards give
    w0 - 20 * lr * g exactly, read back by pulls and the weights' publish."""
    cluster = make_cluster(2, processes=False)
    w0 = np.arange(3000, dtype=np.float32) % 7
    g = np.full(3000, 0.5, np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096) as a, \
            gradbus.connect(cluster.url, block_bytes=4096) as b:
        a.init({"w": w0}, optimizer=gradbus.SGD(lr=0.25))
        b.init({"w": w0}, optimizer=gradbus.SGD(lr=0.25))
        for _ in range(10):
            a.push({"w": g}, codec="raw")
            b.push({"w": g}, codec="bf16")
        a.flush()
        b.flush()
        got = a.pull(["w"], min_version=20)["w"]
        # status says what each shard computes on (its heartbeat's info)
        shards = wait_for(lambda: (st := a.status()["shards"]) and all(
            s["info"].get("backend") for s in st) and st, 10, "the shards' heartbeats")
    assert np.array_equal(got, w0 - 20 * 0.25 * 0.5)
    assert {(s["info"]["backend"], s["info"]["device"]) for s in shards} == {
        ("cupy", "cuda:0 fake-cuda (numpy)")}
    assert fake_cuda.STATE.kernels.get("gradbus_sgd", 0) + sum(
        v for k, v in fake_cuda.STATE.kernels.items() if k.startswith("gradbus_sum_sgd")) > 0


def test_a_cupy_shard_says_its_backend_and_device(gpu, caplog):
    """At start (its log), in its heartbeat's info and as the gradbus_shard_info metric."""
    with caplog.at_level("INFO", logger="gradbus.shard"):
        sc = ShardCore("s7", backend=gpu)
    assert "s7: cupy backend on cuda:0 fake-cuda (numpy)" in caplog.messages
    assert sc.info()["backend"] == "cupy" and sc.info()["device"] == "cuda:0 fake-cuda (numpy)"
    kind, _, series = sc.metrics()["gradbus_shard_info"]
    assert kind == "gauge" and series == {
        (("backend", "cupy"), ("device", "cuda:0 fake-cuda (numpy)")): 1}


# -- the GPU shard's transfers (shards/transfers.py), on the stand-in ------------------------------
def _batch(seq: int, grads: list, chains: list) -> list:
    encs = [wire.encode_tensor("w/0", g, c) for g, c in zip(grads, chains)]
    return [wire.pack(wire.BATCH, [e[0] for e in encs], parts=[
        {"p": 0, "seq": seq, "epoch": 1, "e": [{"op": "push", "i": i} for i in range(len(encs))]}]),
        *[bytes(e[1]) for e in encs]]


def test_a_cupy_shard_reuses_its_slots_and_publishes_into_its_pinned_board(gpu, shm_dir):
    """Batches of raw, bf16 and fp16 pushes (frames: staged through pinned slots, allocated
    once) on a CuPy shard with a weights board: after the first batch, no device array of a
    gradient's size is allocated (the only ones left are the 0-d sums of the finiteness check); the board
    (pinned) holds each published version, equal to the device's values; and the weights
    are numpy's, bit for bit (SGD on the same sums in the same order)."""
    n, chains = 5000, ["raw", "bf16", "fp16"]
    layout = TensorLayout("w", "float32", (n,), n)
    init = wire.pack(wire.BATCH, [], parts=[{"p": 0, "seq": 1, "epoch": 1, "e": [
        {"op": "init", "key": "w/0", "layout": layout.to_wire(), "rule": {"name": "zeros"},
         "opt": {"name": "sgd", "lr": 0.25}}]}])
    rng = np.random.default_rng(3)
    batches = [[rng.standard_normal(n).astype(np.float32) for _ in chains] for _ in range(3)]
    cores = [ShardCore("g", backend=gpu), ShardCore("h", backend=NUMPY)]
    board = shm.Board(shm.cluster_tag("127.0.0.1:1"))
    try:
        cores[0].publisher.board = board
        for sc in cores:
            sc.handle([init])
        sizes = []
        for seq, grads in enumerate(batches, start=2):
            before, waits = len(fake_cuda.STATE.sizes), fake_cuda.STATE.event_waits
            for sc in cores:
                sc.handle(_batch(seq, grads, chains))
            sizes.append(fake_cuda.STATE.sizes[before:])
            # the host waited twice: the uploads (before the reply), the copies into the board
            assert fake_cuda.STATE.event_waits - waits == 2
            blk = cores[0].store.blocks["w/0"]
            view, _ = board.newest("w/0")
            assert board.holds("w/0", blk.version)
            assert np.array_equal(np.frombuffer(view, np.float32), gpu.to_host(blk.value))
        assert max(sizes[0]) >= n * 4                     # the first batch made its slots
        assert max(max(s) for s in sizes[1:]) <= 8        # later ones: nothing but 0-d sums
        ptr = np.frombuffer(board.arenas[0].seg.view, np.uint8).ctypes.data
        assert ptr in {p for p, _ in fake_cuda.STATE.registered}
        assert gpu.io.stats["uploads_staged"] == 3 * len(chains)
        assert fake_cuda.STATE.pinned_allocs == len(chains)     # staging slots: made once
        got, want = (sc.backend.to_host(sc.store.blocks["w/0"].value) for sc in cores)
        assert np.array_equal(got, want)
    finally:
        cores[0].publisher.board = None
        gpu.pins.unpin(board.arenas[0].seg.view)
        board.close()
        gpu.close()
    assert fake_cuda.STATE.registered == []


def test_cupy_shards_pin_the_rings_they_read_and_copy_from_them_unstaged(gpu, make_cluster):
    """Raw pushes through clients' shared-memory rings: each shard pins every ring segment it
    maps (read-only) and uploads from it without staging; all of it unpinned once the
    cluster stopped. Known answer: w0 - 8 * lr * g."""
    cluster = make_cluster(1, processes=False)
    w0, g = np.zeros(4096, np.float32), np.full(4096, 0.5, np.float32)
    with gradbus.connect(cluster.url) as c:
        assert c.shm is not None
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=0.25))
        for _ in range(8):
            c.push({"w": g}, codec="raw")
        c.flush()
        got = c.pull(["w"], min_version=8)["w"]
        be = next(iter(cluster.shard_servers.values())).core.backend
        assert be.io.stats["uploads_pinned"] == 8 and be.io.stats["uploads_staged"] == 0
        assert be.pins.stats["pinned"] >= 2                  # a ring, the board (+ slots)
    assert np.array_equal(got, w0 - 8 * 0.25 * 0.5)
    cluster.stop()
    assert fake_cuda.STATE.registered == []


def test_a_cuda_backend_in_a_forked_child_refuses_its_first_batch(gpu, monkeypatch):
    """A CUDA context does not survive a fork: a backend used in a forked child (the at-fork
    hook marks it) fails clearly at its next batch, not inside the driver."""
    from gradbus.shards import transfers
    gpu.begin_batch()
    monkeypatch.setattr(transfers, "_forked", True)
    with pytest.raises(RuntimeError, match="forked process: shards are spawned"):
        gpu.begin_batch()
