"""Tensor codecs, composed as a chain string such as ``"bf16|zstd"`` or ``"topk:0.01|int8|zstd"``.

A chain names, left to right, each stage at most once and in this order::

    [topk:F | randomk:F]  [raw | fp16 | bf16 | int8 | sign]  [shuffle]  [zstd]

* Sparsifier (optional, floating tensors): ``topk:F`` keeps the ceil(F*n) entries of largest
  magnitude (NaN counts as largest), ``randomk:F`` a uniformly random subset of that size,
  0 < F <= 1. The payload then starts with two little-endian uint64 (kept count k, bytes of the
  index section), then the sorted indices as LEB128 varints of their gaps (``i0``,
  ``i1 - i0 - 1``, ...), then the k kept values through the value coder.
* Value coder (``raw`` if none is named): ``raw``; ``fp16`` (IEEE half) and ``bf16`` (bfloat16),
  both rounding to nearest even; ``int8``: per block of :data:`INT8_BLOCK` values a float32 scale
  absmax/127, then one int8 per value rounded stochastically (unbiased); ``sign``: per block of
  :data:`SIGN_BLOCK` values a float32 scale mean(|x|), then one sign bit per value (np.packbits
  order), decoding to +-scale. int8 and sign send all scales, then all codes. A block holding
  NaN or inf decodes to NaN (int8) or to +-inf/NaN (sign), so non-finite gradients stay visible.
* ``shuffle`` byte-transposes each multi-byte array of the value section (values, scales) so that
  zstd sees runs of similar bytes; indices and one-byte codes are left as they are.
* ``zstd`` compresses the whole payload.

The encoder returns the chain it actually applied: ``zstd`` is dropped when it would not shrink
the payload by at least :data:`ZSTD_MIN_GAIN` (and ``shuffle`` with it), and the value coder is
always named. The header records the applied chain; the receiver decodes with it, and
:func:`decode` refuses unknown or inconsistent chains with ``BAD_CODEC``.
"""
from __future__ import annotations

import functools
import math
import re
import threading
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import zstandard

from . import jit
from .errors import Code, WireError
from .values import (  # noqa: F401 - INT8_BLOCK, SIGN_BLOCK and the coders are this module's API too
    INT8_BLOCK,
    SIGN_BLOCK,
    _bf16_decode,
    _encode_values,
    _fp16_decode,
    _half_table,
    _value_sections,
    _values_len,
    decode_values,
    int8_scales,
    sign_encode,
)

#: dtypes a tensor frame may declare.
ALLOWED_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64", "uint8"})
#: the dtype objects of the allowed names, and their names (``dtype.name`` is slow to compute)
DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_NAMES = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dt: np.dtype) -> str:
    """``dt.name``, from a table for the allowed dtypes."""
    name = _NAMES.get(dt)
    return name if name is not None else dt.name
#: dtypes a parameter (and so a gradient) may have.
PARAM_DTYPES = frozenset({"float32", "float64"})
SPARSIFIERS = ("topk", "randomk")
PRECISION = ("raw", "fp16", "bf16", "int8", "sign")  # the value coders
COMPRESSORS = ("zstd",)
ZSTD_LEVEL = 1
ZSTD_MIN_GAIN = 1.10  # keep zstd only if it shrinks the frame at least this much
MAX_SPARSE_ELEMENTS = 2**31  # sparsifiers take tensors of fewer elements than this
MAX_CHAIN_CHARS = 64

_RANK = {"topk": 0, "randomk": 0, **{c: 1 for c in PRECISION}, "shuffle": 2, "zstd": 3}
_FRACTION = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,3})?")
_SPARSE_HEAD = 16     # uint64 count, uint64 index-section bytes
_TOPK_SAMPLE = 1 << 16  # sample size for topk's candidate threshold


class _PerThread(threading.local):
    """What each thread needs its own of: a zstd context may not be used by two threads at
    once (libzstd's contexts carry the state of the frame in progress), and a shared default
    generator would serialise every thread's draws on its lock. Made once per thread, on the
    thread's first use."""

    def __init__(self):
        self.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.dctx = zstandard.ZstdDecompressor()
        self.rng = np.random.default_rng()


_local = _PerThread()


# ------------------------------------------------------------------ chain grammar


