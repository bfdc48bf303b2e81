"""The value coders of a tensor chain (:mod:`.tensor`): ``fp16`` and ``bf16`` (round to nearest
even, as numba loops where numba imports, numpy otherwise, bit for bit alike), ``int8`` (per block
of :data:`INT8_BLOCK` values a float32 scale, stochastic rounding) and ``sign`` (per block of
:data:`SIGN_BLOCK` values a float32 scale mean(|x|), one bit per value), with the sizes of their
sections. Stateless: the random generator is the caller's."""
from __future__ import annotations

import functools
import math

import numpy as np

from . import jit

INT8_BLOCK = 256      # values per float32 scale for int8
SIGN_BLOCK = 1024     # values per float32 scale for sign
_CHUNK = 1 << 16      # elements per cache-sized chunk in the fp16/bf16/int8 loops


_BLAS_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def all_finite(vals) -> bool:
    """No NaN or Inf in ``vals`` (a numpy or CuPy array): one reduction first, the exact
    check only when its result is not finite (an overflow, or a value that is not). The
    reduction is the sum of squares where BLAS computes it (contiguous
    float32/64 on the host: a third of the time of a sum here), finite only when every value
    is (no square is negative, so no inf - inf hides one); else the sum, finite likewise."""
    if type(vals) is np.ndarray:
        xp = np
    else:
        from .device import array_module  # device imports this module
        xp = array_module(vals)
    if xp is np and vals.dtype in _BLAS_FLOATS and vals.flags.c_contiguous:
        first = np.vdot(vals, vals)
    else:
        with np.errstate(over="ignore", invalid="ignore"):   # an overflow says "look closer"
            first = xp.add.reduce(vals, axis=None)
    return math.isfinite(first) or bool(xp.isfinite(vals).all())


# ------------------------------------------------------------------ fp16 / bf16

_F16_SMALL = np.uint32(0x38800000)            # 2**-14 (smallest normal half), as float32 bits
_F16_BIG = np.uint32(143 << 23)               # 2**16: everything above rounds to inf
_F16_BIAS = np.uint32((0xFFF - 0x38800000) % 2**32)  # rebias; + 0xFFF + last bit = nearest even


