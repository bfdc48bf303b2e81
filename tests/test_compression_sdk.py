"""Error feedback and local accumulation in the SDK, through a real cluster."""
from __future__ import annotations

import numpy as np
import pytest

import gradbus


def test_error_feedback_delivers_everything_eventually(make_cluster):
    """With SGD(lr=1) the weights are minus the sum of what was *sent*; with error feedback the
    unsent remainder is carried, so sent + residual == pushed, exactly up to float rounding."""
    cluster = make_cluster(1)
    n = 2000
    rng = np.random.default_rng(1)
    with gradbus.connect(cluster.url, seed=0) as c:
        c.init({"w": np.zeros(n, np.float64)}, optimizer=gradbus.SGD(lr=1.0))
        total = np.zeros(n)
        for _ in range(20):
            g = rng.standard_normal(n)
            total += g
            c.push({"w": g}, codec="topk:0.05").result(10)
        w = c.pull(["w"], min_version=20)["w"]
        residual = c._residual["w/0"]
        np.testing.assert_allclose(-w + residual, total, rtol=1e-9, atol=1e-9)
        st = c.compression_stats()
        assert st["error_feedback_keys"] == 1 and st["error_feedback_norm"] > 0
        assert st["ratio"] > 5          # 5% of the values + their indices


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_half_precision_residuals_are_the_encoders_arithmetic(make_cluster, codec):
    """Over many pushes of a multi-block tensor in fp16/bf16, sent + residual equals what was
    pushed, and each block's residual is bit for bit the encoder's arithmetic (bf16 only with
    ``error_feedback="all"``)."""
    from gradbus.codecs import tensor as tcodec
    cluster = make_cluster(1)
    n = 150_000                      # several blocks, one of them short
    rng = np.random.default_rng(4)
    with gradbus.connect(cluster.url, seed=0, block_bytes=256 << 10,
                         error_feedback="all" if codec == "bf16" else True) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        keys = c._layouts(["w"])["w"].block_keys()
        assert len(keys) == 3           # 600,000 bytes in blocks of 256 KiB
        total, want = np.zeros(n), {}
        for _ in range(12):
            g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2, n)).astype(np.float32)
            total += g
            layout = c._layouts(["w"])["w"]
            for i, key in enumerate(keys):          # the general path's arithmetic
                a, b = layout.block_range(i)
                blk = g[a:b] if key not in want else g[a:b] + want[key]
                _, _, dec = tcodec.encode(blk, codec, want_decoded=True)
                want[key] = (blk - dec).astype(np.float32)
            c.push({"w": g}, codec=codec).result(10)
        for key in keys:
            assert np.array_equal(c._residual[key], want[key])
        residual = np.concatenate([c._residual[k] for k in keys])
        w = c.pull(["w"], min_version=12)["w"]
        np.testing.assert_allclose(-w.astype(np.float64) + residual, total,
                                   rtol=1e-5, atol=1e-5 * np.abs(total).max())


def test_bf16_rounding_is_fed_back_only_when_asked(make_cluster):
    """By default a bf16 push keeps no residual and leaves an earlier one alone; with
    error_feedback="all" it keeps what rounding took; a bad value is refused."""
    cluster = make_cluster(1)
    g = np.full(64, 1 / 3, np.float32)           # 1/3 is not a bf16 value
    with pytest.raises(ValueError, match="error_feedback"):
        gradbus.connect(cluster.url, error_feedback="yes")
    with gradbus.connect(cluster.url) as c:
        c.init({"a": np.zeros(64, np.float32), "b": np.zeros(64, np.float32)},
               optimizer=gradbus.SGD(lr=1.0))
        c.push({"a": g}, codec="bf16").result(10)
        assert "a/0" not in c._residual
        c.push({"b": g}, codec="int8").result(10)
        kept = c._residual["b/0"].copy()
        c.push({"b": g}, codec="bf16").result(10)
        assert np.array_equal(c._residual["b/0"], kept)
        c.push({"b": g}, codec="fp16").result(10)          # fp16 is fed back
        assert not np.array_equal(c._residual["b/0"], kept)
    with gradbus.connect(cluster.url, error_feedback="all") as c:
        before = c.pull(["a"])["a"]
        c.push({"a": g}, codec="bf16|zstd").result(10)
        sent = before - c.pull(["a"], min_version=2)["a"]    # SGD(lr=1): what was applied
        assert np.array_equal(c._residual["a/0"], g - sent) and c._residual["a/0"].any()


