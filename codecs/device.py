"""Gradient encoding where the gradient lives: a CuPy array is selected (top-k / random-k) and
cast (fp16 / bf16) on the GPU, and only the compressed sections cross to the host, where the
frame is assembled exactly as :func:`gradbus.codecs.tensor.encode` builds it (so receivers see
no difference).

Every step is written against an array module ``xp`` (``cupy`` for device arrays, ``numpy``
otherwise), so the same code runs, and is tested, on the CPU. Every value coder runs on the
device: raw, fp16 and bf16 give the host codec's bytes exactly, sign too (the same float64 block
sums), and int8 the same scales with its stochastic rounding drawn on the device (the same
16-bit noise distribution as the host's, other draws).
"""
from __future__ import annotations

import math
import threading

import numpy as np

from . import tensor as tcodec
from .errors import Code, WireError

DEVICE_CODERS = ("raw", "fp16", "bf16", "int8", "sign")
device_fallbacks = 0     # gradients copied to the host whole because their chain is not done here
_fallbacks_lock = threading.Lock()   # ``+=`` on a global is not atomic between threads


def array_module(a):
    """``cupy`` for a CuPy array, else ``numpy``."""
    if type(a) is np.ndarray:
        return np
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def is_device(a) -> bool:
    return type(a) is not np.ndarray and array_module(a) is not np


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and is_device(a) else np.asarray(a)


def _fp16_bits(xp, v):
    """IEEE half bits, round to nearest even (a cast; NaN keeps its sign, quiet)."""
    with np.errstate(over="ignore", invalid="ignore"):   # beyond half's range: inf
        bits = v.astype(xp.float16).view(xp.uint16)
    nan = xp.isnan(v)
    return xp.where(nan, (bits & 0x8000) | 0x7E00, bits).astype(xp.uint16)


def _bf16_bits(xp, v):
    """bfloat16 bits of float32 values, round to nearest even, NaN -> 0x7FC0 (as the host)."""
    u = v.view(xp.uint32)
    t = ((u >> 16) & 1) + 0x7FFF + u
    bits = (t >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(v), xp.uint16(0x7FC0), bits)


def _decode_bits(xp, bits, coder: str, dt):
    if coder == "fp16":
        return bits.view(xp.float16).astype(dt)
    out = (bits.astype(xp.uint32) << 16).view(xp.float32)
    return out if dt == np.float32 else out.astype(dt)


def _per_block(xp, scale, n: int, block: int):
    """Each element's block value: ``scale[i // block]`` for i < n."""
    return xp.repeat(scale, block)[:n]


def _int8_sections(xp, x, seed: int):
    """[float32 scale per block, int8 codes]: the host's scales (:func:`tcodec.int8_scales`),
    codes by stochastic rounding with noise drawn on the device."""
    B = tcodec.INT8_BLOCK
    scale, divisor, finite = tcodec.int8_scales(x, xp)
    ok = _per_block(xp, finite, x.size, B)
    w = xp.where(ok, x, xp.float32(0)) / _per_block(xp, divisor, x.size, B)
    # the host's noise: u = (r + 1/2) / 2**16 for 16 uniform random bits r
    r = xp.floor(xp.random.RandomState(seed).random_sample(x.size) * 65536)
    u = ((r + 0.5) * 2.0**-16).astype(xp.float32)
    codes = xp.clip(xp.floor((w + u).astype(xp.float32)), -127, 127).astype(xp.int8)
    return [scale, codes]


def _decode_blocks(xp, coder: str, sections, n: int, dt):
    """What the host decoder gives for int8 or sign sections."""
    if coder == "int8":
        block, vals = tcodec.INT8_BLOCK, sections[1].astype(xp.float32)
    else:
        block = tcodec.SIGN_BLOCK
        vals = xp.where(xp.unpackbits(sections[1])[:n].astype(bool), xp.float32(-1),
                        xp.float32(1))
    with np.errstate(over="ignore", invalid="ignore"):
        out = (vals * _per_block(xp, sections[0], n, block)).astype(xp.float32)
    return out if dt == np.float32 else out.astype(dt)


def _select(xp, flat, st, rng_seed: int):
    n = flat.size
    k = math.ceil(st.fraction * n)
    if k == 0:
        return xp.empty(0, xp.int64)
    if st.sparsifier == "randomk":
        idx = xp.random.default_rng(rng_seed).permutation(n)[:k] if xp is not np else \
            np.random.default_rng(rng_seed).choice(n, k, replace=False, shuffle=False)
    else:
        mag = xp.abs(flat)
        mag = xp.where(xp.isnan(mag), xp.inf, mag)            # NaN counts as largest
        idx = xp.argpartition(mag, n - k)[n - k:]
    return xp.sort(idx.astype(xp.int64))


def encode(arr, chain: str = "raw", rng: np.random.Generator | None = None,
           want_decoded: bool = False, xp=None):
    """Like :func:`gradbus.codecs.tensor.encode` for an array of any array module; returns
    ``(applied, host buffer[, decoded in arr's module])``. Value coders int8 and sign fall back
    to the host codec."""
    global device_fallbacks
    xp = xp or array_module(arr)
    st = tcodec.parse_stages(chain)
    if xp is np or st.coder not in DEVICE_CODERS:
        if xp is not np:
            with _fallbacks_lock:
                device_fallbacks += 1
        out = tcodec.encode(to_host(arr), chain, rng=rng, want_decoded=want_decoded)
        if want_decoded and xp is not np:
            return out[0], out[1], xp.asarray(out[2])
        return out
    dt = np.dtype(arr.dtype.name)
    if dt.name not in tcodec.PARAM_DTYPES:
        raise WireError(Code.BAD_DTYPE, f"device encoding takes float32 or float64, not {dt}")
    shape = arr.shape
    flat = xp.ascontiguousarray(arr).reshape(-1)
    prefix, idx = [], None
    seed = (int((rng or np.random.default_rng()).integers(1 << 31))
            if st.sparse or st.coder == "int8" else 0)
    if st.sparse:
        idx = _select(xp, flat, st, seed)
        values = flat[idx]
        host_idx = to_host(idx)
        index_bytes = tcodec._varint_encode(host_idx)
        prefix = [np.array([len(host_idx), len(index_bytes)], "<u8"), index_bytes]
    else:
        values = flat
    if st.coder in ("int8", "sign"):
        with np.errstate(over="ignore", invalid="ignore"):   # float64 beyond float32: inf
            v32 = values.astype(xp.float32)
        coded = (_int8_sections(xp, v32, seed) if st.coder == "int8"
                 else tcodec.sign_encode(v32, xp))
    elif st.coder == "raw":
        coded = [values]
    elif st.coder == "fp16":
        coded = [_fp16_bits(xp, values)]
    else:
        coded = [_bf16_bits(xp, values.astype(xp.float32) if dt != np.float32 else values)]
    # the only bulk copies to the host: the coded sections
    applied, buf = tcodec.assemble(st, prefix, [np.ascontiguousarray(to_host(c)) for c in coded])
    if not want_decoded:
        return applied, buf
    if st.coder in ("int8", "sign"):
        dec = _decode_blocks(xp, st.coder, coded, values.size, dt)
    else:
        dec = values if st.coder == "raw" else _decode_bits(xp, coded[0], st.coder, dt)
    if st.sparse:
        dense = xp.zeros(flat.size, dt)
        dense[idx] = dec
        dec = dense
    return applied, buf, dec.reshape(shape)
