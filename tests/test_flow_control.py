"""A slow shard back-pressures producers: bounded memory, a clear error, nothing dropped."""
from __future__ import annotations

import numpy as np
import pytest

import gradbus
from gradbus import admin


def test_slow_shard_back_pressures_then_drains(make_cluster):
    cluster = make_cluster(1, broker_args=["--shard-credit", "1"],
                           shard_args=["--fault-apply-delay", "0.15"])
    n = 4096
    with gradbus.connect(cluster.url, window=3, timeout=20) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
        g = np.full(n, 0.25, np.float32)
        futs = [c.push({"w": g}) for _ in range(3)]       # fills the window
        with pytest.raises(gradbus.BackPressureError):
            c.push({"w": g}, timeout=0.05)                   # no slot: a clear error, not a drop
        st = admin.status(cluster.url)
        assert st["pending_bytes"] <= 3 * n * 4              # the broker holds at most the window
        for f in futs:
            f.result(20)
        more = [c.push({"w": g}, timeout=20) for _ in range(6)]  # blocks for credit, then goes
        for f in more:
            f.result(20)
        w = c.pull(["w"], min_version=9, timeout=20)["w"]
    assert np.array_equal(w, np.full(n, -9 * 0.5 * 0.25, np.float32))
    assert admin.status(cluster.url)["counters"]["pushes_applied"] == 9


def test_stalled_shard_declared_dead_rejoins_after_sigcont(make_cluster):
    import signal

    from .conftest import wait_for

    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, timeout=20) as c:
        c.init({"w": np.zeros(8, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        proc = cluster.shard_procs["shard-0"]
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: not admin.status(cluster.url)["shards"][0]["alive"], 10,
                     "the stalled shard to be declared dead")
        finally:
            proc.send_signal(signal.SIGCONT)
        st = wait_for(lambda: (lambda s: s if s["shards"][0]["alive"] else None)(
            admin.status(cluster.url)), 10, "the shard to register again")
        assert not st["partitions_down"]       # it came back holding its partitions
        c.push({"w": np.ones(8, np.float32)}).result(10)
        assert np.array_equal(c.pull(["w"], min_version=1)["w"], np.full(8, -1.0, np.float32))


def test_byte_window_bounds_large_pushes(make_cluster):
    cluster = make_cluster(1, shard_args=["--fault-apply-delay", "0.2"])
    n = 64 * 1024                      # 256 KiB per push
    with gradbus.connect(cluster.url, window=32, window_bytes=600 * 1024, timeout=20) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        g = np.ones(n, np.float32)
        futs = [c.push({"w": g}) for _ in range(2)]           # 512 KiB in flight
        with pytest.raises(gradbus.BackPressureError, match="B unacknowledged"):
            c.push({"w": g}, timeout=0.05)                      # a third would pass 600 KiB
        for f in futs:
            f.result(20)
        c.push({"w": g}).result(20)                            # room again
        assert np.array_equal(c.pull(["w"], min_version=3)["w"], np.full(n, -3.0, np.float32))
    with gradbus.connect(cluster.url, window_bytes=1024) as c:  # one push above the limit
        c.push({"w": g}).result(20)                            # still goes, alone