def test_without_error_feedback_the_remainder_is_lost(make_cluster):
    cluster = make_cluster(1)
    n = 2000
    with gradbus.connect(cluster.url, error_feedback=False) as c:
        c.init({"w": np.zeros(n, np.float64)}, optimizer=gradbus.SGD(lr=1.0))
        g = np.linspace(-1, 1, n)
        c.push({"w": g}, codec="topk:0.05").result(10)
        w = c.pull(["w"], min_version=1)["w"]
        assert np.count_nonzero(w) == 100 and not c._residual
        assert np.abs(-w - g).max() > 0.5        # most of the gradient never arrived


def test_local_accumulation_every_k_and_flush(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(4, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.accumulate(every=4)
        futs = [c.push({"w": np.ones(4, np.float32)}) for _ in range(6)]
        assert sum(f.result(10) is None for f in futs) == 5      # only the 4th sent anything
        assert c.stats["pushes"] == 1
        c.flush()                                               # the 2 held back go now
        assert c.stats["pushes"] == 2
        w = c.pull(["w"], min_version=6)["w"]                   # versions count gradients
        assert np.array_equal(w, np.full(4, -6.0, np.float32))  # nothing dropped
        assert c.version("w") == 6


def test_local_accumulation_significance_threshold(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.full(100, 10.0, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.pull(["w"])
        c.accumulate(threshold=0.05)       # send once |sum g| >= 5% of |w| = 0.05 * 100
        small = np.full(100, 0.1, np.float32)   # |g| = 1 per push
        sent = [c.push({"w": small}).result(10) is not None for _ in range(6)]
        assert sent == [False, False, False, False, True, False]
    # close() flushed the last one: 6 pushes worth arrived in total
    with gradbus.connect(cluster.url) as c2:
        w = c2.pull(["w"], min_version=6)["w"]
        np.testing.assert_allclose(w, np.full(100, 10.0 - 0.6, np.float32), rtol=1e-6)


def test_accumulate_rejects_bad_settings(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        with pytest.raises(ValueError):
            c.accumulate(every=0)
        with pytest.raises(ValueError):
            c.accumulate(threshold=-1.0)


def test_back_pressure_keeps_error_feedback_and_held_back_sums(make_cluster):
    """A push refused for lack of credit changes nothing: no residual, no lost sums."""
    cluster = make_cluster(1, broker_args=["--shard-credit", "1"],
                           shard_args=["--fault-apply-delay", "0.3"])
    with gradbus.connect(cluster.url, window=1, timeout=20) as c:
        c.init({"w": np.zeros(64, np.float64)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.ones(64)}, codec="topk:0.25")           # takes the only slot
        before = {k: v.copy() for k, v in c._residual.items()}
        with pytest.raises(gradbus.BackPressureError):
            c.push({"w": np.full(64, 5.0)}, codec="topk:0.25", timeout=0.01)
        assert before.keys() == c._residual.keys()
        for k in before:
            assert np.array_equal(before[k], c._residual[k])
        c.flush()
        c.init({"h": np.zeros(64, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"h": np.full(64, 1 / 3, np.float32)}, codec="fp16").result(10)
        # the second push takes the only slot
        c.push({"h": np.full(64, 1 / 3, np.float32)}, codec="fp16")
        before = c._residual["h/0"].copy()
        with pytest.raises(gradbus.BackPressureError):
            c.push({"h": np.full(64, 0.1, np.float32)}, codec="fp16", timeout=0.01)
        assert np.array_equal(before, c._residual["h/0"]) and before.any()
        c.flush()
        c.accumulate(every=2)
        c.push({"w": np.ones(64)})
        c.push({"w": np.ones(64)})          # due: takes the slot
        c.push({"w": np.ones(64)})
        with pytest.raises(gradbus.BackPressureError):
            c.push({"w": np.ones(64)}, timeout=0.01)   # due, refused: the 2 stay held back
        c.flush()
        total = -c.pull(["w"], min_version=5)["w"] + c._residual["w/0"]
        np.testing.assert_allclose(total, np.full(64, 5.0))   # 1 (topk + residual) + 4 ones


def test_a_refused_accumulated_sum_is_raised_by_flush_not_lost(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(4, np.float32)})
        c.accumulate(every=8)
        c.push({"w": np.array([1, np.nan, 0, 0], np.float32)})   # held back locally
        with pytest.raises(gradbus.GradbusError, match="NOT_FINITE"):
            c.flush()
        with pytest.raises(gradbus.UnknownKeyError):
            c.version("never-pulled")
