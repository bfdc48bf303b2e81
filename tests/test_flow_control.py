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
