"""Tensor codecs, composed as a chain string such as ``"bf16|zstd"``.

A chain is at most one *precision* stage (``raw``, ``fp16`` or ``bf16``; ``raw`` if none is
named) followed optionally by ``zstd``. Stages apply left to right on encode and right to left on
decode. The encoder returns the chain it actually applied: ``zstd`` is dropped from it when it
would not shrink the frame by at least :data:`ZSTD_MIN_GAIN` (float32 gradients barely compress),
so the receiver never pays to decompress incompressible bytes. The header records the applied
chain; :func:`decode` refuses unknown or inconsistent chains with ``BAD_CODEC``.
"""
from __future__ import annotations

import math

import numpy as np
import zstandard

from .errors import Code, WireError

#: dtypes a tensor frame may declare.
ALLOWED_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64", "uint8"})
#: dtypes a parameter (and so a gradient) may have.
PARAM_DTYPES = frozenset({"float32", "float64"})
PRECISION = ("raw", "fp16", "bf16")
COMPRESSORS = ("zstd",)
ZSTD_LEVEL = 1
ZSTD_MIN_GAIN = 1.10  # keep zstd only if it shrinks the frame at least this much

_cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
_dctx = zstandard.ZstdDecompressor()


def parse_chain(chain: str) -> tuple[str, bool]:
    """Return ``(precision, zstd)`` for a chain string, or raise ``BAD_CODEC``."""
    if not isinstance(chain, str) or len(chain) > 64:
        raise WireError(Code.BAD_CODEC, f"codec chain must be a short string, got {chain!r}")
    parts = [p.strip() for p in chain.split("|")] if chain else ["raw"]
    precision = "raw"
    use_zstd = False
    for i, part in enumerate(parts):
        if part in PRECISION:
            if i != 0:
                raise WireError(Code.BAD_CODEC,
                                f"codec chain {chain!r}: {part!r} must come first")
            precision = part
        elif part in COMPRESSORS:
            if i != len(parts) - 1 or use_zstd:
                raise WireError(Code.BAD_CODEC, f"codec chain {chain!r}: zstd must come last, once")
            use_zstd = True
        else:
            raise WireError(Code.BAD_CODEC, f"unknown codec {part!r} in chain {chain!r}")
    return precision, use_zstd


def _stage_itemsize(precision: str, dtype: np.dtype) -> int:
    return dtype.itemsize if precision == "raw" else 2


def _bf16_encode(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN kept NaN."""
    u = a.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _bf16_decode(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(arr: np.ndarray, chain: str = "raw"):
    """Encode ``arr`` with ``chain``.

    Returns ``(applied_chain, buffer)``. ``buffer`` supports the buffer protocol; for ``raw`` it is
    the array itself (made C-contiguous), which the caller may send with ``copy=False``.
    """
    precision, use_zstd = parse_chain(chain)
    a = np.ascontiguousarray(arr)
    if a.dtype.name not in ALLOWED_DTYPES:
        raise WireError(Code.BAD_DTYPE, f"dtype {a.dtype} is not allowed")
    if not a.dtype.isnative:   # the wire is little-endian native order: '>f4' is converted
        a = a.astype(a.dtype.newbyteorder("="))
    if precision == "raw":
        staged = a
    elif a.dtype.kind != "f":
        raise WireError(Code.BAD_CODEC, f"{precision} applies to floating tensors, not {a.dtype}")
    elif precision == "fp16":
        staged = a.astype(np.float16)
    else:
        staged = _bf16_encode(a.astype(np.float32, copy=False))
    applied = precision
    buf = staged
    if use_zstd and staged.nbytes:
        packed = _cctx.compress(staged.data)
        if len(packed) * ZSTD_MIN_GAIN <= staged.nbytes:
            applied, buf = precision + "|zstd", packed
    return applied, buf


def encoded_len_fixed(chain: str, dtype: str, shape) -> int | None:
    """Exact encoded length for a chain without zstd, else None (variable)."""
    precision, use_zstd = parse_chain(chain)
    if use_zstd:
        return None
    return math.prod(shape) * _stage_itemsize(precision, np.dtype(dtype))


def decode(buf, chain: str, dtype: str, shape, max_bytes: int) -> np.ndarray:
    """Decode one frame to an array of ``dtype`` and ``shape``.

    Validates the chain, the dtype, the decoded size against ``max_bytes`` and the length of
    every stage. Raises :class:`WireError`; never allocates more than ``max_bytes`` plus the
    staged size. The result may be a read-only view of ``buf``.
    """
    precision, use_zstd = parse_chain(chain)
    if dtype not in ALLOWED_DTYPES:
        raise WireError(Code.BAD_DTYPE, f"dtype {dtype!r} is not allowed")
    dt = np.dtype(dtype)
    n = math.prod(shape)
    if n * dt.itemsize > max_bytes:
        raise WireError(Code.TOO_LARGE, f"decoded size {n * dt.itemsize} B above cap {max_bytes} B")
    if precision != "raw" and dt.kind != "f":
        raise WireError(Code.BAD_CODEC, f"{precision} cannot decode to {dtype}")
    staged_len = n * _stage_itemsize(precision, dt)
    if isinstance(buf, (bytes, bytearray)):
        data = buf
    elif isinstance(buf, np.ndarray):
        data = buf.reshape(-1).view(np.uint8)
    else:
        mv = memoryview(buf)
        data = mv.cast("B") if mv.nbytes else b""
    if use_zstd:
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as e:
            raise WireError(Code.BAD_CODEC, f"not a zstd frame: {e}") from None
        if size != staged_len:
            raise WireError(Code.BAD_SHAPE,
                            f"zstd content size {size} does not match shape {list(shape)}")
        try:
            data = _dctx.decompress(data, max_output_size=staged_len)
        except zstandard.ZstdError as e:
            raise WireError(Code.BAD_CODEC, f"corrupt zstd frame: {e}") from None
    if len(data) != staged_len:
        raise WireError(Code.BAD_SHAPE,
                        f"{len(data)} bytes do not match shape {list(shape)} of {dtype} ({chain})")
    if precision == "raw":
        out = np.frombuffer(data, dtype=dt)
    elif precision == "fp16":
        out = np.frombuffer(data, dtype=np.float16).astype(dt)
    else:
        out = _bf16_decode(np.frombuffer(data, dtype=np.uint16))
        if dt != np.float32:
            with np.errstate(over="ignore"):   # bf16 above float16's range decodes to inf
                out = out.astype(dt)
    try:
        return out.reshape(shape)
    except ValueError:
        raise WireError(Code.BAD_SHAPE, f"cannot shape {out.size} elements as {list(shape)}") from None
