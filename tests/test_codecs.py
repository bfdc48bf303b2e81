"""Tests of the tensor codec chains (gradbus.codecs.tensor) and the tensor part of the wire format
(gradbus.codecs.wire): round trips, the zstd keep/drop rule, and every validation rule's error code.

Frames are handed to the decoders as ``bytes`` (what a ZeroMQ receiver gets), not as the array that
``encode`` may return for ``raw`` (a separate test feeds that buffer back directly).
"""
from __future__ import annotations

import tracemalloc
import warnings

import msgpack
import numpy as np
import pytest
import zmq
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradbus.codecs import tensor, values, wire
from gradbus.codecs.errors import Code, WireError

SETTINGS = settings(max_examples=120, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BIG = 1 << 30  # decode cap when the cap is not what is being tested

FLOAT_DTYPES = (np.float32, np.float64)
SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=12)


def frame_bytes(buf) -> bytes:
    """What the receiver gets for a buffer sent with send_multipart."""
    return memoryview(buf).tobytes()


def roundtrip(a: np.ndarray, chain: str, max_bytes: int = BIG):
    applied, buf = tensor.encode(a, chain)
    out = tensor.decode(frame_bytes(buf), applied, a.dtype.name, a.shape, max_bytes)
    assert out.shape == a.shape
    assert out.dtype == a.dtype
    return applied, out


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    assert x.dtype == y.dtype and x.shape == y.shape
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return np.array_equal(np.ascontiguousarray(x).view(u), np.ascontiguousarray(y).view(u))


def expect_code(code: Code, fn, *args, **kw):
    with pytest.raises(WireError) as ei:
        fn(*args, **kw)
    assert ei.value.code == code, f"got {ei.value.code}: {ei.value}"
    return ei.value


@st.composite
def any_bits_arrays(draw, dtype=None):
    """float32/float64 arrays of arbitrary bit patterns (NaN payloads, -0.0, inf, subnormals)."""
    dt = np.dtype(dtype or draw(st.sampled_from(FLOAT_DTYPES)))
    u = np.uint32 if dt.itemsize == 4 else np.uint64
    shape = draw(SHAPES)
    elements = st.integers(0, 2 ** (8 * dt.itemsize) - 1)
    fill = draw(st.sampled_from([None, st.just(0), st.just(0x3F800000 if dt.itemsize == 4 else 1)]))
    bits = draw(hnp.arrays(u, shape, elements=elements, fill=fill))
    return bits.view(dt)


def float_arrays(lo: float, hi: float, dtype=None, compressible_fill=True):
    @st.composite
    def strat(draw):
        dt = np.dtype(dtype or draw(st.sampled_from(FLOAT_DTYPES)))
        width = 8 * dt.itemsize
        elements = st.floats(float(dt.type(lo)), float(dt.type(hi)), width=width,
                             allow_nan=False, allow_infinity=False)
        fill = draw(st.sampled_from([None, st.just(0.0)])) if compressible_fill else None
        return draw(hnp.arrays(dt, draw(SHAPES), elements=elements, fill=fill))
    return strat()


# ------------------------------------------------------------------ lossless chains


@SETTINGS
@given(a=any_bits_arrays(), chain=st.sampled_from(["raw", "", "zstd", "raw|zstd"]))
def test_lossless_roundtrip_is_bit_exact(a, chain):
    applied, out = roundtrip(a, chain)
    assert applied in ("raw", "raw|zstd")
    if "zstd" not in chain:
        assert applied == "raw"
    assert same_bits(out, a)


@SETTINGS
@given(a=any_bits_arrays())
def test_raw_encoded_length_is_exact(a):
    applied, buf = tensor.encode(a, "raw")
    assert applied == "raw"
    assert memoryview(buf).nbytes == a.nbytes == tensor.encoded_len_fixed("raw", a.dtype.name,
                                                                           a.shape)


@SETTINGS
@given(shape=SHAPES, dtype=st.sampled_from(FLOAT_DTYPES), chain=st.sampled_from(
    ["raw|zstd", "zstd", "fp16|zstd", "bf16|zstd"]))
def test_compressible_data_keeps_zstd_and_decodes(shape, dtype, chain):
    a = np.zeros(shape, dtype)
    if a.size:  # make the content non-trivial but still compressible
        a.reshape(-1)[::5] = 1.5
    precision = tensor.parse_chain(chain)[0]
    applied, buf = tensor.encode(a, chain)
    staged = a.size * (a.dtype.itemsize if precision == "raw" else 2)
    if staged >= 64:  # tiny arrays may not shrink past the zstd frame overhead
        assert applied == precision + "|zstd"
    if applied.endswith("|zstd"):
        assert len(buf) * tensor.ZSTD_MIN_GAIN <= staged
    out = tensor.decode(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    assert np.array_equal(out, a)


@SETTINGS
@given(n=st.integers(256, 4096), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["bits", "gaussian"]))
def test_incompressible_float32_drops_zstd(n, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "bits":
        a = rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32)
    else:  # gradient-like: random mantissas compress by ~1.08x, below ZSTD_MIN_GAIN
        a = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    applied, buf = tensor.encode(a, "raw|zstd")
    assert applied == "raw"
    assert frame_bytes(buf) == a.tobytes()
    out = tensor.decode(frame_bytes(buf), applied, "float32", a.shape, BIG)
    assert same_bits(out, a)


def test_zstd_is_not_applied_to_empty_tensors():
    applied, buf = tensor.encode(np.zeros((0, 4), np.float32), "raw|zstd")
    assert applied == "raw" and memoryview(buf).nbytes == 0


# ------------------------------------------------------------------ fp16