@dataclass(frozen=True, slots=True)
class Stages:
    """A parsed codec chain."""

    sparse: str | None         # the sparsifier stage as written ("topk:0.01"), or None
    fraction: Fraction | None  # its F
    coder: str                 # value coder
    shuffle: bool
    zstd: bool

    @property
    def sparsifier(self) -> str | None:
        return self.sparse.partition(":")[0] if self.sparse else None

    @property
    def plain(self) -> bool:
        """Just ``raw``: the frame is the array's bytes."""
        return self.sparse is None and self.coder == "raw" and not self.shuffle and not self.zstd

    @property
    def lossy(self) -> bool:
        return self.sparse is not None or self.coder != "raw"

    def text(self, shuffle: bool, zstd: bool) -> str:
        """The chain string of these stages with ``shuffle`` and ``zstd`` as given."""
        parts = [self.sparse] if self.sparse else []
        parts.append(self.coder)
        if shuffle:
            parts.append("shuffle")
        if zstd:
            parts.append("zstd")
        return "|".join(parts)


def parse_stages(chain: str) -> Stages:
    """Parse a chain string into :class:`Stages`, or raise ``BAD_CODEC``."""
    if not isinstance(chain, str) or len(chain) > MAX_CHAIN_CHARS:
        raise WireError(Code.BAD_CODEC, f"codec chain must be a short string, got {chain!r}")
    return _parse(chain)


@functools.lru_cache(maxsize=256)
def _parse(chain: str) -> Stages:
    sparse = fraction = None
    coder = "raw"
    shuffle = use_zstd = False
    last = -1
    for part in [p.strip() for p in chain.split("|")] if chain else ["raw"]:
        name, colon, arg = part.partition(":")
        rank = _RANK.get(name)
        if rank is None or (colon and rank != 0):
            raise WireError(Code.BAD_CODEC, f"unknown codec {part!r} in chain {chain!r}")
        if rank <= last:
            raise WireError(Code.BAD_CODEC,
                            f"codec chain {chain!r}: {part!r} is out of order or repeated (order: "
                            f"topk:F|randomk:F, then one of {'|'.join(PRECISION)}, then shuffle, "
                            f"then zstd)")
        last = rank
        if rank == 0:
            if not _FRACTION.fullmatch(arg) or not 0 < Fraction(arg) <= 1:
                raise WireError(Code.BAD_CODEC,
                                f"codec chain {chain!r}: {name} needs a fraction 0 < F <= 1, "
                                f"got {part!r}")
            sparse, fraction = part, Fraction(arg)
        elif rank == 1:
            coder = name
        elif rank == 2:
            shuffle = True
        else:
            use_zstd = True
    return Stages(sparse, fraction, coder, shuffle, use_zstd)


def parse_chain(chain: str) -> tuple[str, bool]:
    """Return ``(value coder, zstd)`` for a chain string, or raise ``BAD_CODEC``.

    See :func:`parse_stages` for every stage.
    """
    st = parse_stages(chain)
    return st.coder, st.zstd


def is_lossy(chain: str) -> bool:
    """Whether decode(encode(x)) may differ from x: any sparsifier or a coder other than raw."""
    return parse_stages(chain).lossy


def drops_more_than_rounding(chain: str) -> bool:
    """Whether ``chain`` loses more than bf16's rounding: a sparsifier, int8, sign, or fp16
    (whose range ends at 65504 and whose smallest step is 2**-24). bf16 alone keeps float32's
    range and rounds each value to nearest (relative error at most 2**-9), what error feedback
    is not needed for by default."""
    st = parse_stages(chain)
    return st.lossy and not (st.sparse is None and st.coder == "bf16")


# ------------------------------------------------------------------ indices, shuffle


