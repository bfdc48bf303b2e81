"""Passes over a gradient's bytes folded into one: the shard's SGD step taken while its
gradients are read (checksummed, summed, checked finite), and the client's ring copy hashed as
it copies. Both must give the bits, and refuse the inputs, of the separate passes."""
from __future__ import annotations

import numpy as np
import pytest

from gradbus.codecs import shm, wire
from gradbus.codecs.shm_writers import HASH_PIECE
from gradbus.shards.backend import NumpyBackend

numba_only = pytest.mark.skipif(NumpyBackend().fused is None, reason="numba is not installed")

CHUNK = 4096                                  # bytes per piece: several pieces per gradient


def _reads(frames: list, scales=None) -> tuple[list, list]:
    """``(reads, streams)`` of frames (as :func:`wire.encode_tensor` gives them)."""
    streams = [wire.stream_tensor(wire.parse_desc(d), f) for d, f in frames]
    scales = scales or [None] * len(frames)
    return [(s.read, w) for s, w in zip(streams, scales)], streams


def _separate(be, w, grads, lr, scales=None):
    """The separate passes: the sum in list order (each scaled first), then the step."""
    scales = scales or [None] * len(grads)
    vals = [g if s is None else g * s for g, s in zip(grads, scales)]
    total = vals[0].copy()
    for v in vals[1:]:
        total += v
    out = np.empty_like(w)
    be.sgd_step(w, total, lr, out=out)
    return out


@numba_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("chains", [["raw"], ["raw", "raw"], ["fp16", "raw", "bf16"],
                                    ["bf16"], ["raw", "fp16", "raw", "raw"]])
def test_a_step_while_reading_gives_the_bits_of_a_sum_then_a_step(dtype, chains):
    be = NumpyBackend(chunk_bytes=CHUNK)
    n = 5 * be.chunk_len(np.dtype(dtype)) + 3                      # a short last piece
    rng = np.random.default_rng(len(chains))
    w = rng.normal(size=n).astype(dtype)
    frames = [wire.encode_tensor("w/0", rng.normal(size=n).astype(dtype), c) for c in chains]
    decoded = [wire.decode_tensor(wire.parse_desc(d), f).reshape(-1) for d, f in frames]
    scales = [None] * len(chains)
    scales[-1] = np.asarray(0.25, dtype)                           # a staleness-scaled push
    reads, streams = _reads(frames, scales)
    out = np.empty_like(w)
    before = w.copy()
    assert be.sgd_step_reading(w, reads, 0.5, out, np.empty(2 * n, dtype)) is True
    assert all(s.verified() for s in streams)
    assert np.array_equal(out, _separate(be, w, decoded, 0.5, scales))
    assert np.array_equal(w, before)                               # stepped into out only


@numba_only
def test_a_frame_at_an_odd_offset_steps_the_same():
    be = NumpyBackend(chunk_bytes=CHUNK)
    n = 3 * be.chunk_len(np.dtype(np.float32)) + 1
    g = np.linspace(-1, 1, n, dtype=np.float32)
    d, f = wire.encode_tensor("w/0", g)
    odd = bytearray(len(bytes(f)) + 1)
    odd[1:] = bytes(f)
    frame = memoryview(odd)[1:]                                    # not 4-byte aligned
    reads, streams = _reads([(d, frame)])
    w, out = np.ones(n, np.float32), np.empty(n, np.float32)
    assert be.sgd_step_reading(w, reads, 0.5, out, np.empty(2 * n, np.float32)) is True
    assert streams[0].verified() and np.array_equal(out, _separate(be, w, [g], 0.5))


@numba_only
@pytest.mark.parametrize("bad", ["nan", "inf", "overflowing_sum"])
def test_a_step_while_reading_says_when_the_sum_is_not_finite(bad):
    be = NumpyBackend(chunk_bytes=CHUNK)
    n = 4 * be.chunk_len(np.dtype(np.float32))
    a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)
    if bad == "overflowing_sum":                  # each finite, their sum not
        a[n - 2] = b[n - 2] = np.float32(3e38)
    else:
        b[n - 1] = np.float32(bad)
    reads, streams = _reads([wire.encode_tensor("w/0", a), wire.encode_tensor("w/0", b)])
    out = np.empty(n, np.float32)
    assert be.sgd_step_reading(np.ones(n, np.float32), reads, 0.1, out,
                               np.empty(2 * n, np.float32)) is False
    assert all(s.verified() for s in streams)


@numba_only
def test_a_corrupt_frame_is_read_to_its_end_and_fails_its_checksum():
    be = NumpyBackend(chunk_bytes=CHUNK)
    n = 3 * be.chunk_len(np.dtype(np.float32))
    d, f = wire.encode_tensor("w/0", np.ones(n, np.float32))
    bad = bytearray(bytes(f))
    bad[-3] ^= 0x01
    reads, streams = _reads([(d, bytes(bad))])
    out = np.empty(n, np.float32)
    be.sgd_step_reading(np.ones(n, np.float32), reads, 0.1, out, np.empty(2 * n, np.float32))
    assert not streams[0].verified()


def test_without_a_loop_nothing_is_read():
    be = NumpyBackend(jit=False)
    called = []
    reads = [(lambda lo, hi, buf: called.append(lo), None)]
    w = np.ones(10, np.float32)
    assert be.sgd_step_reading(w, reads, 0.1, np.empty_like(w), np.empty(20, np.float32)) \
        is None
    assert called == []
    if NumpyBackend().fused is not None:      # float16: no loop for it either
        h = np.ones(10, np.float16)
        assert NumpyBackend().sgd_step_reading(h, reads, 0.1, np.empty_like(h),
                                               np.empty(20, np.float16)) is None
        assert called == []


# ------------------------------------------------------------------------------ the ring
@pytest.mark.usefixtures("shm_dir")
def test_the_ring_hashes_what_it_copies_where_asked():
    ring = shm.Ring("5ea11ed1", cap=64 << 20)
    try:
        big = np.random.default_rng(2).integers(0, 255, 3 * HASH_PIECE + 77, np.uint8)
        small = np.arange(1000, dtype=np.float32)
        empty = np.zeros(0, np.float32)
        digests = [None, 12345, None]
        refs = ring.place(1, [big, small, empty], digests)
        assert digests == [wire.checksum(big), 12345, wire.checksum(b"")]
        for ref, buf in zip(refs, [big, small]):
            seg = next(a.seg for a in ring.arenas if a.seg.name == ref[0])
            assert bytes(seg.view[ref[1]:ref[1] + buf.nbytes]) == buf.tobytes()
        plain = ring.place(2, [small])           # no digests asked for: copied alone
        seg = next(a.seg for a in ring.arenas if a.seg.name == plain[0][0])
        assert bytes(seg.view[plain[0][1]:plain[0][1] + small.nbytes]) == small.tobytes()
        ring.free([1, 2])
    finally:
        ring.close()
