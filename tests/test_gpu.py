"""The backend interface: the numpy backend against the optimizer rules and plain numpy here, and
every CuPy kernel against the numpy backend where a GPU is present (``-m gpu``)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from gradbus.shards import backend, optim

from .rigs import (
    NUMPY,
    SPECS,
    backend_steps,
    coded,
    data,
    shard_after_coded_batch,
    steps_beside_numpy,
)

# cupy may contract a*b + c into an FMA: agreement to rounding, not bit for bit
TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-6}, np.float64: {"rtol": 1e-12, "atol": 1e-13}}


# -- the numpy backend, here ---------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", SPECS)
def test_numpy_backend_steps_are_the_rules(name, k):
    w0, grads = data(300, np.float64)
    w = w0.copy()
    st = backend_steps(NUMPY, name, w, grads, k)
    rule = optim.make_rule(SPECS[name])
    rule_w, rule_st = w0.copy(), rule.state(w0.size, w0.dtype)
    for g in grads:
        rule.step(rule_w, g, k, rule_st, np.empty_like(w0))
    np.testing.assert_array_equal(w, rule_w)
    for key, a in st.items():
        np.testing.assert_array_equal(a, rule_st[key])


def test_numpy_scatter_add_accumulates_duplicates():
    dense = np.zeros(10, np.float32)
    NUMPY.scatter_add(dense, np.array([3, 0, 3, 9, 3]), np.array([1, 2, 3, 4, 5], np.float32))
    np.testing.assert_array_equal(dense, [2, 0, 0, 9, 0, 0, 0, 0, 0, 4])
    with pytest.raises(IndexError):
        NUMPY.scatter_add(dense, np.array([10]), np.array([1], np.float32))


def test_numpy_backend_moves_nothing():
    a = np.arange(4.0)
    assert NUMPY.asarray(a) is a and NUMPY.to_host(a) is a and NUMPY.xp is np


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)       # import cupy -> ImportError


def test_load_picks_by_env(monkeypatch, no_cupy):
    for value in (None, "", "auto", "numpy"):
        if value is None:
            monkeypatch.delenv("GRADBUS_BACKEND", raising=False)
        else:
            monkeypatch.setenv("GRADBUS_BACKEND", value)
        assert backend.load().name == "numpy"


def test_cupy_requested_without_cupy_is_a_clear_error(monkeypatch, no_cupy):
    monkeypatch.setenv("GRADBUS_BACKEND", "cupy")
    with pytest.raises(backend.BackendError, match=r"cupy backend needs cupy.*GRADBUS_BACKEND"):
        backend.load()


def test_unknown_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("GRADBUS_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"GRADBUS_BACKEND='bogus': expected one of auto, numpy"):
        backend.load()


# -- CuPy, on a GPU ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    pytest.importorskip("cupy")
    try:
        return backend.CupyBackend()
    except backend.BackendError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_cupy_steps_match_numpy(gpu, name, dtype, k):
    for what, got, want in steps_beside_numpy(gpu, name, 100_003, dtype, k):
        np.testing.assert_allclose(got, want, **TOL[dtype], err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_cupy_summing_step_is_sum_then_step(gpu, name, dtype, count):
    """A list of gradients is summed inside the step's kernel, in list order: the same as
    numpy's sum_into, then the step."""
    w0, grads = data(100_003, dtype, steps=count)
    w = gpu.asarray(w0)
    st = backend_steps(gpu, name, w, [[gpu.asarray(g) for g in grads]], count)
    ref_w = w0.copy()
    ref_st = backend_steps(NUMPY, name, ref_w, [NUMPY.sum_into(np.empty_like(w0), grads)], count)
    np.testing.assert_allclose(gpu.to_host(w), ref_w, **TOL[dtype])
    for key, a in st.items():
        np.testing.assert_allclose(gpu.to_host(a), ref_st[key], **TOL[dtype])
    with pytest.raises(ValueError, match="1 to 8 gradients"):
        backend_steps(gpu, name, w, [[gpu.asarray(grads[0])] * 9], 9)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 5, 8, 19])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_sum_into_matches_numpy(gpu, dtype, count):
    _, grads = data(100_003, dtype, steps=count)
    out = gpu.xp.full(100_003, np.nan, dtype)                 # the first group must overwrite
    gpu.sum_into(out, [gpu.asarray(g) for g in grads])
    np.testing.assert_allclose(gpu.to_host(out), NUMPY.sum_into(np.empty_like(grads[0]), grads),
                               **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_scatter_add_matches_numpy_and_skips_out_of_range(gpu, dtype, index_dtype):
    rng = np.random.default_rng(2)
    dense = rng.standard_normal(1000).astype(dtype)
    indices = rng.integers(0, 1000, 5000).astype(index_dtype)     # many duplicates
    values = rng.standard_normal(5000).astype(dtype)
    expected = dense.copy()
    NUMPY.scatter_add(expected, indices, values)
    got = gpu.asarray(dense)
    gpu.scatter_add(got, gpu.asarray(np.append(indices, [-1, 1000]).astype(index_dtype)),
                    gpu.asarray(np.append(values, [1, 1]).astype(dtype)))
    np.testing.assert_allclose(gpu.to_host(got), expected, **TOL[dtype])


# -- value decoders ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", ["raw", "fp16", "bf16", "int8", "sign", "bf16|shuffle|zstd"])
def test_numpy_decode_values_is_the_host_decoder(chain, dtype):
    arrays, coder, dt, k, want = coded(chain, dtype, 5000 + 77)
    got = NUMPY.decode_values(arrays, coder, dt, k)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 255, 1025, 100_003])          # short last blocks
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", ["raw", "fp16", "bf16", "int8", "sign"])
def test_cupy_decode_values_match_the_host_bit_for_bit(gpu, chain, dtype, n):
    """The device expands the coded bytes to exactly the host's values (NaN where NaN)."""
    arrays, coder, dt, k, want = coded(chain, dtype, max(n, 8))
    got = gpu.decode_values(arrays, coder, dt, k)
    assert isinstance(got, gpu.xp.ndarray) and got.dtype == want.dtype
    got = gpu.to_host(got)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.gpu
def test_shard_on_the_gpu_applies_coded_pushes_as_the_host_does(gpu):
    """A ShardCore on the CuPy backend and one on numpy, fed the same batch, end equal."""
    opt = {"name": "sgd", "lr": 0.1}
    np.testing.assert_allclose(shard_after_coded_batch(gpu, 70_001, opt),
                               shard_after_coded_batch(NUMPY, 70_001, opt), **TOL[np.float32])