@SETTINGS
@given(a=float_arrays(-1e4, 1e4), z=st.booleans())
def test_fp16_roundtrip_within_half_precision(a, z):
    applied, out = roundtrip(a, "fp16|zstd" if z else "fp16")
    assert applied in ("fp16", "fp16|zstd")
    x = a.astype(np.float64)
    err = np.abs(out.astype(np.float64) - x)
    # round to nearest, 11-bit significand: half an ulp is <= 2^-11 relative for normal numbers;
    # below 2^-14 (float16 subnormals) the spacing is 2^-24, so the error is <= 2^-25.
    bound = np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    assert (err <= bound).all(), (x[err > bound], out[err > bound])
    # and every decoded value is a float16 value
    assert np.array_equal(out.astype(np.float16).astype(out.dtype), out)


def test_fp16_encoded_length_is_two_bytes_per_element():
    a = np.linspace(-3, 3, 30, dtype=np.float64).reshape(5, 6)
    applied, buf = tensor.encode(a, "fp16")
    assert applied == "fp16" and memoryview(buf).nbytes == 60
    assert tensor.encoded_len_fixed("fp16", "float64", (5, 6)) == 60


# ------------------------------------------------------------------ bf16

BF16_INF_FROM = np.array([0x7F7F8000], np.uint32).view(np.float32)[0]  # max bf16 + half an ulp


def bf16_half_ulp(x: np.ndarray) -> np.ndarray:
    """Half the bf16 spacing at |x| (8-bit significand; subnormal spacing 2^-133)."""
    _, e = np.frexp(x.astype(np.float64))           # |x| = m * 2^e, m in [0.5, 1)
    return np.maximum(np.ldexp(1.0, e - 9), 2.0**-134)


def bf16_rne_reference(bits: int) -> int:
    """float32 bits -> bf16 bits, round to nearest, ties to even; NaN -> some NaN."""
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF):
        return -1  # NaN: any NaN is fine
    hi, lo = bits >> 16, bits & 0xFFFF
    if lo > 0x8000 or (lo == 0x8000 and hi & 1):
        hi += 1  # carries into the exponent (and to inf) as it should
    return hi


@st.composite
def finite_float32_arrays(draw):
    fill = draw(st.sampled_from([None, st.just(np.float32(0.0))]))
    return draw(hnp.arrays(np.float32, SHAPES, fill=fill,
                           elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))


@SETTINGS
@given(a=finite_float32_arrays())
def test_bf16_float32_rounds_to_nearest(a):
    applied, out = roundtrip(a, "bf16")
    assert applied == "bf16"
    x = a.astype(np.float64)
    y = out.astype(np.float64)
    overflow = np.isinf(y)
    assert (np.abs(x[overflow]) >= BF16_INF_FROM).all()
    assert (np.sign(y[overflow]) == np.sign(x[overflow])).all()
    fin = ~overflow
    err = np.abs(y[fin] - x[fin])
    assert (err <= bf16_half_ulp(x[fin])).all()
    normal = fin & (np.abs(x) >= np.finfo(np.float32).tiny)
    # relative error of round-to-nearest with an 8-bit significand: <= 2^-8 (truncation: 2^-7)
    assert (np.abs(y[normal] - x[normal]) <= 2.0**-8 * np.abs(x[normal])).all()


@SETTINGS
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64)
       | st.lists(st.integers(0, 0xFFFF).map(lambda h: (h << 16) | 0x8000),  # exact ties
                  min_size=1, max_size=64))
def test_bf16_matches_reference_rne_bit_for_bit(bits):
    a = np.array(bits, np.uint32).view(np.float32)
    applied, buf = tensor.encode(a, "bf16")
    got = np.frombuffer(frame_bytes(buf), np.uint16)
    for b, g in zip(bits, got.tolist()):
        want = bf16_rne_reference(b)
        if want == -1:
            assert (g & 0x7F80) == 0x7F80 and (g & 0x7F), f"NaN {b:#010x} -> {g:#06x}"
        else:
            assert g == want, f"{b:#010x} -> {g:#06x}, want {want:#06x}"


@SETTINGS
@given(a=float_arrays(-1e30, 1e30, dtype=np.float64))
def test_bf16_float64_relative_error(a):
    applied, out = roundtrip(a, "bf16")
    assert applied == "bf16"
    x = a
    err = np.abs(out - x)
    tiny = np.abs(x) < np.finfo(np.float32).tiny
    assert (err[~tiny] <= 2.0**-8 * np.abs(x[~tiny])).all()
    assert (err[tiny] <= 2.0**-133).all()


@SETTINGS
@given(a=float_arrays(-1e30, 1e30))
def test_bf16_zstd_decodes_equal_to_bf16_alone(a):
    _, plain = roundtrip(a, "bf16")
    applied, packed = roundtrip(a, "bf16|zstd")
    assert applied in ("bf16", "bf16|zstd")
    assert same_bits(packed, plain)


def test_bf16_zstd_equal_to_bf16_when_zstd_is_kept():
    a = np.zeros(4096, np.float32)
    a[::3] = np.linspace(-7, 7, len(a[::3]))
    applied, packed = roundtrip(a, "bf16|zstd")
    assert applied == "bf16|zstd"
    assert same_bits(packed, roundtrip(a, "bf16")[1])


@SETTINGS
@given(a=any_bits_arrays(np.float32), as64=st.booleans(), z=st.booleans())
def test_bf16_nan_stays_nan_and_inf_stays_inf(a, as64, z):
    # float64 input built from float32 values: no overflow on the way through float32
    if as64:
        with np.errstate(invalid="ignore"):  # casting a signalling NaN raises FE_INVALID
            a = a.astype(np.float64)
    applied, out = roundtrip(a, "bf16|zstd" if z else "bf16")
    assert np.array_equal(np.isnan(out), np.isnan(a))
    inf = np.isinf(a)
    assert np.array_equal(out[inf], a[inf])


