"""Tests of the lossy codec stages of gradbus.codecs.tensor: the chain grammar, topk/randomk,
int8, sign, the fast fp16/bf16 paths, shuffle, ``want_decoded``, ``decode_sparse``, and decoding of
corrupt payloads (only WireError may come out).

Frames are handed to the decoders as ``bytes``, as a ZeroMQ receiver gets them.
"""
from __future__ import annotations

import functools
import math
import tracemalloc
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradbus.codecs import jit, tensor, values, wire
from gradbus.codecs.errors import Code, WireError

from .rigs import JIT_PATHS, jit_path

SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BIG = 1 << 30
FLOAT_DTYPES = (np.float16, np.float32, np.float64)
SHAPES = hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=40)
LOSSY_CHAINS = ["fp16", "bf16", "int8", "sign", "int8|zstd", "fp16|shuffle|zstd", "topk:0.01",
                "topk:0.1|bf16", "topk:0.01|int8|zstd", "topk:0.3|sign|shuffle", "randomk:0.5",
                "randomk:0.5|fp16|zstd", "randomk:1|int8|shuffle|zstd", "topk:0.2|raw|shuffle|zstd"]
EXACT_CHAINS = ["raw", "raw|shuffle|zstd", "raw|shuffle", "shuffle|zstd", "zstd"]


def frame_bytes(buf) -> bytes:
    return memoryview(buf).tobytes()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.itemsize}")


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(bits(x), bits(y))


def expect_code(code: Code, fn, *args, **kw):
    with pytest.raises(WireError) as ei:
        fn(*args, **kw)
    assert ei.value.code == code, f"got {ei.value.code}: {ei.value}"
    return ei.value


