"""Encoding a gradient where it lives: the device path (codecs/device.py) runs on the CPU here
through an array-module stand-in, and must produce the host codec's frames bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

import gradbus
from gradbus.codecs import device, tensor

from .rigs import DETERMINISTIC, device_gradient


class _NumpyAsDevice:
    """An array module that is not numpy (so the device branch runs) but computes with it."""

    def __getattr__(self, name):
        return getattr(np, name)


XP = _NumpyAsDevice()


class Dev(np.ndarray):
    """A 'device' array for the CPU tests."""


@pytest.fixture
def fake_device(monkeypatch):
    real = device.array_module
    monkeypatch.setattr(device, "array_module",
                        lambda a: XP if isinstance(a, Dev) else real(a))
    host_calls = []
    encode = tensor.encode

    def spy(arr, *a, **kw):
        host_calls.append(np.asarray(arr).size)
        return encode(arr, *a, **kw)
    monkeypatch.setattr(device.tcodec, "encode", spy)
    return host_calls


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", DETERMINISTIC)
def test_device_path_frames_equal_the_host_codec(chain, dtype):
    x = device_gradient(dtype=dtype)
    a1, b1, d1 = tensor.encode(x, chain, want_decoded=True)
    a2, b2, d2 = device.encode(x, chain, want_decoded=True, xp=XP)
    assert a1 == a2 and bytes(memoryview(b1)) == bytes(memoryview(b2))
    assert np.array_equal(d1, d2, equal_nan=True) and d2.dtype == dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", ["sign", "topk:0.05|sign", "sign|zstd"])
def test_sign_on_the_device_gives_the_host_frames(chain, dtype):
    x = device_gradient(dtype=dtype)
    x[4000:] = np.random.default_rng(2).standard_normal(1000)   # blocks without inf or NaN
    a1, b1, d1 = tensor.encode(x, chain, want_decoded=True)
    a2, b2, d2 = device.encode(x, chain, want_decoded=True, xp=XP)
    assert a1 == a2 and bytes(memoryview(b1)) == bytes(memoryview(b2))
    assert np.array_equal(d1, d2, equal_nan=True) and d2.dtype == dtype


@pytest.mark.parametrize("chain", ["int8", "topk:0.1|int8", "int8|zstd"])
def test_int8_on_the_device_has_the_host_scales_and_rounds_without_bias(chain):
    """int8 rounds stochastically: the device draws other noise than the host, so its frame
    differs, but it decodes (with the host decoder) to what it says it sent, its scales are the
    host's, every code is the host's or one off, and its rounding is unbiased."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(3000) * np.exp(rng.uniform(-5, 5, 3000))).astype(np.float32)
    x[[7, 900]] = np.nan, np.inf
    applied, buf, dec = device.encode(x, chain, want_decoded=True, xp=XP,
                                      rng=np.random.default_rng(0))
    got = tensor.decode(buf, applied, "float32", x.shape, 1 << 30)
    assert applied == tensor.encode(x, chain)[0]
    assert np.array_equal(got, dec, equal_nan=True)
    if chain == "int8":
        host = tensor.encode(x, "int8")[1]
        ns = -(-x.size // tensor.INT8_BLOCK)
        dev_b, host_b = bytes(memoryview(buf)), bytes(memoryview(host))
        assert dev_b[:4 * ns] == host_b[:4 * ns]                 # the same scales
        dc = np.frombuffer(dev_b[4 * ns:], np.int8).astype(int)
        hc = np.frombuffer(host_b[4 * ns:], np.int8).astype(int)
        assert np.abs(dc - hc).max() <= 1
        y = np.random.default_rng(4).standard_normal(256).astype(np.float32)
        mean = np.mean([device.encode(y, "int8", want_decoded=True, xp=XP,
                                      rng=np.random.default_rng(s))[2] for s in range(400)],
                       axis=0)
        step = np.abs(y).max() / 127
        assert np.abs(mean - y).max() < 0.25 * step            # unbiased, to sampling noise


def test_int8_and_sign_stay_on_the_device(fake_device):
    before = device.device_fallbacks
    x = device_gradient().view(Dev)
    for chain in ("int8", "sign", "topk:0.01|int8|zstd"):
        applied, buf = device.encode(x, chain)
        assert applied.startswith(chain.split("|zstd")[0])
    assert device.device_fallbacks == before
    assert fake_device == []                 # the host codec never saw a whole gradient


@pytest.mark.parametrize("chain", ["raw", "topk:0.1|bf16", "fp16|zstd"])
def test_sdk_pushes_device_gradients_like_host_ones(make_cluster, fake_device, chain):
    """Two clients push the same gradients, one as host arrays, one as 'device' arrays: the
    weights end equal, the error-feedback residuals stay device arrays, and the host codec never
    sees a whole gradient."""
    cluster = make_cluster(1)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(3000).astype(np.float32) for _ in range(6)]
    out = {}
    for name, wrap in (("host", lambda g: g), ("dev", lambda g: g.view(Dev))):
        with gradbus.connect(cluster.url, block_bytes=4096, seed=0) as c:
            c.init({name: np.zeros(3000, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
            fake_device.clear()             # count only this client's pushes' host encodes
            for g in grads:
                c.push({name: wrap(g)}, codec=chain).result(10)
            out[name] = c.pull([name], min_version=len(grads))[name]
            if name == "dev" and tensor.is_lossy(chain):
                assert c._residual and all(isinstance(r, Dev) for r in c._residual.values())
                assert c.compression_stats()["error_feedback_norm"] > 0
    assert np.array_equal(out["host"], out["dev"])
    assert fake_device == []


@pytest.mark.gpu
def test_cupy_gradient_is_encoded_on_the_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("no CUDA device")
    x = device_gradient()
    for chain in DETERMINISTIC:
        a1, b1, d1 = tensor.encode(x, chain, want_decoded=True)
        a2, b2, d2 = device.encode(cupy.asarray(x), chain, want_decoded=True)
        assert a1 == a2 and bytes(memoryview(b1)) == bytes(memoryview(b2)), chain
        assert np.array_equal(d1, cupy.asnumpy(d2), equal_nan=True)
    y = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    for chain in ("sign", "int8", "topk:0.05|int8|zstd"):   # block sums in another order;
        a2, b2, d2 = device.encode(cupy.asarray(y), chain, want_decoded=True)   # other noise
        got = tensor.decode(b2, a2, "float32", y.shape, 1 << 30)
        assert np.array_equal(got, cupy.asnumpy(d2)), chain
        if chain == "sign":
            np.testing.assert_allclose(got, tensor.encode(y, "sign", want_decoded=True)[2],
                                       rtol=1e-6)
