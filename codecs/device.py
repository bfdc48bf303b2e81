"""Gradient encoding where the gradient lives: a CuPy array is selected (top-k / random-k) and
cast (fp16 / bf16) on the GPU, and only the compressed sections cross to the host, where the
frame is assembled exactly as :func:`gradbus.codecs.tensor.encode` builds it (so receivers see
no difference).

Every step is written against an array module ``xp`` (``cupy`` for device arrays, ``numpy``
otherwise), so the same code runs, and is tested, on the CPU. Chains whose value coder is
``int8`` or ``sign`` are not done on the device: :func:`encode` copies such a gradient to the
host and uses the host codec (the caller can see this in ``device_fallbacks``).
"""
from __future__ import annotations

import math

import numpy as np

from . import tensor as tcodec
from .errors import Code, WireError

DEVICE_CODERS = ("raw", "fp16", "bf16")
device_fallbacks = 0     # gradients copied to the host whole because their chain is not done here


def array_module(a):
    """``cupy`` for a CuPy array, else ``numpy``."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def is_device(a) -> bool:
    return array_module(a) is not np


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
    if st.sparse:
        seed = int((rng or np.random.default_rng()).integers(1 << 62))
        idx = _select(xp, flat, st, seed)
        values = flat[idx]
        host_idx = to_host(idx)
        index_bytes = tcodec._varint_encode(host_idx)
        prefix = [np.array([len(host_idx), len(index_bytes)], "<u8"), index_bytes]
    else:
        values = flat
    if st.coder == "raw":
        coded = values
    elif st.coder == "fp16":
        coded = _fp16_bits(xp, values)
    else:
        coded = _bf16_bits(xp, values.astype(xp.float32) if dt != np.float32 else values)
    host_values = np.ascontiguousarray(to_host(coded))       # the only bulk copy to the host
    applied, buf = tcodec.assemble(st, prefix, [host_values])
    if not want_decoded:
        return applied, buf
    dec = values if st.coder == "raw" else _decode_bits(xp, coded, st.coder, dt)
    if st.sparse:
        dense = xp.zeros(flat.size, dt)
        dense[idx] = dec
        dec = dense
    return applied, buf, dec.reshape(shape)