def roundtrip(a: np.ndarray, chain: str, rng=None):
    """Encode with want_decoded, decode the bytes; check they agree bit for bit."""
    applied, buf, decoded = tensor.encode(a, chain, rng=rng, want_decoded=True)
    out = tensor.decode(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    assert out.dtype == a.dtype.newbyteorder("=") and out.shape == a.shape
    assert same_bits(decoded, out), chain
    return applied, buf, out


def kept(n: int, chain: str) -> int:
    return math.ceil(Fraction(chain.split("|")[0].split(":")[1]) * n)


@st.composite
def float_arrays(draw, dtypes=FLOAT_DTYPES, lo=-1e3, hi=1e3, shapes=SHAPES):
    dt = np.dtype(draw(st.sampled_from(dtypes)))
    elements = st.floats(float(dt.type(lo)), float(dt.type(hi)), width=8 * dt.itemsize,
                         allow_nan=False, allow_infinity=False)
    fill = draw(st.sampled_from([None, st.just(0.0)]))
    return draw(hnp.arrays(dt, draw(shapes), elements=elements, fill=fill))


# ------------------------------------------------------------------ chain grammar


@pytest.mark.parametrize("chain, want", [
    ("topk:0.01", ("topk:0.01", Fraction(1, 100), "raw", False, False)),
    ("randomk:1|int8", ("randomk:1", Fraction(1), "int8", False, False)),
    ("topk:.5|sign|shuffle|zstd", ("topk:.5", Fraction(1, 2), "sign", True, True)),
    (" topk:1e-3 | bf16 | zstd ", ("topk:1e-3", Fraction(1, 1000), "bf16", False, True)),
    ("raw|shuffle|zstd", (None, None, "raw", True, True)),
    ("shuffle", (None, None, "raw", True, False)),
    ("int8|zstd", (None, None, "int8", False, True)),
    ("", (None, None, "raw", False, False)),
])
def test_parse_stages_valid(chain, want):
    s = tensor.parse_stages(chain)
    assert (s.sparse, s.fraction, s.coder, s.shuffle, s.zstd) == want
    assert tensor.parse_chain(chain) == (want[2], want[4])


@pytest.mark.parametrize("chain", [
    "topk", "topk:", "topk:0", "topk:0.0", "topk:1.5", "topk:-0.1", "topk:nan", "topk:inf",
    "topk:1e", "topk:0x1", "topk:1_0", "topk:0.1:2", "topk:1e-9999", "randomk:2", "raw:1",
    "zstd:1", "top:0.1",                                                      # bad fraction/name
    "int8|topk:0.1", "zstd|shuffle", "shuffle|int8", "raw|zstd|shuffle",      # out of order
    "topk:0.1|topk:0.2", "topk:0.1|randomk:0.1", "int8|sign", "int8|fp16", "sign|raw",
    "raw|shuffle|shuffle", "shuffle|shuffle|zstd", "topk:0.1|int8|zstd|zstd",  # repeated
    "topk:0.1|int8|shuffle|zstd|x", "delta", "delta|int8", "int4",             # unknown
    "topk:0.000000000000000000000000000000000000000000000000000000001|raw",   # above 64 chars
])
def test_bad_chains_are_bad_codec(chain):
    expect_code(Code.BAD_CODEC, tensor.parse_stages, chain)
    expect_code(Code.BAD_CODEC, tensor.encode, np.zeros(4, np.float32), chain)
    expect_code(Code.BAD_CODEC, tensor.decode, b"", chain, "float32", (0,), BIG)
    expect_code(Code.BAD_CODEC, tensor.encoded_len_fixed, chain, "float32", (4,))


STAGE_WORDS = ["topk:0.1", "randomk:0.5", "topk:2", "raw", "fp16", "bf16", "int8", "sign",
               "shuffle", "zstd", "x"]


@SETTINGS
@given(parts=st.lists(st.sampled_from(STAGE_WORDS), max_size=5))
def test_parse_either_follows_the_grammar_or_raises(parts):
    chain = "|".join(parts)
    try:
        s = tensor.parse_stages(chain)
    except WireError as e:
        assert e.code == Code.BAD_CODEC
        return
    rank = [0 if ":" in p else 1 if p in tensor.PRECISION else 2 if p == "shuffle" else 3
            for p in parts]
    assert rank == sorted(set(rank)) and "x" not in parts and "topk:2" not in parts
    assert s.text(s.shuffle, s.zstd) == "|".join(
        p for p in [s.sparse, s.coder] + ["shuffle"] * s.shuffle + ["zstd"] * s.zstd if p)


@pytest.mark.parametrize("chain, lossy", [
    ("raw", False), ("", False), ("zstd", False), ("raw|shuffle|zstd", False), ("shuffle", False),
    ("fp16", True), ("bf16|zstd", True), ("int8", True), ("sign|shuffle", True),
    ("topk:1", True), ("randomk:0.5|raw|zstd", True),
])
def test_is_lossy(chain, lossy):
    assert tensor.is_lossy(chain) is lossy


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
@pytest.mark.parametrize("chain", ["int8", "sign|zstd", "topk:0.5", "randomk:0.5|raw",
                                   "topk:0.1|int8|zstd"])
def test_integer_tensors_refuse_lossy_stages(dtype, chain):
    a = np.arange(600, dtype=dtype)
    expect_code(Code.BAD_CODEC, tensor.encode, a, chain)
    _, buf = tensor.encode(a.astype(np.float32), chain)
    expect_code(Code.BAD_CODEC, tensor.decode, frame_bytes(buf), chain, dtype, a.shape, BIG)


@pytest.mark.parametrize("dtype", ["int32", "uint8", "float16", "float64"])
def test_shuffle_is_exact_for_every_dtype(dtype):
    a = (np.arange(3000) % 251).astype(dtype)
    applied, _, out = roundtrip(a, "raw|shuffle|zstd")
    assert applied == "raw|shuffle|zstd"
    assert np.array_equal(out, a)


# ------------------------------------------------------------------ topk / randomk


@SETTINGS
@given(a=float_arrays(), f=st.sampled_from(["0.01", "0.1", "0.5", "1"]),
       coder=st.sampled_from(["", "|raw|zstd", "|raw|shuffle"]))
def test_topk_keeps_exactly_the_k_largest_magnitudes(a, f, coder):
    chain = f"topk:{f}{coder}"
    applied, buf, out = roundtrip(a, chain)
    n, k = a.size, kept(a.size, chain)
    idx, values = tensor.decode_sparse(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    flat, dense = a.reshape(-1), out.reshape(-1)
    assert len(idx) == k and idx.dtype == np.int64
    assert np.all(np.diff(idx) > 0) and (k == 0 or 0 <= idx[0] and idx[-1] < n)
    assert same_bits(values, flat[idx])                   # raw values: exact
    assert same_bits(dense[idx], flat[idx])
    dropped = np.ones(n, bool)
    dropped[idx] = False
    assert np.all(dense[dropped] == 0)
    if k and dropped.any():
        assert np.abs(flat[idx]).min() >= np.abs(flat[dropped]).max()


@pytest.mark.parametrize("case", ["gaussian", "sample-misleads", "ties", "nan"])
def test_topk_large_tensors_match_a_full_argpartition(case):
    """Above 2**18 elements topk narrows candidates by a sampled threshold; the result must still
    be exactly the k largest magnitudes, also where the strided sample is unrepresentative."""
    rng = np.random.default_rng(7)
    n = 1 << 18
    a = rng.standard_normal(n).astype(np.float32)
    f = "0.01"
    if case == "sample-misleads":      # the strided sample sees only the large values
        a *= 1e-3
        a[::4] = 10 + rng.random(n // 4)
        f = "0.0625"
    elif case == "ties":
        a = np.round(a).astype(np.float32)
    elif case == "nan":
        a[rng.choice(n, 50, replace=False)] = np.nan
    chain = f"topk:{f}"
    k = kept(n, chain)
    _, buf = tensor.encode(a, chain)
    idx, values = tensor.decode_sparse(frame_bytes(buf), f"{chain}|raw", "float32", (n,), BIG)
    assert len(idx) == k and np.all(np.diff(idx) > 0)
    mag = np.abs(a)
    want = np.sort(mag[np.argpartition(mag, n - k)[n - k:]])
    assert same_bits(np.sort(np.abs(values)), want)       # NaN sorts last in both
    if case == "nan":
        assert np.isnan(values).sum() == 50


@SETTINGS
@given(a=float_arrays(dtypes=(np.float32, np.float64)), f=st.sampled_from(["0.01", "0.5", "1"]),
       seed=st.integers(0, 2**32 - 1))
def test_randomk_keeps_k_entries_exactly(a, f, seed):
    chain = f"randomk:{f}"
    applied, buf, out = roundtrip(a, chain, rng=np.random.default_rng(seed))
    idx, values = tensor.decode_sparse(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    assert len(idx) == kept(a.size, chain) and np.all(np.diff(idx) > 0)
    assert same_bits(values, a.reshape(-1)[idx])
    rest = np.ones(a.size, bool)
    rest[idx] = False
    assert np.all(out.reshape(-1)[rest] == 0)
    # the same seed gives the same frame
    again = tensor.encode(a, chain, rng=np.random.default_rng(seed))[1]
    assert frame_bytes(again) == frame_bytes(buf)


def test_randomk_subset_is_uniform():
    n, draws, f = 64, 2000, 0.25
    rng = np.random.default_rng(3)
    counts = np.zeros(n)
    a = np.arange(1, n + 1, dtype=np.float32)
    for _ in range(draws):
        applied, buf = tensor.encode(a, f"randomk:{f}", rng=rng)
        idx, _ = tensor.decode_sparse(frame_bytes(buf), applied, "float32", (n,), BIG)
        counts[idx] += 1
    sd = math.sqrt(draws * f * (1 - f))
    assert np.all(np.abs(counts - draws * f) < 5 * sd), counts


# ------------------------------------------------------------------ int8


def int8_scales(buf: bytes, n: int) -> np.ndarray:
    return np.frombuffer(buf, np.float32, -(-n // tensor.INT8_BLOCK))


@SETTINGS
@given(a=float_arrays(shapes=hnp.array_shapes(min_dims=1, max_dims=2, max_side=700)))
def test_int8_error_is_at_most_one_step(a):
    applied, buf, out = roundtrip(a, "int8")
    assert applied == "int8"
    frame = frame_bytes(buf)
    assert len(frame) == tensor.encoded_len_fixed("int8", a.dtype.name, a.shape)
    scale = np.repeat(int8_scales(frame, a.size).astype(np.float64), tensor.INT8_BLOCK)[:a.size]
    x = a.reshape(-1).astype(np.float64)
    err = np.abs(out.reshape(-1).astype(np.float64) - x)
    # one quantum, plus the rounding to float32 (float64 input, which may underflow) and of the
    # decoded value (float16 output)
    rel, tiny = (2.0**-10, 2.0**-24) if a.dtype == np.float16 else (2.0**-23, 2.0**-149)
    assert np.all(err <= scale * (1 + rel) + np.abs(x) * rel + tiny)
    absmax = np.maximum.reduceat(np.abs(x), np.arange(0, a.size, tensor.INT8_BLOCK)) if a.size \
        else np.zeros(0)
    assert np.allclose(int8_scales(frame, a.size), absmax / 127, rtol=2.0**-22, atol=2.0**-149)


def test_int8_is_unbiased():
    """The mean of many decodes of a fixed vector is within a few standard errors of it."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(300) * np.exp(rng.uniform(-3, 3, 300))).astype(np.float32)
    draws = 2000
    total = np.zeros(x.size)
    square = np.zeros(x.size)
    for _ in range(draws):
        _, buf, dec = tensor.encode(x, "int8", rng=rng, want_decoded=True)
        total += dec
        square += dec.astype(np.float64) ** 2
    mean = total / draws
    scale = np.repeat(int8_scales(frame_bytes(buf), x.size), tensor.INT8_BLOCK)[:x.size]
    frac = np.abs(x / scale.astype(np.float64)) % 1
    se = scale * np.sqrt(frac * (1 - frac) / draws)   # a two-point distribution
    assert np.all(np.abs(mean - x) <= 5 * se + 1e-6 * scale)
    assert np.all((square / draws - mean**2)[frac > 0.01] > 0)   # it does round both ways


@pytest.mark.parametrize("n", [tensor.INT8_BLOCK * 3, (1 << 16) * 2 + 300])
def test_int8_across_chunks_and_partial_blocks(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    x[: tensor.INT8_BLOCK] = 0                          # an all-zero block: scale 0, exact
    _, buf, out = roundtrip(x, "int8")
    scale = np.repeat(int8_scales(frame_bytes(buf), n), tensor.INT8_BLOCK)[:n]
    assert np.all(np.abs(out - x) <= scale * (1 + 2.0**-20))
    assert np.all(out[: tensor.INT8_BLOCK] == 0) and int8_scales(frame_bytes(buf), n)[0] == 0


def test_int8_tiny_values_keep_a_nonzero_scale():
    x = np.array([1e-45, -3e-45, 1e-44, 0], np.float32)  # absmax / 127 underflows
    _, _, out = roundtrip(x, "int8")
    assert np.all(np.abs(out - x) <= 2.0**-149)


# ------------------------------------------------------------------ sign


def block_mean_abs(x: np.ndarray, block: int) -> np.ndarray:
    mag = np.abs(x.astype(np.float32).astype(np.float64))
    starts = np.arange(0, x.size, block)
    return (np.add.reduceat(mag, starts) / np.diff(np.append(starts, x.size))).astype(np.float32)


@SETTINGS
@given(a=float_arrays(shapes=hnp.array_shapes(min_dims=1, max_dims=2, max_side=1500),
                      dtypes=(np.float32, np.float64)))
def test_sign_decodes_to_sign_times_block_mean(a):
    applied, buf, out = roundtrip(a, "sign")
    assert applied == "sign"
    assert len(frame_bytes(buf)) == tensor.encoded_len_fixed("sign", a.dtype.name, a.shape)
    x = a.reshape(-1)
    if not x.size:
        return
    scale = np.repeat(block_mean_abs(x, tensor.SIGN_BLOCK), tensor.SIGN_BLOCK)[:x.size]
    want = np.where(np.signbit(x.astype(np.float32)), -scale, scale).astype(a.dtype)
    assert np.array_equal(np.signbit(out.reshape(-1)), np.signbit(want))
    assert np.allclose(out.reshape(-1), want, rtol=1e-6, atol=0)


def test_sign_frame_layout():
    x = np.array([1, -2, 3, -4, 0.0, -0.0, 5, -6, 7], np.float32)
    applied, buf, out = roundtrip(x, "sign")
    frame = frame_bytes(buf)
    assert len(frame) == 4 + 2
    assert np.frombuffer(frame[:4], np.float32)[0] == np.float32(28 / 9)
    assert frame[4:] == bytes([0b01010101, 0b00000000])   # sign bits, first value first
    assert np.array_equal(out, np.float32(28 / 9) * np.array([1, -1, 1, -1, 1, -1, 1, -1, 1]))


# ------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize("chain", ["int8", "sign", "fp16", "bf16", "topk:0.5", "topk:0.5|int8",
                                   "randomk:1|sign"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_stay_non_finite(chain, bad):
    x = np.linspace(-1, 1, 600, dtype=np.float32)
    x[300] = bad
    _, _, out = roundtrip(x, chain)
    assert not np.isfinite(out[300])
    if chain == "int8":   # the whole block is NaN, the others are untouched
        block = slice(256, 512)
        assert np.isnan(out[block]).all() and np.isfinite(np.delete(out, np.r_[block])).all()


# ------------------------------------------------------------------ fp16 / bf16 fast paths


@st.composite
def float32_bit_patterns(draw):
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**32, n, dtype=np.uint32)
    # bias towards half's range, its edges and ties: exponents 100..145, low bits 0x1000/0x0FFF
    exp = rng.integers(100, 146, n, dtype=np.uint32) << np.uint32(23)
    near = (u & np.uint32(0x807FFFFF)) | exp
    tie = near & np.uint32(0xFFFFE000) | np.uint32(0x1000)
    pick = rng.integers(0, 3, n)
    return np.where(pick == 0, u, np.where(pick == 1, near, tie)).view(np.float32)


@SETTINGS
@pytest.mark.parametrize("path", JIT_PATHS)
@given(a=float32_bit_patterns())
def test_fp16_fast_path_is_bit_equal_to_numpy_cast(path, a):
    with jit_path(path):
        applied, buf, out = roundtrip(a, "fp16")
    got = np.frombuffer(frame_bytes(buf), np.uint16)
    with np.errstate(over="ignore"):
        want = a.astype(np.float16).view(np.uint16)
    nan = np.isnan(a)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(got[nan] & 0x7FFF == 0x7E00)
    assert np.array_equal(got[nan] >> 15, bits(a)[nan] >> 31)   # the sign is kept


@pytest.mark.parametrize("path", JIT_PATHS)
def test_fp16_fast_path_on_every_exponent_across_chunks(path):
    rng = np.random.default_rng(5)
    n = (1 << 16) * 3 + 17
    u = rng.integers(0, 2**32, n, dtype=np.uint32)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x477FE000, 0x477FF000,
                         0x477FEFFF, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x33800000,
                         0x7F7FFFFF, 1], np.uint32)
    u[:len(specials)] = specials
    a = u.view(np.float32)
    with jit_path(path):
        got = values._fp16_encode(a)
    with np.errstate(over="ignore"):
        want = a.astype(np.float16).view(np.uint16)
    nan = np.isnan(a)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(tensor.decode(got.tobytes(), "fp16", "float32", (n,), BIG)[nan]).all()


@SETTINGS
@pytest.mark.parametrize("path", JIT_PATHS)
@given(a=float32_bit_patterns())
def test_bf16_fast_path_matches_the_reference_rounding(path, a):
    u = bits(a).astype(np.uint64)
    want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    with jit_path(path):
        got = values._bf16_encode(a)
    nan = np.isnan(a)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all((got[nan] & 0x7F80) == 0x7F80) and np.all(got[nan] & 0x7F)


@SETTINGS
@given(a=float_arrays(lo=-6e4, hi=6e4), chain=st.sampled_from(
    ["fp16", "topk:0.5|fp16", "randomk:0.5|fp16|zstd", "fp16|shuffle|zstd"]))
def test_fp16_chains_relative_error(a, chain):
    _, _, out = roundtrip(a, chain)
    x = a.astype(np.float64).reshape(-1)
    y = out.astype(np.float64).reshape(-1)
    sent = y != 0 if "k:" in chain else np.ones(x.size, bool)
    err = np.abs(y - x)[sent]
    assert np.all(err <= np.maximum(np.abs(x[sent]) * 2.0**-11, 2.0**-25))


@SETTINGS
@given(a=float_arrays(dtypes=(np.float32, np.float64), lo=-1e30, hi=1e30), chain=st.sampled_from(
    ["bf16", "topk:0.1|bf16", "bf16|shuffle|zstd"]))
def test_bf16_chains_relative_error(a, chain):
    _, _, out = roundtrip(a, chain)
    x = a.astype(np.float64).reshape(-1)
    y = out.astype(np.float64).reshape(-1)
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    if "k:" in chain:
        normal &= y != 0
    assert np.all(np.abs(y - x)[normal] <= np.abs(x[normal]) * 2.0**-8)


# ------------------------------------------------------------------ chains, want_decoded


@SETTINGS
@given(a=float_arrays(), chain=st.sampled_from(LOSSY_CHAINS + EXACT_CHAINS),
       seed=st.integers(0, 2**32 - 1), big_endian=st.booleans())
def test_want_decoded_is_what_the_receiver_decodes(a, chain, seed, big_endian):
    if big_endian:
        a = a.astype(a.dtype.newbyteorder(">"))
    applied, buf, out = roundtrip(a, chain, rng=np.random.default_rng(seed))
    assert out.dtype.isnative and out.dtype.name == a.dtype.name
    assert tensor.is_lossy(applied) == tensor.is_lossy(chain)
    if not tensor.is_lossy(chain):
        assert same_bits(out, a.astype(out.dtype))
    idx, values = tensor.decode_sparse(frame_bytes(buf), applied, a.dtype.name, a.shape, BIG)
    if tensor.parse_stages(chain).sparse:
        dense = np.zeros(a.size, out.dtype)
        dense[idx] = values
        assert same_bits(dense.reshape(a.shape), out)
    else:
        assert idx is None and same_bits(values, out)


@pytest.mark.parametrize("chain", ["topk:0.01|int8|zstd", "topk:0.1|bf16", "randomk:0.5|fp16|zstd",
                                   "raw|shuffle|zstd", "int8|zstd", "sign|zstd", "bf16|zstd"])
@pytest.mark.parametrize("shape", [(0,), (), (1,), (3, 0), (5,), (1000, 3)])
def test_named_chains_on_small_and_empty_tensors(chain, shape):
    a = np.asarray(np.random.default_rng(1).standard_normal(shape), np.float32)
    applied, buf, out = roundtrip(a, chain)
    st_ = tensor.parse_stages(chain)
    assert applied.startswith(st_.text(False, False))
    if chain == "raw|shuffle|zstd":
        assert same_bits(out, a)


def test_gradient_chains_compress_as_intended():
    g = (np.random.default_rng(2).standard_normal(1 << 16) * 1e-3).astype(np.float32)
    sizes = {}
    for chain in ["topk:0.01|int8|zstd", "topk:0.01", "int8", "sign", "bf16", "raw|zstd"]:
        applied, buf, out = roundtrip(g, chain)
        sizes[chain] = len(frame_bytes(buf))
    k = kept(g.size, "topk:0.01")
    # varint gaps of ~100 take under 1.5 bytes where int32 indices would take 4
    assert sizes["topk:0.01"] < 16 + k * (4 + 1.5)
    assert sizes["topk:0.01|int8|zstd"] < 16 + k * (1 + 1.5) + 4 * (k // 256 + 1)
    assert sizes["int8"] == g.size + 4 * (g.size // tensor.INT8_BLOCK)
    assert sizes["sign"] == g.size // 8 + 4 * (g.size // tensor.SIGN_BLOCK)
    assert sizes["raw|zstd"] == g.nbytes    # float32 gradients barely compress: zstd dropped


def test_shuffle_is_dropped_with_zstd_and_kept_alone():
    noise = np.random.default_rng(4).integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32)
    applied, buf = tensor.encode(noise, "raw|shuffle|zstd")
    assert applied == "raw" and frame_bytes(buf) == noise.tobytes()
    applied, buf = tensor.encode(noise, "raw|shuffle")
    assert applied == "raw|shuffle" and frame_bytes(buf) == noise.view(np.uint8).reshape(
        -1, 4).T.tobytes()
    smooth = np.linspace(0, 1, 5000, dtype=np.float32)
    applied, buf = tensor.encode(smooth, "raw|shuffle|zstd")
    assert applied == "raw|shuffle|zstd"
    assert len(buf) * tensor.ZSTD_MIN_GAIN <= smooth.nbytes
    assert len(buf) < len(tensor.encode(smooth, "raw|zstd")[1])


@pytest.mark.parametrize("chain", LOSSY_CHAINS + EXACT_CHAINS)
def test_wire_roundtrip_of_lossy_chains(chain):
    a = np.random.default_rng(6).standard_normal((40, 30)).astype(np.float32)
    d, buf = wire.encode_tensor("w", a, chain)
    desc = wire.parse_desc(d)          # encoded_len_fixed agrees with dense fixed-size frames
    fixed = tensor.encoded_len_fixed(d["c"], "float32", a.shape)
    assert fixed is None or fixed == d["n"]
    out = wire.decode_tensor(desc, frame_bytes(buf))
    assert out.shape == a.shape and out.dtype == a.dtype


def test_encoded_len_fixed():
    assert tensor.encoded_len_fixed("int8", "float32", (1000,)) == 1000 + 4 * 4
    assert tensor.encoded_len_fixed("sign|shuffle", "float64", (10, 205)) == 257 + 4 * 3
    assert tensor.encoded_len_fixed("raw|shuffle", "float64", (3,)) == 24
    for chain in ["topk:0.1", "randomk:1|int8", "int8|zstd", "raw|shuffle|zstd"]:
        assert tensor.encoded_len_fixed(chain, "float32", (1000,)) is None


# ------------------------------------------------------------------ decode validation


def sparse_frame(k: int, index: bytes, values: bytes) -> bytes:
    return np.array([k, len(index)], "<u8").tobytes() + index + values


@pytest.mark.parametrize("frame, code", [
    (b"", Code.BAD_SHAPE),                                                # no header
    (b"\0" * 15, Code.BAD_SHAPE),
    (sparse_frame(11, b"\0" * 11, b"\0" * 44), Code.BAD_SHAPE),           # count above n
    (sparse_frame(2, b"\0\0", b"\0" * 4), Code.BAD_SHAPE),                # values short
    (sparse_frame(2, b"\0\0", b"\0" * 12), Code.BAD_SHAPE),               # values long
    (sparse_frame(2, b"\x80\0", b"\0" * 8), Code.BAD_CODEC),              # one varint for two
    (sparse_frame(2, b"\0\x80", b"\0" * 8), Code.BAD_CODEC),              # unterminated
    (sparse_frame(1, b"\x89\0", b"\0" * 4), Code.BAD_CODEC),              # overlong for n=10
    (sparse_frame(2, b"\x05\x04", b"\0" * 8), Code.BAD_CODEC),            # 5, then 10: past n
    (sparse_frame(1, b"\x0a", b"\0" * 4), Code.BAD_CODEC),                # index 10 of 10
    (sparse_frame(0, b"\0", b""), Code.BAD_CODEC),                        # bytes for no index
    (np.array([1, 2**64 - 1], "<u8").tobytes() + b"\0" * 8, Code.BAD_SHAPE),
    (np.array([2**63, 1], "<u8").tobytes() + b"\0" * 8, Code.BAD_SHAPE),
])
def test_corrupt_sparse_frames(frame, code):
    for fn in (tensor.decode, tensor.decode_sparse):
        expect_code(code, fn, frame, "topk:0.5|raw", "float32", (10,), BIG)


def test_handmade_sparse_frame():
    values = np.array([1, 2, 3], np.float32).tobytes()
    frame = sparse_frame(3, bytes([2, 0, 0x83, 0x01]), values)   # gaps 2, 0, 131
    idx, vals = tensor.decode_sparse(frame, "topk:0.5", "float32", (200,), BIG)
    assert idx.tolist() == [2, 3, 135] and vals.tolist() == [1, 2, 3]
    out = tensor.decode(frame, "topk:0.5", "float32", (200,), BIG)
    assert out[[2, 3, 135]].tolist() == [1, 2, 3] and np.count_nonzero(out) == 3
    expect_code(Code.BAD_CODEC, tensor.decode, frame, "topk:0.5", "float32", (135,), BIG)


def test_huge_claims_are_refused_without_allocating():
    n = 1 << 22
    bomb = zstandard.ZstdCompressor().compress(bytes(10 * n))   # content size above any valid one
    tracemalloc.start()
    try:
        for chain in ["topk:1|raw", "randomk:1|int8", "topk:1|sign"]:
            claim = np.array([n, 0], "<u8").tobytes()        # n values, nothing sent
            expect_code(Code.BAD_SHAPE, tensor.decode, claim, chain, "float32", (n,), 4 * n)
            expect_code(Code.TOO_LARGE, tensor.decode, claim, chain, "float32", (n,), 1 << 20)
        for chain in ["topk:1|raw|zstd", "int8|zstd", "sign|shuffle|zstd"]:
            expect_code(Code.BAD_SHAPE, tensor.decode, bomb, chain, "float32", (n,), 4 * n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_sparse_chains_refuse_2_to_the_31_elements():
    expect_code(Code.BAD_CODEC, tensor.decode, b"", "topk:0.1", "float32", (2**31,), 1 << 40)


# ------------------------------------------------------------------ fuzz: corrupt payloads


FUZZ_SHAPES = {"float32": (37, 23), "float64": (300,), "float16": (5, 7)}


@functools.cache
def valid_frames() -> list[tuple[str, str, tuple, bytes, bytes]]:
    """(applied chain, dtype, shape, frame, uncompressed payload) for every lossy chain."""
    out = []
    rng = np.random.default_rng(9)
    for chain in LOSSY_CHAINS + ["raw|shuffle", "topk:0.05|raw|shuffle"]:
        for dtype, shape in FUZZ_SHAPES.items():
            a = rng.standard_normal(shape).astype(dtype)
            a.reshape(-1)[::3] = 0      # compressible enough to keep zstd
            applied, buf = tensor.encode(a, chain, rng=rng)
            frame = frame_bytes(buf)
            payload = zstandard.ZstdDecompressor().decompress(frame) if applied.endswith(
                "zstd") else frame
            out.append((applied, dtype, shape, frame, payload))
    return out


@st.composite
def mutated(draw, data: bytes) -> bytes:
    op = draw(st.sampled_from(["flip", "truncate", "extend", "splice", "header", "varint"]))
    b = bytearray(data)
    if op == "flip" and b:
        for _ in range(draw(st.integers(1, 4))):
            b[draw(st.integers(0, len(b) - 1))] ^= draw(st.integers(1, 255))
    elif op == "truncate":
        del b[draw(st.integers(0, len(b))):]
    elif op == "extend":
        b += draw(st.binary(min_size=1, max_size=32))
    elif op == "splice" and b:
        i = draw(st.integers(0, len(b)))
        j = draw(st.integers(i, min(len(b), i + 40)))
        b[i:j] = draw(st.binary(max_size=40))
    elif op == "header" and len(b) >= 16:
        field = draw(st.sampled_from([0, 8]))
        value = draw(st.sampled_from([0, 1, 2, 7, 851, 852, 2**31, 2**32 + 1, 2**63, 2**64 - 1])
                     | st.integers(0, 2**64 - 1))
        b[field:field + 8] = value.to_bytes(8, "little")
    elif op == "varint" and len(b) > 16:
        i = draw(st.integers(16, min(len(b) - 1, 64)))
        b[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
    return bytes(b)


@st.composite
def corrupt_frames(draw):
    applied, dtype, shape, frame, payload = draw(st.sampled_from(valid_frames()))
    how = draw(st.sampled_from(["frame", "payload", "payload", "chain"]))
    chain = applied
    if how == "payload" and applied.endswith("zstd"):   # get past zstd to the payload parser
        frame = zstandard.ZstdCompressor(write_content_size=draw(st.booleans())).compress(
            draw(mutated(payload)))
    elif how == "chain":                                # a frame decoded with another chain
        chain = draw(st.sampled_from(LOSSY_CHAINS + EXACT_CHAINS))
    else:
        frame = draw(mutated(frame))
    max_bytes = draw(st.sampled_from([BIG, math.prod(shape) * np.dtype(dtype).itemsize]))
    return frame, chain, dtype, shape, max_bytes


@settings(SETTINGS, max_examples=500)
@given(case=corrupt_frames())
def test_fuzz_decode_of_corrupt_payloads(case):
    frame, chain, dtype, shape, max_bytes = case
    for fn in (tensor.decode, tensor.decode_sparse):
        try:
            out = fn(frame, chain, dtype, shape, max_bytes)
        except WireError as e:
            assert e.code in (Code.BAD_CODEC, Code.BAD_SHAPE), e
            continue
        if fn is tensor.decode:
            assert out.shape == shape and out.dtype == dtype
        else:
            idx, values = out
            assert values.dtype == dtype
            if idx is not None:
                n = math.prod(shape)
                assert len(idx) == len(values) <= n and np.all(np.diff(idx) > 0)
                assert len(idx) == 0 or (idx[0] >= 0 and idx[-1] < n)


def test_int8_subnormal_block_keeps_its_bound():
    """A block whose absmax/127 is subnormal: the scale is rounded up, so the largest value is
    still reachable (found by the property test above: 6.15e-43 decoded 13% off)."""
    a = np.array([6.15e-43, -3e-43, 1e-44], np.float32)
    _, buf, out = roundtrip(a, "int8")
    scale = float(int8_scales(frame_bytes(buf), a.size)[0])
    assert scale * 127 >= 6.15e-43
    assert np.all(np.abs(out.astype(np.float64) - a) <= scale * (1 + 2.0**-23) + 2.0**-149)


def test_a_numba_that_cannot_compile_leaves_the_numpy_path(monkeypatch):
    pytest.importorskip("numba")

    def broken(*a):
        raise RuntimeError("no LLVM here")
    monkeypatch.setattr(jit, "_compile", broken)
    assert jit.loops.__wrapped__() is None


def test_jit_is_off_with_gradbus_jit_0(monkeypatch):
    monkeypatch.setenv(jit.ENV, "0")
    assert jit.loops.__wrapped__() is None
    a = np.array([1.0, np.nan, 3.0e-6, 70000.0], np.float32)
    with mock.patch.object(jit, "loops", jit.loops.__wrapped__):
        assert values._fp16_encode(a).tolist() == [0x3C00, 0x7E00, 0x0032, 0x7C00]
        assert values._bf16_encode(a).tolist() == [0x3F80, 0x7FC0, 0x3649, 0x4789]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", ["bf16", "fp16"])
def test_one_pass_add_equals_reading_the_pieces(chain, dtype):
    """``Pieces.add_into`` (numba) sets or adds, scaled or not, the same bits as reading the
    pieces and adding them with numpy, NaN and inf included."""
    pytest.importorskip("numba")
    n = 3 * jit.SCRATCH + 5
    rng = np.random.default_rng(3)
    a = rng.normal(size=n).astype(dtype)
    a[[0, 7, n - 1]] = [np.nan, np.inf, -1e-30]
    _, buf = tensor.encode(a, chain)
    frame = frame_bytes(buf)
    base = rng.normal(size=n).astype(dtype)
    for first in (True, False):
        for w in (None, np.asarray(0.3, dtype)):
            pieces = tensor.pieces(frame, chain, np.dtype(dtype).name, (n,), BIG)
            v = pieces.values(pieces.encoded(0, n), np.empty(n, dtype))
            v = v * w if w is not None else v
            want = v.copy() if first else base + v
            got = base.copy()
            assert pieces.add_into(got, first, w)
            assert same_bits(got, want), (first, w)


def test_one_pass_add_declines_what_it_cannot_take():
    pytest.importorskip("numba")
    a = np.arange(10, dtype=np.float32)
    _, buf = tensor.encode(a, "bf16")
    frame = frame_bytes(buf)
    pieces = tensor.pieces(frame, "bf16", "float32", (10,), BIG)
    out = np.zeros(20, np.float32)
    assert not pieces.add_into(out[::2], True, None)            # not contiguous
    assert not pieces.add_into(np.zeros(10, np.float16), True, None)
    assert not pieces.add_into(np.zeros(9, np.float32), True, None)
    odd = np.frombuffer(b"\0" + frame, np.uint8)[1:]            # codes at an odd address
    assert not tensor.pieces(odd, "bf16", "float32", (10,), BIG).add_into(out[:10], True, None)
    _, raw = tensor.encode(a, "raw")
    assert not tensor.pieces(frame_bytes(raw), "raw", "float32", (10,), BIG).add_into(
        out[:10], True, None)
    assert np.all(out == 0)
    with mock.patch.object(jit, "loops", lambda: None):
        assert not pieces.add_into(out[:10], True, None)
    assert pieces.add_into(out[:10], True, None) and np.array_equal(out[:10], a)