def _varint_width(n: int) -> int:
    """LEB128 bytes of the largest gap in a tensor of ``n`` elements."""
    return max(1, -(-max(n - 1, 0).bit_length() // 7))


def _varint_encode(idx: np.ndarray) -> np.ndarray:
    """Sorted distinct int64 indices -> LEB128 varints of the gaps ``i0, i1 - i0 - 1, ...``."""
    gaps = np.diff(idx, prepend=-1)
    gaps -= 1
    size = np.ones(len(gaps), np.int64)
    top = int(gaps.max()) if len(gaps) else 0
    width = 1
    while top >> (7 * width):
        size += gaps >= 1 << (7 * width)
        width += 1
    starts = np.cumsum(size) - size
    out = np.empty(int(size.sum()), np.uint8)
    for j in range(width if len(gaps) else 0):
        sel = np.flatnonzero(size > j)
        out[starts[sel] + j] = ((gaps[sel] >> (7 * j)) & 0x7F) | ((size[sel] > j + 1) << 7)
    return out


def _varint_decode(b: np.ndarray, k: int, n: int) -> np.ndarray:
    """Inverse of :func:`_varint_encode` for ``k`` indices below ``n``, or ``BAD_CODEC``."""
    ends = np.flatnonzero(b < 0x80)
    if len(ends) != k or len(b) != (int(ends[-1]) + 1 if k else 0):
        raise WireError(Code.BAD_CODEC, f"index section does not hold {k} varints")
    starts = np.empty(k, np.int64)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    size = ends - starts + 1
    width = int(size.max()) if k else 0
    if width > _varint_width(n):
        raise WireError(Code.BAD_CODEC, f"index gap of {width} varint bytes for {n} elements")
    gaps = (b[starts] & 0x7F).astype(np.int64)
    for j in range(1, width):
        sel = np.flatnonzero(size > j)
        gaps[sel] |= (b[starts[sel] + j] & 0x7F).astype(np.int64) << (7 * j)
    np.minimum(gaps, n, out=gaps)       # with n < 2**31 the running sum cannot overflow
    gaps += 1
    idx = np.cumsum(gaps, out=gaps)
    idx -= 1
    if k and idx[-1] >= n:
        raise WireError(Code.BAD_CODEC, f"index {int(idx[-1])} out of range for {n} elements")
    return idx


def _shuffle(a: np.ndarray) -> np.ndarray:
    """Byte-transpose: all first bytes of ``a``'s elements, then all second bytes, ..."""
    return a.view(np.uint8).reshape(-1, a.itemsize).T.copy() if a.itemsize > 1 else a


def _unshuffle(b: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Inverse of :func:`_shuffle` for the uint8 bytes ``b`` of an array of ``dt``."""
    if dt.itemsize == 1:
        return b.view(dt)
    rows = b.reshape(dt.itemsize, -1)
    out = np.empty(rows.shape[1], dt)
    cols = out.view(np.uint8).reshape(-1, dt.itemsize)
    for j, row in enumerate(rows):
        cols[:, j] = row
    return out


def _join(parts: list[np.ndarray]):
    return parts[0] if len(parts) == 1 else b"".join(parts)


# ------------------------------------------------------------------ encode / decode


def _select(flat: np.ndarray, st: Stages, rng: np.random.Generator) -> np.ndarray:
    """Sorted int64 indices of the entries the sparsifier keeps."""
    n = len(flat)
    k = math.ceil(st.fraction * n)
    if k == 0:
        return np.empty(0, np.int64)
    if st.sparsifier == "randomk":
        idx = rng.choice(n, k, replace=False, shuffle=False)
    else:
        idx = _topk(np.abs(flat), k)
    idx.sort()
    return idx


def _topk(mag: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest of ``mag`` (NaN counts as largest), in any order.

    For large tensors a threshold from a strided sample first narrows the candidates, so
    argpartition runs on about 1.25 k values instead of n; if the sample misleads and fewer than
    k pass, the full argpartition runs.
    """
    n = len(mag)
    if n >= 4 * _TOPK_SAMPLE and 8 * k <= n:
        sample = mag[::n // _TOPK_SAMPLE]
        expect = len(sample) * k / n
        j = min(len(sample), math.ceil(1.25 * expect + 4 * math.sqrt(expect)) + 1)
        threshold = np.partition(sample, len(sample) - j)[len(sample) - j]
        keep = np.less(mag, threshold)
        np.logical_not(keep, out=keep)  # not (mag < threshold): NaN passes
        cand = np.flatnonzero(keep)
        if len(cand) >= k:
            return cand[np.argpartition(mag[cand], len(cand) - k)[len(cand) - k:]]
    return np.argpartition(mag, n - k)[n - k:]


def encode(arr: np.ndarray, chain: str = "raw", rng: np.random.Generator | None = None,
           want_decoded: bool = False):
    """Encode ``arr`` with ``chain``.

    Returns ``(applied_chain, buffer)``, or ``(applied_chain, buffer, decoded)`` with
    ``want_decoded``: ``decoded`` is bit for bit what :func:`decode` returns for the buffer (the
    array a sender keeps for error feedback), built from the staged arrays without a second decode;
    for ``raw`` it may share memory with ``arr``. ``buffer`` supports the buffer protocol; for
    ``raw`` it is a flat view of the array (made C-contiguous), which the caller may send with
    ``copy=False``. ``rng`` drives randomk and int8 rounding (default: the calling thread's own
    generator).
    """
    st = parse_stages(chain)
    shape = np.shape(arr)
    a = np.ascontiguousarray(arr)   # at least 1-d
    if st.plain and not want_decoded and a.dtype in _NAMES and a.dtype.isnative:
        return "raw", a.reshape(-1)        # the common case, without the general machinery
    if dtype_name(a.dtype) not in ALLOWED_DTYPES:
        raise WireError(Code.BAD_DTYPE, f"dtype {a.dtype} is not allowed")
    if not a.dtype.isnative:   # the wire is little-endian native order: '>f4' is converted
        a = a.astype(a.dtype.newbyteorder("="))
    if st.lossy and a.dtype.kind != "f":
        raise WireError(Code.BAD_CODEC, f"{st.text(False, False)} applies to floating tensors, "
                                        f"not {a.dtype}")
    if rng is None:
        rng = _local.rng
    flat = a.reshape(-1)
    prefix = []
    if st.sparse:
        if flat.size >= MAX_SPARSE_ELEMENTS:
            raise WireError(Code.BAD_CODEC, f"{st.sparsifier} takes fewer than "
                                            f"{MAX_SPARSE_ELEMENTS} elements, not {flat.size}")
        idx = _select(flat, st, rng)
        values = flat[idx]
        index_bytes = _varint_encode(idx)
        prefix = [np.array([len(idx), len(index_bytes)], "<u8"), index_bytes]
    else:
        values = flat
    arrays = _encode_values(values, st.coder, rng)
    applied, buf = assemble(st, prefix, arrays)
    if not want_decoded:
        return applied, buf
    decoded = decode_values(arrays, st.coder, a.dtype, len(values))
    if st.sparse:
        dense = np.zeros(flat.size, a.dtype)
        dense[idx] = decoded
        decoded = dense
    return applied, buf, decoded.reshape(shape)


def assemble(st: Stages, prefix: list, arrays: list):
    """The frame from the index section (``prefix``) and the value sections: shuffled and
    zstd-compressed where the chain asks and it pays. Returns ``(applied chain, buffer)``."""
    plain = prefix + arrays
    staged = prefix + [_shuffle(x) for x in arrays] if st.shuffle else plain
    applied, buf = st.text(st.shuffle, False), _join(staged)
    size = memoryview(buf).nbytes
    if st.zstd and size:
        packed = _local.cctx.compress(buf)
        if len(packed) * ZSTD_MIN_GAIN <= size:
            applied, buf = st.text(st.shuffle, True), packed
        elif st.shuffle:                # shuffling only pays with zstd
            applied, buf = st.text(False, False), _join(plain)
    return applied, buf


def encoded_len_fixed(chain: str, dtype: str, shape) -> int | None:
    """Exact encoded length for a chain without zstd or sparsifier, else None (variable)."""
    st = parse_stages(chain)
    if st.zstd or st.sparse:
        return None
    dt = DTYPES.get(dtype) or np.dtype(dtype)
    if st.plain:
        return dt.itemsize * math.prod(shape)
    return _values_len(st.coder, dt, math.prod(shape))


def _payload(buf) -> np.ndarray:
    """The bytes of a frame as a uint8 array (a view where possible)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    return np.frombuffer(mv.cast("B"), np.uint8) if mv.nbytes else np.empty(0, np.uint8)


def _decompress(data: np.ndarray, limit: int, exact: bool, shape) -> np.ndarray:
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise WireError(Code.BAD_CODEC, f"not a zstd frame: {e}") from None
    if size < 0 or size > limit or (exact and size != limit):
        raise WireError(Code.BAD_SHAPE,
                        f"zstd content size {size} does not fit shape {list(shape)}")
    try:
        return np.frombuffer(_local.dctx.decompress(data, max_output_size=size), np.uint8)
    except zstandard.ZstdError as e:
        raise WireError(Code.BAD_CODEC, f"corrupt zstd frame: {e}") from None


def _decode(buf, chain: str, dtype: str, shape, max_bytes: int):
    """Validate and decode a frame: ``(indices or None, values, n, dtype)``."""
    idx, arrays, coder, dt, k, n = decode_staged(buf, chain, dtype, shape, max_bytes)
    return idx, decode_values(arrays, coder, dt, k), n, dt


def decode_staged(buf, chain: str, dtype: str, shape, max_bytes: int):
    """Validate a frame and undo every stage but the value coder: ``(indices or None, arrays,
    coder, dtype, k, n)``, where :func:`decode_values` of ``(arrays, coder, dtype, k)`` gives
    the ``k`` values (at ``indices`` among ``n`` for a sparsified chain). For a receiver that
    decodes the values elsewhere (a shard on a GPU copies the int8 or sign codes, not the
    floats they stand for). Lengths, counts and indices are all checked here."""
    st = parse_stages(chain)
    dt = DTYPES.get(dtype)
    if dt is None:
        raise WireError(Code.BAD_DTYPE, f"dtype {dtype!r} is not allowed")
    n = math.prod(shape)
    if st.plain and n >= 0 and n * dt.itemsize <= max_bytes:    # raw: a view, length checked
        data = _payload(buf)
        if len(data) != n * dt.itemsize:
            raise WireError(Code.BAD_SHAPE, f"{len(data)} bytes do not match shape "
                                            f"{list(shape)} of {dtype} ({chain})")
        return None, [data.view(dt)], "raw", dt, n, n
    if n < 0:
        raise WireError(Code.BAD_SHAPE, f"shape {list(shape)} has a negative dimension")
    if n * dt.itemsize > max_bytes:
        raise WireError(Code.TOO_LARGE, f"decoded size {n * dt.itemsize} B above cap {max_bytes} B")
    if st.lossy and dt.kind != "f":
        raise WireError(Code.BAD_CODEC, f"{st.text(False, False)} cannot decode to {dtype}")
    if st.sparse and n >= MAX_SPARSE_ELEMENTS:
        raise WireError(Code.BAD_CODEC, f"{st.sparsifier} takes fewer than {MAX_SPARSE_ELEMENTS} "
                                        f"elements, not {n}")
    data = _payload(buf)
    if st.sparse:    # the largest valid payload: every element kept, every gap at full width
        limit = _SPARSE_HEAD + n * _varint_width(n) + _values_len(st.coder, dt, n)
    else:
        limit = _values_len(st.coder, dt, n)
    if st.zstd:
        data = _decompress(data, limit, not st.sparse, shape)
    if st.sparse:
        if len(data) < _SPARSE_HEAD:
            raise WireError(Code.BAD_SHAPE, f"{len(data)} bytes cannot hold a sparse header")
        k, index_len = (int(v) for v in data[:_SPARSE_HEAD].view("<u8"))
        if k > n:
            raise WireError(Code.BAD_SHAPE, f"{k} kept values for {n} elements")
        if _SPARSE_HEAD + index_len + _values_len(st.coder, dt, k) != len(data):
            raise WireError(Code.BAD_SHAPE, f"{len(data)} bytes do not match {k} kept values of "
                                            f"{dtype} with {index_len} index bytes ({chain})")
        idx = _varint_decode(data[_SPARSE_HEAD:_SPARSE_HEAD + index_len], k, n)
        body = data[_SPARSE_HEAD + index_len:]
    elif len(data) != limit:
        raise WireError(Code.BAD_SHAPE,
                        f"{len(data)} bytes do not match shape {list(shape)} of {dtype} ({chain})")
    else:
        idx, k, body = None, n, data
    arrays, offset = [], 0
    for sdt, count in _value_sections(st.coder, dt, k):
        part = body[offset:offset + sdt.itemsize * count]
        offset += len(part)
        arrays.append(_unshuffle(part, sdt) if st.shuffle else part.view(sdt))
    return idx, arrays, st.coder, dt, k, n


class Pieces:
    """A dense frame decoded a piece at a time, so a consumer touches each piece of the frame
    once while it is in cache (see :func:`pieces`)."""

    __slots__ = ("data", "coder", "dtype", "n", "width")

    def __init__(self, data: np.ndarray, coder: str, dt: np.dtype, n: int):
        self.data, self.coder, self.dtype, self.n = data, coder, dt, n
        self.width = _values_len(coder, dt, 1)     # encoded bytes per value

    def encoded(self, lo: int, hi: int) -> np.ndarray:
        """The frame's bytes coding values ``[lo, hi)``."""
        return self.data[lo * self.width:hi * self.width]

    def values(self, enc: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """The values that ``enc`` (from :meth:`encoded`) codes: a view for ``raw``, else
        decoded into the start of ``scratch`` (1-D, of :attr:`dtype`, long enough)."""
        if self.coder == "raw":
            return enc.view(self.dtype)
        bits, out = enc.view(np.uint16), scratch[:len(enc) // 2]
        if self.coder == "fp16":
            return _fp16_decode(bits, self.dtype, out)
        if self.dtype == np.float32:
            return _bf16_decode(bits, out)
        np.copyto(out, _bf16_decode(bits))
        return out

    def add_into(self, out: np.ndarray, first: bool, w: np.ndarray | None) -> bool:
        """``out`` = (``first``) or += the frame's values, times ``w`` (a 0-d array of
        ``out``'s dtype) when given, in one pass with numba's loop (:mod:`.jit`); the same bits
        as reading the pieces and adding them. False, with ``out`` untouched, where there is no
        such loop (``raw``, no numba, ``out`` not a contiguous float32/float64 array)."""
        fast = jit.loops()
        if (fast is None or self.coder == "raw" or not isinstance(out, np.ndarray)
                or out.dtype not in _JIT_FLOATS or not out.flags.c_contiguous
                or out.size != self.n):
            return False
        bits = self.data.view(np.uint16)
        if not bits.flags.aligned:
            return False
        mode = jit.add_mode(first, w is not None)
        scale = out.dtype.type(1 if w is None else w)
        if self.coder == "bf16":
            # scratch per call: the loop runs without the GIL, maybe in two threads at once
            fast["add_bf16"](bits, out, scale, mode, np.empty(jit.SCRATCH, np.float32))
        else:
            fast["add_fp16"](bits, _half_table(out.dtype), out, scale, mode)
        return True


_JIT_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def pieces(buf, chain: str, dtype: str, shape, max_bytes: int) -> Pieces | None:
    """A :class:`Pieces` reader for a frame whose chain codes each value on its own (``raw``,
    ``fp16`` or ``bf16``, no sparsifier, shuffle or zstd) into a floating ``dtype``; None for
    any other chain, which is decoded whole. The frame's length is checked here (``BAD_SHAPE``),
    as :func:`decode` checks it; its values are what :func:`decode` would give, piece by piece."""
    st = parse_stages(chain)
    dt = DTYPES.get(dtype)
    if (dt is None or dt.kind != "f" or st.sparse or st.shuffle or st.zstd
            or st.coder not in ("raw", "fp16", "bf16")):
        return None
    n = math.prod(shape)
    if n < 0 or n * dt.itemsize > max_bytes:
        return None     # decode() words the error
    data = _payload(buf)
    if len(data) != _values_len(st.coder, dt, n):
        raise WireError(Code.BAD_SHAPE, f"{len(data)} bytes do not match shape {list(shape)} "
                                        f"of {dtype} ({chain})")
    return Pieces(data, st.coder, dt, n)


def _shaped(a: np.ndarray, shape) -> np.ndarray:
    try:
        return a.reshape(shape)
    except ValueError:
        raise WireError(Code.BAD_SHAPE,
                        f"cannot shape {a.size} elements as {list(shape)}") from None


def decode(buf, chain: str, dtype: str, shape, max_bytes: int) -> np.ndarray:
    """Decode one frame to a dense array of ``dtype`` and ``shape`` (zeros where a sparsifier
    dropped entries).

    Validates the chain, the dtype, the decoded size against ``max_bytes``, and every length,
    count and index in the payload before using it; raises :class:`WireError` and nothing else.
    Allocation is bounded by the decoded size, the payload, and for ``zstd`` a decompressed
    payload no larger than the largest valid one for the shape. The result may be a read-only
    view of ``buf``.
    """
    idx, values, n, dt = _decode(buf, chain, dtype, shape, max_bytes)
    if idx is not None:
        dense = np.zeros(n, dt)
        dense[idx] = values
        values = dense
    return _shaped(values, shape)


def decode_sparse(buf, chain: str, dtype: str, shape, max_bytes: int):
    """Like :func:`decode`, without densifying: ``(indices, values)``.

    For a sparsified chain, ``indices`` are the sorted, distinct int64 positions in the flattened
    tensor and ``values`` the 1-D values there (ready for a scatter-add); for a dense chain,
    ``indices`` is None and ``values`` the array of ``shape``.
    """
    idx, values, _, _ = _decode(buf, chain, dtype, shape, max_bytes)
    return (idx, values) if idx is not None else (None, _shaped(values, shape))