def _fp16_encode(a: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half bits (uint16), round to nearest even; bit-equal to numpy's cast
    except that NaN becomes 0x7E00 (with its sign)."""
    return _half_encode(a, "fp16", _fp16_encode_numpy)


def _half_encode(a: np.ndarray, coder: str, numpy_path) -> np.ndarray:
    """float32 ``a`` as fp16 or bf16 codes: numba's loop (:mod:`.jit`) where it imports and
    ``a`` is aligned, else ``numpy_path(a)``; the same bits either way."""
    fast = jit.loops()
    flat = np.ascontiguousarray(a).reshape(-1)
    if fast is None or not flat.flags.aligned:
        return numpy_path(a)
    out = np.empty(len(flat), np.uint16)
    if coder == "fp16":
        fast["fp16"](flat, flat.view(np.uint32), out)
    else:
        fast["bf16"](flat.view(np.uint32), out)
    return out


def _fp16_encode_numpy(a: np.ndarray) -> np.ndarray:
    """Integer ops on cache-sized chunks: numpy's cast is several times slower on gradients,
    whose small values are half subnormals."""
    flat = a.reshape(-1)
    u = flat.view(np.uint32)
    out = np.empty(len(u), np.uint16)
    m = min(len(u), _CHUNK)
    ua, t, s = np.empty(m, np.uint32), np.empty(m, np.uint32), np.empty(m, np.uint32)
    nan = np.empty(m, bool)
    for i in range(0, len(u), _CHUNK):
        uc = u[i:i + _CHUNK]
        n = len(uc)
        uac, tc, sc, nc = ua[:n], t[:n], s[:n], nan[:n]
        np.bitwise_and(uc, 0x7FFFFFFF, out=uac)
        # subnormal part: |x| below 2**-14 plus 0.5 puts the half's last bit at float32's last
        # bit, so the float add rounds it; low bits = half subnormal bits (0x400 above the range)
        np.minimum(uac, _F16_SMALL, out=sc)
        sf = sc.view(np.float32)
        np.add(sf, np.float32(0.5), out=sf)
        # normal part, on |x| clipped to [2**-14, 2**16]: rebias, round to nearest even at bit 13
        np.clip(uac, _F16_SMALL, _F16_BIG, out=uac)
        np.right_shift(uac, 13, out=tc)
        np.bitwise_and(tc, 1, out=tc)
        np.add(tc, uac, out=tc)
        np.add(tc, _F16_BIAS, out=tc)
        np.right_shift(tc, 13, out=tc)
        np.add(tc, sc, out=tc)          # bits above 15 (0x3F000000 from the 0.5) are cut below
        np.right_shift(uc, 16, out=sc)
        np.bitwise_and(sc, 0x8000, out=sc)
        np.bitwise_or(tc, sc, out=tc)
        oc = out[i:i + _CHUNK]
        np.copyto(oc, tc, casting="unsafe")
        np.isnan(flat[i:i + _CHUNK], out=nc)
        if nc.any():
            oc[nc] |= 0x0200            # NaN came out as inf
    return out


@functools.cache
def _half_table(dt: np.dtype) -> np.ndarray:
    """Every half bit pattern's value as ``dt`` (read-only: one table shared by every thread)."""
    table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(dt)
    table.flags.writeable = False
    return table


def _fp16_decode(bits: np.ndarray, dt: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Half bits -> ``dt`` (a table lookup: faster than numpy's cast, exact), into ``out``
    when given."""
    if out is None:
        out = np.empty(len(bits), dt)
    if dt == np.float16:
        np.copyto(out, bits.view(np.float16))
        return out
    table = _half_table(dt)
    for i in range(0, len(bits), _CHUNK):
        np.take(table, bits[i:i + _CHUNK], out=out[i:i + _CHUNK])
    return out


def _bf16_encode(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN -> 0x7FC0."""
    return _half_encode(a, "bf16", _bf16_encode_numpy)


@functools.cache
def _bf16_dtype() -> np.dtype:
    """ml_dtypes' bfloat16, imported at the first use: its import takes most of a second,
    which every broker, shard and client process would pay at start."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def _bf16_encode_numpy(a: np.ndarray) -> np.ndarray:
    bf16 = _bf16_dtype()
    flat = a.reshape(-1)
    out = np.empty(len(flat), np.uint16)
    # ml_dtypes' cast: bit for bit the (u + 0x7FFF + lsb) >> 16 rule, several times faster than
    # it in numpy steps; by cache-sized chunks, so the NaN check reads values still in cache
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, len(flat), _CHUNK):
            x, o = flat[i:i + _CHUNK], out[i:i + _CHUNK]
            np.copyto(o.view(bf16), x, casting="unsafe")
            if not all_finite(x):
                nan = np.isnan(x)
                if nan.any():
                    o[nan] = 0x7FC0           # one NaN, whatever the sign and payload
    return out


def _bf16_decode(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits -> float32, into ``out`` (float32) when given."""
    wide = np.empty(len(bits), np.uint32) if out is None else out.view(np.uint32)
    np.left_shift(bits, 16, out=wide, dtype=np.uint32)
    return wide.view(np.float32)


# ------------------------------------------------------------------ int8 / sign


def _block_reduce(fn, x: np.ndarray, block: int, xp=np, **kw) -> np.ndarray:
    """``fn`` over each block of ``block`` values of 1-D ``x`` (the last block may be short);
    ``xp`` is the array module of ``x`` (numpy, or CuPy for the device encoder)."""
    m = x.size // block * block
    body = fn(x[:m].reshape(-1, block), axis=1, **kw)
    return body if m == x.size else xp.concatenate([body, fn(x[m:], **kw).reshape(1)])


def _blockwise(ufunc, x: np.ndarray, s: np.ndarray, out: np.ndarray, block: int) -> None:
    """``out[i] = ufunc(x[i], s[i // block])``, computed in float32, for 1-D ``x`` and ``out``."""
    m = len(x) // block * block
    ufunc(x[:m].reshape(-1, block), s[:m // block, None], out=out[:m].reshape(-1, block),
          dtype=np.float32)
    if m < len(x):
        ufunc(x[m:], s[m // block], out=out[m:], dtype=np.float32)


def int8_scales(x, xp=np):
    """The int8 blocks of float32 values ``x`` (of array module ``xp``): ``(scale, divisor,
    finite)`` per block. ``scale`` is absmax/127, NaN for a block holding NaN or inf (its codes
    are 0, so it decodes NaN); ``divisor`` is what the values are divided by (1 for an all-zero
    or non-finite block)."""
    absmax = xp.abs(xp.maximum(_block_reduce(xp.max, x, INT8_BLOCK, xp),   # abs: -0.0 -> 0.0
                               -_block_reduce(xp.min, x, INT8_BLOCK, xp)))
    finite = xp.isfinite(absmax)
    nonzero = absmax > 0
    scale = (absmax / xp.float32(127)).astype(xp.float32)
    # a non-zero block never gets a zero scale (|x| < 127 * 2**-149 would underflow), nor one
    # rounded below absmax/127 (subnormal scales have few bits: 127 codes must reach absmax)
    scale = xp.where(nonzero, xp.maximum(scale, xp.float32(2.0**-149)), scale)
    short = finite & (scale < xp.float32(2.0**-126)) & (scale.astype(xp.float64) * 127 < absmax)
    scale = xp.where(short, xp.nextafter(scale, xp.float32(np.inf)), scale).astype(xp.float32)
    divisor = xp.where(finite & nonzero, scale, xp.float32(1)).astype(xp.float32)
    return xp.where(finite, scale, xp.float32(np.nan)).astype(xp.float32), divisor, finite


def _int8_encode(x: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """float32 values -> [float32 scale per block, int8 codes], stochastic rounding."""
    scale, divisor, finite = int8_scales(x)
    if not finite.all():                # NaN or inf: codes 0, scale NaN, so the block decodes NaN
        x = np.where(np.repeat(~finite, INT8_BLOCK)[:len(x)], np.float32(0), x)
    codes = np.empty(len(x), np.int8)
    work = np.empty(min(len(x), _CHUNK), np.float32)
    noise = np.empty_like(work)
    for i in range(0, len(x), _CHUNK):  # _CHUNK is a multiple of INT8_BLOCK
        xc = x[i:i + _CHUNK]
        w, u = work[:len(xc)], noise[:len(xc)]
        _blockwise(np.divide, xc, divisor[i // INT8_BLOCK:], w, INT8_BLOCK)
        # u = (r + 1/2) / 2**16 for 16 random bits r: floor(y + u) rounds y up with probability
        # frac(y) to within 2**-17, the spacing float32 itself gives y + u near 127
        r = rng.bit_generator.random_raw(-(-len(xc) // 4)).view(np.uint16)[:len(xc)]
        np.multiply(r, np.float32(2.0**-16), out=u)
        u += np.float32(2.0**-17)
        w += u
        np.floor(w, out=w)
        np.clip(w, -127, 127, out=w)
        codes[i:i + len(xc)] = w
    return [scale, codes]


def sign_encode(x, xp=np) -> list:
    """float32 values (of array module ``xp``) -> [float32 mean |x| per block, sign bits
    packed 8 per byte]."""
    m = x.size // SIGN_BLOCK * SIGN_BLOCK
    sums = _block_reduce(xp.sum, xp.abs(x), SIGN_BLOCK, xp, dtype=xp.float64)
    sums[:m // SIGN_BLOCK] /= SIGN_BLOCK
    if m < x.size:
        sums[-1] /= x.size - m
    with np.errstate(over="ignore"):
        scale = sums.astype(xp.float32)
    return [scale, xp.packbits(xp.signbit(x))]


# ------------------------------------------------------------------ value coders


def _value_sections(coder: str, dt: np.dtype, k: int) -> list[tuple[np.dtype, int]]:
    """(dtype, count) of each array that codes ``k`` values of ``dt``, in payload order."""
    if coder == "raw":
        return [(dt, k)]
    if coder in ("fp16", "bf16"):
        return [(np.dtype(np.uint16), k)]
    block = INT8_BLOCK if coder == "int8" else SIGN_BLOCK
    scales = (np.dtype(np.float32), -(-k // block))
    if coder == "int8":
        return [scales, (np.dtype(np.int8), k)]
    return [scales, (np.dtype(np.uint8), -(-k // 8))]


def _values_len(coder: str, dt: np.dtype, k: int) -> int:
    return sum(sdt.itemsize * count for sdt, count in _value_sections(coder, dt, k))


def _as_float32(v: np.ndarray) -> np.ndarray:
    # float64 beyond float32's range becomes inf; a signalling NaN becomes a quiet one
    with np.errstate(over="ignore", invalid="ignore"):
        return v.astype(np.float32, copy=False)


def _encode_values(v: np.ndarray, coder: str, rng: np.random.Generator) -> list[np.ndarray]:
    """The arrays (see :func:`_value_sections`) coding the 1-D values ``v``."""
    if coder == "raw":
        return [v]
    if coder == "fp16":
        if v.dtype == np.float32:
            return [_fp16_encode(v)]
        with np.errstate(over="ignore", invalid="ignore"):  # beyond half's range: inf
            return [v.astype(np.float16).view(np.uint16)]
    x = _as_float32(v)
    if coder == "bf16":
        return [_bf16_encode(x)]
    if coder == "int8":
        return _int8_encode(x, rng)
    return sign_encode(x)


def decode_values(arrays: list[np.ndarray], coder: str, dt: np.dtype, k: int) -> np.ndarray:
    """The ``k`` values of ``dt`` that ``arrays`` (from :func:`_encode_values`) stand for."""
    if coder == "raw":
        return arrays[0]
    if coder == "fp16":
        return _fp16_decode(arrays[0], dt)
    with np.errstate(over="ignore", invalid="ignore"):  # inf * 0, and casts beyond float16
        if coder == "bf16":
            out = _bf16_decode(arrays[0])
            return out if dt == np.float32 else out.astype(dt)
        out = np.empty(k, dt)
        if coder == "int8":
            _blockwise(np.multiply, arrays[1], arrays[0], out, INT8_BLOCK)
        else:
            signs = np.unpackbits(arrays[1], count=k).view(np.int8)
            signs *= -2
            signs += 1
            _blockwise(np.multiply, signs, arrays[0], out, SIGN_BLOCK)
    return out