def test_bf16_nan_patterns_that_would_round_to_inf():
    # signalling NaN 0x7F800001 + rounding bias gives 0x7F80 (inf) without the NaN fix-up;
    # 0xFFFFFFFF wraps around uint32.
    bits = np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F80FFFF],
                    np.uint32)
    a = bits.view(np.float32)
    _, out = roundtrip(a, "bf16")
    assert np.isnan(out).all()
    _, out = roundtrip(np.array([np.inf, -np.inf, 0.0, -0.0], np.float32), "bf16")
    assert same_bits(out, np.array([np.inf, -np.inf, 0.0, -0.0], np.float32))


# ------------------------------------------------------------------ every 16-bit pattern

ALL16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_bf16_decode_of_every_bit_pattern(dtype):
    """No warning for any frame content; NaN exactly where the pattern is a NaN; values exact.

    float64 failed against the codecs/ of 17:01 (a signalling NaN such as bf16 0x7F81 warned
    "invalid value encountered in cast"); fixed in the 17:39 rewrite."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tensor.decode(ALL16.tobytes(), "bf16", dtype, (2**16,), BIG)
    is_nan = ((ALL16 & 0x7F80) == 0x7F80) & ((ALL16 & 0x007F) != 0)
    assert np.array_equal(np.isnan(out), is_nan)
    as_f32 = (ALL16.astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of float32
    with np.errstate(all="ignore"):
        want = as_f32[~is_nan].astype(dtype)  # float16: values above 65504 become inf
    assert same_bits(out[~is_nan], want)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_fp16_decode_of_every_bit_pattern(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tensor.decode(ALL16.tobytes(), "fp16", dtype, (2**16,), BIG)
    is_nan = ((ALL16 & 0x7C00) == 0x7C00) & ((ALL16 & 0x03FF) != 0)
    assert np.array_equal(np.isnan(out), is_nan)
    assert same_bits(out[~is_nan], ALL16.view(np.float16)[~is_nan].astype(dtype))


# ------------------------------------------------------------------ dtype rules


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
@pytest.mark.parametrize("chain", ["fp16", "bf16", "fp16|zstd", "bf16|zstd"])
def test_int_dtypes_refuse_lossy_precision(dtype, chain):
    a = np.arange(12, dtype=dtype)
    expect_code(Code.BAD_CODEC, tensor.encode, a, chain)
    expect_code(Code.BAD_CODEC, tensor.decode, b"\0" * 24, chain.split("|")[0], dtype, (12,), BIG)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "float16"])
@pytest.mark.parametrize("chain", ["raw", "raw|zstd"])
def test_other_allowed_dtypes_roundtrip_raw(dtype, chain):
    a = (np.arange(600) % 7).astype(dtype).reshape(20, 30)
    applied, out = roundtrip(a, chain)
    assert applied == chain
    assert np.array_equal(out, a)


@pytest.mark.parametrize("arr", [np.zeros(3, bool), np.zeros(3, np.complex64),
                                 np.zeros(3, np.int16), np.array(["a"]), np.zeros(3, object)])
def test_encode_refuses_disallowed_dtypes(arr):
    expect_code(Code.BAD_DTYPE, tensor.encode, arr, "raw")


# ------------------------------------------------------------------ parse_chain


@pytest.mark.parametrize("chain, want", [
    ("", ("raw", False)), ("raw", ("raw", False)), ("fp16", ("fp16", False)),
    ("bf16", ("bf16", False)), ("zstd", ("raw", True)), ("raw|zstd", ("raw", True)),
    ("fp16|zstd", ("fp16", True)), ("bf16|zstd", ("bf16", True)),
])
def test_parse_chain_valid(chain, want):
    assert tensor.parse_chain(chain) == want


@pytest.mark.parametrize("chain", [
    "lz4", "raw|lz4", "gzip|zstd", "RAW", "raw|", "|zstd", "raw||zstd",   # unknown codec
    "zstd|raw", "zstd|bf16", "zstd|zstd", "raw|zstd|zstd",                 # zstd not last / twice
    "zstd|fp16",                                                            # precision not first
    "fp16|bf16", "raw|raw", "bf16|fp16|zstd", "raw|fp16",                  # two precisions
    "raw|zstd" + "|zstd" * 20,                                              # too long
    None, 1, 0, b"raw", ["raw"], ("raw",), {"c": "raw"}, True,            # not a string
])
def test_parse_chain_errors_are_bad_codec(chain):
    expect_code(Code.BAD_CODEC, tensor.parse_chain, chain)


@SETTINGS
@given(chain=st.text(alphabet=st.sampled_from(list("|rawfp16b6zstdx ")), max_size=30)
       | st.lists(st.sampled_from(["raw", "fp16", "bf16", "zstd", "x"]), max_size=4)
       .map("|".join))
def test_parse_chain_either_parses_or_raises_bad_codec(chain):
    try:
        precision, z = tensor.parse_chain(chain)
    except WireError as e:
        assert e.code == Code.BAD_CODEC
        return
    parts = [p.strip() for p in chain.split("|")] if chain else []
    assert precision in tensor.PRECISION
    assert z == ("zstd" in parts)
    assert parts.count("zstd") <= 1 and (not z or parts[-1] == "zstd")
    assert sum(p in tensor.PRECISION for p in parts) <= 1


# ------------------------------------------------------------------ decode validation


@pytest.mark.parametrize("chain, dtype, itemsize", [
    ("raw", "float32", 4), ("raw", "float64", 8), ("raw", "int64", 8), ("raw", "uint8", 1),
    ("fp16", "float32", 2), ("fp16", "float64", 2), ("bf16", "float32", 2), ("bf16", "float64", 2),
])
@pytest.mark.parametrize("delta", [-1, +1, -2, +3])
def test_decode_wrong_length_is_bad_shape(chain, dtype, itemsize, delta):
    shape = (3, 5)
    good = b"\0" * (15 * itemsize)
    assert tensor.decode(good, chain, dtype, shape, BIG).shape == shape
    bad = b"\0" * (15 * itemsize + delta)
    expect_code(Code.BAD_SHAPE, tensor.decode, bad, chain, dtype, shape, BIG)


def test_decode_empty_frame_for_nonempty_shape_is_bad_shape():
    expect_code(Code.BAD_SHAPE, tensor.decode, b"", "raw", "float32", (1,), BIG)


@pytest.mark.parametrize("chain", ["raw", "fp16", "bf16", "raw|zstd", "bf16|zstd"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decode_above_cap_is_too_large_without_allocating(chain, dtype):
    shape = (2**30,)
    tracemalloc.start()
    try:
        expect_code(Code.TOO_LARGE, tensor.decode, b"\0\0\0\0", chain, dtype, shape, 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_decode_cap_is_inclusive():
    assert tensor.decode(b"\0" * 64, "raw", "float32", (4, 4), 64).shape == (4, 4)
    expect_code(Code.TOO_LARGE, tensor.decode, b"\0" * 64, "raw", "float32", (4, 4), 63)
    # the cap is on the decoded size, not the (smaller) fp16/bf16 frame
    expect_code(Code.TOO_LARGE, tensor.decode, b"\0" * 32, "bf16", "float64", (4, 4), 64)


def test_decode_zstd_bomb_is_refused_before_decompressing():
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(32 << 20))
    assert len(bomb) < 1 << 16
    tracemalloc.start()
    try:
        # shape says 32 MiB: above the 1 MiB cap
        expect_code(Code.TOO_LARGE, tensor.decode, bomb, "raw|zstd", "uint8", (32 << 20,), 1 << 20)
        # shape within the cap, content size says 32 MiB: refused on the frame header
        expect_code(Code.BAD_SHAPE, tensor.decode, bomb, "raw|zstd", "uint8", (1 << 20,), 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.parametrize("dtype", ["bool", "complex64", "float128", "int16", "object", "<f4", "f4",
                                   "float", "", "FLOAT32"])
def test_decode_disallowed_dtype_is_bad_dtype(dtype):
    expect_code(Code.BAD_DTYPE, tensor.decode, b"\0" * 8, "raw", dtype, (2,), BIG)


def test_decode_zstd_content_size_mismatch_is_bad_shape():
    a = np.arange(100, dtype=np.float32) % 3
    applied, buf = tensor.encode(a, "raw|zstd")
    assert applied == "raw|zstd"
    frame = frame_bytes(buf)
    assert np.array_equal(tensor.decode(frame, applied, "float32", (100,), BIG), a)
    for shape in [(99,), (101,), (50,), (0,)]:
        expect_code(Code.BAD_SHAPE, tensor.decode, frame, applied, "float32", shape, BIG)
    # same content size but another stage size: 100 float32 = 400 B = 200 fp16 values
    expect_code(Code.BAD_SHAPE, tensor.decode, frame, "fp16|zstd", "float32", (100,), BIG)
    # a frame that does not record its content size
    nosize = zstandard.ZstdCompressor(write_content_size=False).compress(a.tobytes())
    expect_code(Code.BAD_SHAPE, tensor.decode, nosize, "raw|zstd", "float32", (100,), BIG)


def test_decode_corrupt_zstd_is_bad_codec():
    a = np.zeros(1000, np.float32)
    a[::7] = np.arange(143)
    applied, buf = tensor.encode(a, "raw|zstd")
    assert applied == "raw|zstd"
    frame = frame_bytes(buf)
    for bad in [b"", b"not a zstd frame at all", frame[:4], frame[:6], frame[:-3],
                frame[: len(frame) // 2], b"\0" * len(frame)]:
        expect_code(Code.BAD_CODEC, tensor.decode, bad, applied, "float32", (1000,), BIG)


# ------------------------------------------------------------------ wire: round trip

VALID_CHAINS = ["raw", "raw|zstd", "fp16", "fp16|zstd", "bf16", "bf16|zstd"]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(sorted(tensor.ALLOWED_DTYPES)))
    dt = np.dtype(dtype)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9))
    if dt.kind == "f":
        elems = st.floats(-1e4, 1e4, width=8 * dt.itemsize)
        chain = draw(st.sampled_from(VALID_CHAINS))
    else:
        elems = st.integers(int(np.iinfo(dt).min), int(np.iinfo(dt).max))
        chain = draw(st.sampled_from(["raw", "raw|zstd"]))
    fill = draw(st.sampled_from([None, st.just(0)]))
    a = draw(hnp.arrays(dt, shape, elements=elems, fill=fill))
    return a, chain


def expected_decode(a: np.ndarray, chain: str) -> np.ndarray:
    precision = tensor.parse_chain(chain)[0]
    if precision == "fp16":
        return a.astype(np.float16).astype(a.dtype)
    if precision == "bf16":
        bits = values._bf16_encode(np.ascontiguousarray(a, np.float32).reshape(-1))
        return values._bf16_decode(bits).astype(a.dtype).reshape(a.shape)
    return a


@SETTINGS
@given(items=st.lists(tensors(), max_size=5), version=st.none() | st.integers(0, 2**40),
       as_zmq=st.booleans())
def test_wire_roundtrip(items, version, as_zmq):
    descs, frames = [], []
    for i, (a, chain) in enumerate(items):
        d, buf = wire.encode_tensor(f"layer{i}.w", a, chain, version=version)
        descs.append(d)
        frames.append(frame_bytes(buf))
    header = wire.pack(wire.PUSH, descs, msg=7, acks=1)
    if as_zmq:
        header, frames = zmq.Frame(header), [zmq.Frame(f) for f in frames]
    h = wire.unpack_header(header, wire.FRONTEND_KINDS)
    assert h["kind"] == wire.PUSH and h["msg"] == 7
    parsed = wire.parse_tensors(h, frames)
    assert len(parsed) == len(items)
    for (a, chain), td, fr in zip(items, parsed, frames):
        assert td.dtype == a.dtype.name and td.shape == a.shape and td.version == version
        assert td.codec in (chain, chain.split("|")[0])
        out = wire.decode_tensor(td, fr)
        assert out.dtype == a.dtype and out.shape == a.shape
        assert np.array_equal(out, expected_decode(a, chain), equal_nan=a.dtype.kind == "f")


def test_tensor_desc_to_wire_roundtrips_through_parse_desc():
    d, _ = wire.encode_tensor("k", np.ones((2, 3), np.float32), "raw", version=5)
    td = wire.parse_desc(d)
    assert td.to_wire() == d
    assert wire.parse_desc(msgpack.unpackb(msgpack.packb(td.to_wire()))) == td
    h = wire.unpack_header(wire.pack(wire.PUSH, [td], msg=1, acks=0), wire.FRONTEND_KINDS)
    assert h["t"] == [d]


@SETTINGS
@given(item=tensors().filter(lambda it: it[0].nbytes > 0), data=st.data())
def test_flipped_frame_byte_is_bad_checksum(item, data):
    a, chain = item
    d, buf = wire.encode_tensor("w", a, chain)
    frame = bytearray(frame_bytes(buf))
    i = data.draw(st.integers(0, len(frame) - 1))
    mask = data.draw(st.integers(1, 255))
    frame[i] ^= mask
    h = wire.unpack_header(wire.pack(wire.PUSH, [d], msg=1, acks=0), wire.FRONTEND_KINDS)
    (td,) = wire.parse_tensors(h, [bytes(frame)])
    expect_code(Code.BAD_CHECKSUM, wire.decode_tensor, td, bytes(frame))
    expect_code(Code.BAD_CHECKSUM, wire.decode_tensor, td, zmq.Frame(bytes(frame)))


def test_checksum_can_be_skipped():
    a = np.arange(6, dtype=np.float32)
    d, buf = wire.encode_tensor("w", a)
    td = wire.parse_desc({**d, "x": (d["x"] + 1) % 2**64})
    expect_code(Code.BAD_CHECKSUM, wire.decode_tensor, td, frame_bytes(buf))
    assert np.array_equal(wire.decode_tensor(td, frame_bytes(buf), verify=False), a)


def test_decode_tensor_applies_the_cap():
    a = np.zeros(300, np.float64)
    d, buf = wire.encode_tensor("w", a)
    td = wire.parse_desc(d)
    expect_code(Code.TOO_LARGE, wire.decode_tensor, td, frame_bytes(buf), max_tensor_bytes=2399)
    assert wire.decode_tensor(td, frame_bytes(buf), max_tensor_bytes=2400).shape == (300,)


# ------------------------------------------------------------------ wire: parse_desc

GOOD_DESC = {"k": "w", "d": "float32", "s": [2, 3], "c": "raw", "n": 24, "x": 12345}


def test_good_desc_parses():
    td = wire.parse_desc(GOOD_DESC)
    assert td == wire.TensorDesc("w", "float32", (2, 3), "raw", 24, 12345, None)


@pytest.mark.parametrize("field, code", [
    ("k", Code.BAD_FIELD), ("d", Code.BAD_DTYPE), ("s", Code.BAD_SHAPE), ("c", Code.BAD_CODEC),
    ("n", Code.BAD_FIELD), ("x", Code.BAD_FIELD),
])
def test_parse_desc_missing_key(field, code):
    d = dict(GOOD_DESC)
    del d[field]
    expect_code(code, wire.parse_desc, d)


@pytest.mark.parametrize("patch, code", [
    # key
    ({"k": ""}, Code.BAD_FIELD), ({"k": "x" * 513}, Code.BAD_FIELD), ({"k": 1}, Code.BAD_FIELD),
    ({"k": b"w"}, Code.BAD_FIELD), ({"k": None}, Code.BAD_FIELD),
    # dtype
    ({"d": "bool"}, Code.BAD_DTYPE), ({"d": "float128"}, Code.BAD_DTYPE),
    ({"d": "<f4"}, Code.BAD_DTYPE), ({"d": b"float32"}, Code.BAD_DTYPE), ({"d": 5}, Code.BAD_DTYPE),
    ({"d": "object"}, Code.BAD_DTYPE),
    # shape
    ({"s": [2, -3]}, Code.BAD_SHAPE), ({"s": [-1]}, Code.BAD_SHAPE),
    ({"s": [True, 6]}, Code.BAD_SHAPE), ({"s": [6, True]}, Code.BAD_SHAPE),  # n=24 would fit
    ({"s": [2, False]}, Code.BAD_SHAPE),
    ({"s": [2.0, 3]}, Code.BAD_SHAPE), ({"s": ["2", 3]}, Code.BAD_SHAPE),
    ({"s": [None]}, Code.BAD_SHAPE),
    ({"s": 6}, Code.BAD_SHAPE), ({"s": "6"}, Code.BAD_SHAPE), ({"s": {"0": 6}}, Code.BAD_SHAPE),
    ({"s": [1] * 9, "n": 4}, Code.BAD_SHAPE), ({"s": [2**40]}, Code.BAD_SHAPE),
    ({"s": [0, 2**39, 2**39], "n": 0}, Code.BAD_SHAPE),  # empty, but numpy cannot shape it
    ({"s": [2**20, 2**20]}, Code.TOO_LARGE),
    # codec
    ({"c": 1}, Code.BAD_CODEC), ({"c": None}, Code.BAD_CODEC), ({"c": "lz4"}, Code.BAD_CODEC),
    ({"c": "zstd|raw"}, Code.BAD_CODEC), ({"c": "fp16|bf16"}, Code.BAD_CODEC),
    # n
    ({"n": -1}, Code.BAD_FIELD), ({"n": True}, Code.BAD_FIELD), ({"n": "24"}, Code.BAD_FIELD),
    ({"n": 24.0}, Code.BAD_FIELD),
    # n against a fixed-size codec
    ({"n": 23}, Code.BAD_SHAPE), ({"n": 25}, Code.BAD_SHAPE), ({"n": 0}, Code.BAD_SHAPE),
    ({"c": "fp16"}, Code.BAD_SHAPE), ({"c": "bf16", "n": 24}, Code.BAD_SHAPE),
    ({"d": "float64"}, Code.BAD_SHAPE), ({"s": [3, 3]}, Code.BAD_SHAPE),
    ({"s": []}, Code.BAD_SHAPE),
    # checksum
    ({"x": -1}, Code.BAD_FIELD), ({"x": 2**64}, Code.BAD_FIELD), ({"x": True}, Code.BAD_FIELD),
    ({"x": "12345"}, Code.BAD_FIELD), ({"x": 1.5}, Code.BAD_FIELD), ({"x": None}, Code.BAD_FIELD),
    # version
    ({"ver": -1}, Code.BAD_FIELD), ({"ver": True}, Code.BAD_FIELD), ({"ver": "1"}, Code.BAD_FIELD),
    ({"ver": 1.0}, Code.BAD_FIELD),
])
def test_parse_desc_invalid(patch, code):
    expect_code(code, wire.parse_desc, {**GOOD_DESC, **patch})


@pytest.mark.parametrize("d", [None, [], "w", 1, [("k", "w")]])
def test_parse_desc_not_a_map(d):
    expect_code(Code.BAD_FIELD, wire.parse_desc, d)


@pytest.mark.parametrize("patch", [
    {"x": 0}, {"x": 2**64 - 1}, {"ver": 0}, {"ver": 2**63}, {"ver": None}, {"k": "x" * 512},
    {"s": [1] * 6 + [2, 3]}, {"c": "fp16", "n": 12}, {"c": "bf16|zstd", "n": 7},
    {"c": "zstd", "n": 0}, {"c": "", "n": 24}, {"d": "float64", "n": 48}, {"d": "uint8", "n": 6},
    {"s": [0, 2**39], "n": 0}, {"extra": "ignored"},
])
def test_parse_desc_boundaries_accepted(patch):
    td = wire.parse_desc({**GOOD_DESC, **patch})
    assert td.nbytes == {**GOOD_DESC, **patch}["n"]


def test_parse_desc_cap_is_inclusive():
    d = {**GOOD_DESC, "s": [1024], "n": 4096}
    assert wire.parse_desc(d, max_tensor_bytes=4096).shape == (1024,)
    expect_code(Code.TOO_LARGE, wire.parse_desc, d, max_tensor_bytes=4095)


# ------------------------------------------------------------------ wire: unpack_header


def hdr(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x82\xa1v", b"\xff\xfe\xfd" * 10, b"\x93\x01\x02",  # garbage / truncated
    hdr(v=1, kind="heartbeat") + b"\x00",                              # trailing bytes
    msgpack.packb({1: 2}),                                              # non-string map key
])
def test_unpack_header_garbage_is_bad_frame(frame):
    expect_code(Code.BAD_FRAME, wire.unpack_header, frame, wire.FRONTEND_KINDS)


@pytest.mark.parametrize("obj", [[1, "heartbeat"], 1, "heartbeat", None, b"x", 1.5, True,
                                 [{"v": 1, "kind": "heartbeat"}]])
def test_unpack_header_not_a_map_is_bad_frame(obj):
    expect_code(Code.BAD_FRAME, wire.unpack_header, msgpack.packb(obj, use_bin_type=True),
                wire.FRONTEND_KINDS)


@pytest.mark.parametrize("v", [0, 2, -1, "1", None, [1], 2**64 - 1])
def test_unpack_header_wrong_version(v):
    expect_code(Code.BAD_VERSION, wire.unpack_header, hdr(v=v, kind="heartbeat"),
                wire.FRONTEND_KINDS)


def test_unpack_header_missing_version():
    expect_code(Code.BAD_VERSION, wire.unpack_header, hdr(kind="heartbeat"), wire.FRONTEND_KINDS)


@pytest.mark.parametrize("kind", ["nope", "", "HEARTBEAT", 1, None, 1.5, b"heartbeat",
                                  wire.WELCOME, wire.BATCH, wire.UPDATE])
def test_unpack_header_unknown_kind(kind):
    expect_code(Code.UNKNOWN_KIND, wire.unpack_header, hdr(v=1, kind=kind), wire.FRONTEND_KINDS)


def test_unpack_header_missing_kind():
    expect_code(Code.UNKNOWN_KIND, wire.unpack_header, hdr(v=1), wire.FRONTEND_KINDS)


def test_unpack_header_kind_allow_list_is_per_receiver():
    frame = wire.pack(wire.BATCH, parts=[])
    assert wire.unpack_header(frame, wire.SHARD_KINDS)["kind"] == wire.BATCH
    expect_code(Code.UNKNOWN_KIND, wire.unpack_header, frame, wire.FRONTEND_KINDS)


@pytest.mark.parametrize("kind, fields", [
    (wire.PUSH, {"acks": 1}),                                   # msg missing
    (wire.PUSH, {"msg": 1}),                                    # acks missing
    (wire.PUSH, {"msg": "1", "acks": 1}),                       # str for int
    (wire.PUSH, {"msg": True, "acks": 1}),                      # bool for int
    (wire.PUSH, {"msg": 1.0, "acks": 1}),                       # float for int
    (wire.PUSH, {"msg": None, "acks": 1}),
    (wire.INIT, {"msg": 1, "opt": [], "tensors": []}),          # list for map
    (wire.INIT, {"msg": 1, "opt": {}, "tensors": {}}),          # map for list
    (wire.HELLO, {"role": b"worker"}),                          # bin for str
    (wire.HELLO, {}),
    (wire.SNAPSHOT, {"req": 1, "keys": "a"}),
    (wire.STATUS, {"req": False}),
    (wire.HEARTBEAT, {"t": {}}),                                # t not a list
    (wire.HEARTBEAT, {"t": "abc"}),
    (wire.HEARTBEAT, {"t": [None] * (wire.MAX_TENSORS + 1)}),  # too many descriptors
])
def test_unpack_header_bad_field(kind, fields):
    expect_code(Code.BAD_FIELD, wire.unpack_header, hdr(v=1, kind=kind, **fields),
                wire.FRONTEND_KINDS)


@pytest.mark.parametrize("kind, fields", [
    (wire.PUSH, {"msg": 1, "acks": 0}), (wire.INIT, {"msg": 1, "opt": {}, "tensors": []}),
    (wire.HELLO, {"role": "worker"}), (wire.HEARTBEAT, {"t": [None] * wire.MAX_TENSORS}),
    (wire.BYE, {"unknown": object.__name__}),
])
def test_unpack_header_valid(kind, fields):
    h = wire.unpack_header(hdr(v=1, kind=kind, **fields), wire.FRONTEND_KINDS)
    assert h["kind"] == kind


def test_unpack_header_size_limit():
    base = hdr(v=1, kind="heartbeat", pad=b"")
    # bin 32 header: 5 bytes; a pad of p bytes adds p + 3 bytes over the empty bin 8
    p = wire.MAX_HEADER_BYTES - len(base) - 3
    at_limit = hdr(v=1, kind="heartbeat", pad=b"x" * p)
    assert len(at_limit) == wire.MAX_HEADER_BYTES
    assert wire.unpack_header(at_limit, wire.FRONTEND_KINDS)["kind"] == "heartbeat"
    over = hdr(v=1, kind="heartbeat", pad=b"x" * (p + 1))
    assert len(over) == wire.MAX_HEADER_BYTES + 1
    expect_code(Code.BAD_FRAME, wire.unpack_header, over, wire.FRONTEND_KINDS)
    expect_code(Code.BAD_FRAME, wire.unpack_header, zmq.Frame(over), wire.FRONTEND_KINDS)


def test_unpack_header_accepts_zmq_frames():
    frame = zmq.Frame(wire.pack(wire.PUSH, msg=3, acks=0))
    assert wire.unpack_header(frame, wire.FRONTEND_KINDS)["msg"] == 3


# ------------------------------------------------------------------ wire: parse_tensors


@pytest.mark.parametrize("n_tensors, n_frames", [(0, 1), (1, 0), (2, 1), (2, 3), (3, 0)])
def test_parse_tensors_frame_count_mismatch_is_bad_frame(n_tensors, n_frames):
    descs, frames = [], []
    for i in range(max(n_tensors, n_frames)):
        d, buf = wire.encode_tensor(f"t{i}", np.full(4, i, np.float32))
        descs.append(d)
        frames.append(frame_bytes(buf))
    h = wire.unpack_header(wire.pack(wire.PUSH, descs[:n_tensors], msg=1, acks=0),
                           wire.FRONTEND_KINDS)
    expect_code(Code.BAD_FRAME, wire.parse_tensors, h, frames[:n_frames])
    assert len(wire.parse_tensors(h, frames[:n_tensors])) == n_tensors


@pytest.mark.parametrize("chain", ["raw", "fp16", "raw|zstd", "bf16|zstd"])
def test_parse_tensors_frame_length_must_match_n(chain):
    a = np.zeros(256, np.float32)
    d, buf = wire.encode_tensor("w", a, chain)
    fr = frame_bytes(buf)
    h = wire.unpack_header(wire.pack(wire.PUSH, [d], msg=1, acks=0), wire.FRONTEND_KINDS)
    assert wire.parse_tensors(h, [fr])[0].nbytes == len(fr)
    expect_code(Code.BAD_SHAPE, wire.parse_tensors, h, [fr + b"\0"])
    expect_code(Code.BAD_SHAPE, wire.parse_tensors, h, [zmq.Frame(fr[:-1])])


def test_parse_tensors_validates_every_descriptor():
    d, buf = wire.encode_tensor("w", np.zeros(4, np.float32))
    h = wire.unpack_header(wire.pack(wire.PUSH, [d, {**d, "d": "bool"}], msg=1, acks=0),
                           wire.FRONTEND_KINDS)
    expect_code(Code.BAD_DTYPE, wire.parse_tensors, h, [frame_bytes(buf)] * 2)
    h = wire.unpack_header(wire.pack(wire.PUSH, [d, {**d, "s": [1024]}], msg=1, acks=0),
                           wire.FRONTEND_KINDS)
    expect_code(Code.TOO_LARGE, wire.parse_tensors, h, [frame_bytes(buf)] * 2,
                max_tensor_bytes=1024)


# ------------------------------------------------------------------ regressions
# Each of these failed against the codecs/ of 2026-11-29 16:4x and passes since the 17:01 edit.
# (test_bf16_decode_of_every_bit_pattern[float64] above failed until the 17:39 edit.)


@pytest.mark.parametrize("kind", [[], ["push"], {"a": 1}])
def test_unhashable_kind_is_unknown_kind(kind):
    expect_code(Code.UNKNOWN_KIND, wire.unpack_header, hdr(v=1, kind=kind), wire.FRONTEND_KINDS)


@pytest.mark.parametrize("v", [True, 1.0])
def test_version_must_be_an_int(v):
    expect_code(Code.BAD_VERSION, wire.unpack_header, hdr(v=v, kind="heartbeat"),
                wire.FRONTEND_KINDS)


@pytest.mark.parametrize("shape, dtype", [
    ((0, 2**39, 2**39), "float32"), ((2**31, 2**32, 0), "float16"), ((0, 2**31, 2**30), "float64"),
    ((2**40 - 1, 2**24, 0), "uint8"),
])
def test_empty_shape_numpy_cannot_represent(shape, dtype):
    """Zero elements, but the non-zero dims overflow numpy's intp: a WireError, not ValueError."""
    expect_code(Code.BAD_SHAPE, tensor.decode, b"", "raw", dtype, shape, 1 << 20)
    d = {"k": "w", "d": dtype, "s": list(shape), "c": "raw", "n": 0, "x": wire.checksum(b"")}
    try:
        td = wire.parse_desc(d, 1 << 20)
    except WireError as e:
        assert e.code == Code.BAD_SHAPE
    else:
        expect_code(Code.BAD_SHAPE, wire.decode_tensor, td, b"", 1 << 20)


