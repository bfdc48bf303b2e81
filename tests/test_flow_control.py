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

    from .rigs import wait_for

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


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_shard_stopped_ten_seconds_bounds_memory_and_loses_nothing(make_cluster):
    """SIGSTOP the only shard for 10 s under load (liveness set above the stall, so it is not
    failed over): the broker holds at most the clients' windows, producers get
    BackPressureError instead of growing memory, and after SIGCONT every accepted push is
    applied exactly once."""
    import signal
    import time

    from .rigs import wait_for

    slow_hb = ["--heartbeat-interval", "0.25", "--liveness", "80"]     # 20 s window
    cluster = make_cluster(1, broker_args=slow_hb, shard_args=slow_hb)
    n, window = 1 << 18, 6                                 # 1 MiB pushes
    proc = cluster.shard_procs["shard-0"]
    with gradbus.connect(cluster.url, window=window, timeout=60) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=2.0 ** -8))
        g = np.ones(n, np.float32)
        c.push({"w": g}).result(20)
        rss0 = _rss_mib(cluster.broker_proc.pid)
        accepted, refused, peak_pending = 1, 0, 0
        futs = []
        proc.send_signal(signal.SIGSTOP)
        try:
            t_end = time.monotonic() + 10
            while time.monotonic() < t_end:
                try:
                    futs.append(c.push({"w": g}, timeout=0.5))
                    accepted += 1
                except gradbus.BackPressureError:
                    refused += 1
                    peak_pending = max(peak_pending, admin.status(cluster.url)["pending_bytes"])
                assert len(c._credit_held) <= window
            rss_stalled = _rss_mib(cluster.broker_proc.pid)
        finally:
            proc.send_signal(signal.SIGCONT)
        for f in futs:
            assert f.result(60)["kind"] == "ack"
        w = c.pull(["w"], min_version=accepted, timeout=60)["w"]
    assert refused > 0 and accepted <= 1 + window + 1
    assert peak_pending <= window * n * 4              # the broker holds at most the window
    assert rss_stalled - rss0 < 64                     # MiB: no growth beyond the queued window
    assert np.array_equal(w, np.full(n, -accepted * 2.0 ** -8, np.float32))
    assert admin.status(cluster.url)["counters"]["pushes_applied"] == accepted
    wait_for(lambda: admin.status(cluster.url)["shards"][0]["alive"], 5, "the shard alive")
