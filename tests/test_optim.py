"""The optimizer steps: chunked numpy against the unchunked closed form, numba against numpy."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from gradbus.codecs import specs
from gradbus.shards import backend, optim

SPECS = {"sgd": specs.SGD(lr=0.1), "momentum": specs.SGD(lr=0.1, momentum=0.9),
         "adam": specs.Adam(lr=0.05, betas=(0.9, 0.99), eps=1e-6),
         "adagrad": specs.Adagrad(lr=0.1, eps=1e-6)}
# 256 B: 64 float32 or 32 float64 elements a chunk, so 1000 elements span many, the last partial
CHUNKED = backend.NumpyBackend(jit=False, chunk_bytes=256)
WHOLE = backend.NumpyBackend(jit=False, chunk_bytes=1 << 30)
TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-6}, np.float64: {"rtol": 1e-12, "atol": 1e-13}}


def closed_form(spec, w, g, k, st):
    """k steps of the mean of g as the closed form states it, on whole float64 arrays."""
    mean = g / k
    if isinstance(spec, specs.Adam):
        (b1, b2), t = spec.betas, st["t"] + k
        st["t"] = t
        st["m"] = b1 ** k * st["m"] + (1 - b1 ** k) * mean
        st["v"] = b2 ** k * st["v"] + (1 - b2 ** k) * mean ** 2
        mhat, vhat = st["m"] / (1 - b1 ** t), st["v"] / (1 - b2 ** t)
        return w - k * spec.lr * mhat / (np.sqrt(vhat) + spec.eps)
    if isinstance(spec, specs.Adagrad):
        h_mid = st["h"] + (k + 1) / 2 * mean ** 2
        st["h"] = st["h"] + k * mean ** 2
        return w - k * spec.lr * mean / (np.sqrt(h_mid) + spec.eps)
    if spec.momentum:
        mu, v = spec.momentum, st["v"]
        velocities = [mu ** i * v + mean * (1 - mu ** i) / (1 - mu) for i in range(1, k + 1)]
        st["v"] = velocities[-1]
        return w - spec.lr * sum(velocities)
    return w - spec.lr * g


def run(be, spec, w, grads, k):
    """Step a copy of ``w`` once per gradient sum in ``grads``; returns (w, state)."""
    w = w.copy()
    rule = optim.make_rule(spec, be)
    st = rule.state(w.size, w.dtype)
    scratch = np.empty_like(w)
    for g in grads:
        rule.step(w, g, k, st, scratch)
    return w, st


def data(n, dtype, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(dtype)
    return w, [rng.standard_normal(n).astype(dtype) for _ in range(steps)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("n", [1, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_chunked_numpy_equals_unchunked_and_the_closed_form(name, dtype, n, k):
    spec, (w0, grads) = SPECS[name], data(n, dtype)
    w, st = run(CHUNKED, spec, w0, grads, k)
    whole_w, whole_st = run(WHOLE, spec, w0, grads, k)
    np.testing.assert_array_equal(w, whole_w)          # elementwise: chunking changes no bit
    for key, a in st.items():
        np.testing.assert_array_equal(a, whole_st[key])
    ref_w, ref_st = w0.astype(np.float64), run(WHOLE, spec, w0.astype(np.float64), [], k)[1]
    for g in grads:
        ref_w = closed_form(spec, ref_w, g.astype(np.float64), k, ref_st)
    np.testing.assert_allclose(w, ref_w, **TOL[dtype])
    for key, a in st.items():
        np.testing.assert_allclose(a, ref_st[key], **TOL[dtype])


def test_batch_of_equal_gradients_is_k_plain_steps():
    """The closed form's guarantees: SGD and momentum exact, Adam exact from a fresh state."""
    w0, (g,) = data(257, np.float64, steps=1)
    for name in ("sgd", "momentum", "adam"):
        batched, _ = run(CHUNKED, SPECS[name], w0, [4 * g], 4)
        single, _ = run(CHUNKED, SPECS[name], w0, [g] * 4, 1)
        np.testing.assert_allclose(batched, single, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("name", SPECS)
def test_numpy_step_allocates_no_block_sized_array(name):
    w, (g,) = data(1 << 16, np.float32, steps=1)
    rule = optim.make_rule(SPECS[name])
    st, scratch = rule.state(w.size, w.dtype), np.empty_like(w)
    rule.step(w, g, 2, st, scratch)
    tracemalloc.start()
    try:
        rule.step(w, g, 2, st, scratch)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < w.nbytes // 8


def test_sum_into_adds_in_order_chunk_by_chunk():
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    out = np.empty(1000, np.float32)
    for k in (1, 2, 5):
        expected = grads[0].copy()
        for g in grads[1:k]:
            expected += g
        np.testing.assert_array_equal(CHUNKED.sum_into(out, grads[:k]), expected)
    with pytest.raises(ValueError, match="does not match"):
        CHUNKED.sum_into(out, [grads[0], grads[1][:10]])
    with pytest.raises(ValueError, match="at least one"):
        CHUNKED.sum_into(out, [])


# -- numba ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jit():
    pytest.importorskip("numba")
    return backend.NumpyBackend(jit=True)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_numba_equals_numpy(jit, name, dtype, k):
    """Bit for bit: one replica may take the numpy path where another takes numba's (a
    gradient frame that is not aligned there, say), and replicas hold identical state."""
    spec, (w0, grads) = SPECS[name], data(1000, dtype)
    w, st = run(jit, spec, w0, grads, k)
    ref_w, ref_st = run(CHUNKED, spec, w0, grads, k)
    np.testing.assert_array_equal(w, ref_w)
    for key, a in st.items():
        np.testing.assert_array_equal(a, ref_st[key])


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", SPECS)
def test_numba_takes_only_contiguous_aligned_arrays(jit, name, k):
    """A strided or unaligned gradient (a large frame read in place at any offset) goes the
    numpy way, with the bits numba's loop gives the same gradient aligned: replicas that got
    it at different offsets stay identical."""
    w0, grads = data(1000, np.float32, steps=3)       # steps from a velocity not zero

    def strided(g):
        return np.repeat(g, 2)[::2]

    def unaligned(g):
        raw = np.zeros(g.nbytes + 1, np.uint8)
        out = np.frombuffer(raw.data, np.float32, g.size, offset=1)
        out.flags.writeable = True
        out[:] = g
        return out
    assert not (strided(grads[0]).flags.c_contiguous or unaligned(grads[0]).flags.aligned)
    expected, expected_st = run(jit, SPECS[name], w0, grads, k)
    for odd in (strided, unaligned):
        got, st = run(jit, SPECS[name], w0, [odd(g) for g in grads], k)
        np.testing.assert_array_equal(got, expected)
        for key, a in st.items():
            np.testing.assert_array_equal(a, expected_st[key])


def test_numba_required_but_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(backend, "_numba_loops", lambda: None)
    with pytest.raises(backend.BackendError, match="numba"):
        backend.NumpyBackend(jit=True)
    assert backend.NumpyBackend().fused is None


def test_gradbus_jit_0_keeps_the_steps_on_numpy(monkeypatch):
    monkeypatch.setenv("GRADBUS_JIT", "0")
    assert backend._numba_loops.__wrapped__() is None


def test_a_numba_that_cannot_compile_leaves_the_chunked_steps(monkeypatch):
    numba = pytest.importorskip("numba")

    def broken(*a, **k):
        raise RuntimeError("cannot cache function: no locator available")
    monkeypatch.setattr(numba, "njit", broken)
    assert backend._numba_loops.__wrapped__() is None