def test_bf16_to_float16_overflow_decodes_to_inf_without_warning():
    bits = np.array([0x7F00, 0xFF00, 0x4780, 0x3F80], np.uint16)  # 1.7e38, -1.7e38, 65536, 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tensor.decode(bits.tobytes(), "bf16", "float16", (4,), BIG)
    assert out.dtype == np.float16
    assert out.tolist() == [np.inf, -np.inf, np.inf, 1.0]


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i4", ">i8"])
@pytest.mark.parametrize("chain", ["raw", "raw|zstd", "bf16", "fp16|zstd"])
def test_non_native_byte_order_arrays_roundtrip(dtype, chain):
    a = np.zeros(1000, dtype)
    a[::3] = 3
    if a.dtype.kind != "f" and chain.split("|")[0] != "raw":
        expect_code(Code.BAD_CODEC, tensor.encode, a, chain)
        return
    applied, buf = tensor.encode(a, chain)
    out = tensor.decode(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    assert out.dtype.isnative and out.dtype.name == a.dtype.name
    assert np.array_equal(out, a)
    d, buf = wire.encode_tensor("w", a, chain)
    assert np.array_equal(wire.decode_tensor(wire.parse_desc(d), frame_bytes(buf)), a)


@SETTINGS
@given(a=any_bits_arrays() | any_bits_arrays().map(lambda x: x.reshape(-1)[:0].reshape(
    (0,) + x.shape[1:])), chain=st.sampled_from(["raw", "raw|zstd"]))
def test_decode_accepts_the_buffer_encode_returned(a, chain):
    """In-process use: the ndarray (or bytes) from encode goes straight back into decode."""
    applied, buf = tensor.encode(a, chain)
    out = tensor.decode(buf, applied, a.dtype.name, a.shape, BIG)
    assert same_bits(out, a)
    out = tensor.decode(memoryview(buf), applied, a.dtype.name, a.shape, BIG)
    assert same_bits(out, a)


def test_decode_of_encode_buffer_for_empty_2d_array():
    a = np.zeros((0, 3), np.float32)
    applied, buf = tensor.encode(a, "raw")
    assert tensor.decode(buf, applied, "float32", a.shape, BIG).shape == (0, 3)
    assert tensor.decode(memoryview(buf), applied, "float32", a.shape, BIG).shape == (0, 3)


# ------------------------------------------------------------------ encoder's decoded claim

ALL_CHAINS = ["raw", "raw|zstd", "fp16", "fp16|zstd", "bf16", "bf16|zstd", "int8", "sign|zstd",
              "bf16|shuffle|zstd", "topk:0.1|raw", "topk:0.5|fp16|zstd", "randomk:0.3|int8",
              "topk:1|sign|shuffle|zstd"]


@SETTINGS
@given(a=float_arrays(-1e4, 1e4), chain=st.sampled_from(ALL_CHAINS))
def test_want_decoded_is_what_decode_returns(a, chain):
    """encode(..., want_decoded=True) promises bit for bit what decode gives the receiver."""
    rng = np.random.default_rng(0)  # int8 / randomk: the same draws when hypothesis replays
    applied, buf, claimed = tensor.encode(a, chain, rng=rng, want_decoded=True)
    out = tensor.decode(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    assert claimed.shape == out.shape and claimed.dtype == out.dtype
    assert same_bits(claimed, out)


@pytest.mark.parametrize("chain", ["raw", "bf16", "int8", "topk:1|raw"])
def test_want_decoded_shape_of_0d_tensor(chain):
    """Failed against the 17:39 tensor.py (np.ascontiguousarray made the 0-d array 1-d and the
    claimed array came back with shape (1,)); fixed at 17:43."""
    a = np.array(1.5, np.float32)
    applied, buf, claimed = tensor.encode(a, chain, want_decoded=True)
    out = tensor.decode(frame_bytes(buf), applied, "float32", a.shape, BIG)
    assert out.shape == ()
    assert claimed.shape == out.shape, claimed.shape

