"""`gradbus restore` never changes the history it reads: the restored cluster's checkpoints go
to a folder of their own, so every `restore --from D [--at T]` finds afterwards what it found
before."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.shards import checkpoint

from .rigs import restored_serves as _serves
from .rigs import wait_for


def test_restoring_at_a_time_leaves_the_history_it_reads_as_it_was(make_cluster, tmp_path):
    data = str(tmp_path / "data")
    cluster = make_cluster(1, shard_args=["--data-dir", data, "--checkpoint-interval", "0"])
    rng = np.random.default_rng(3)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(64, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
        for _ in range(5):
            c.push({"w": rng.standard_normal(64).astype(np.float32)}).result(10)
        at_t1 = c.pull(["w"], min_version=5)["w"].copy()
        t1 = admin.checkpoint(cluster.url)[0]["time"]
        wait_for(lambda: time.time() > t1 + 0.01, 2, "the clock to pass T1")
        cut = time.time()
        for _ in range(5):
            c.push({"w": rng.standard_normal(64).astype(np.float32)}).result(10)
        at_t2 = c.pull(["w"], min_version=10)["w"].copy()
        admin.checkpoint(cluster.url)
    cluster.stop()       # a third checkpoint, as many as a shard keeps
    before = [ck.path for ck in checkpoint.list_for(data, "shard-0")]
    assert len(before) == 3

    w, said = _serves(["--from", data, "--at", repr(cut)], 5, push=True)
    assert np.array_equal(w, at_t1)
    new = [line.split(" go to ", 1)[1] for line in said if "new checkpoints go to" in line]
    assert len(new) == 1 and new[0].startswith(data)
    assert [ck.path for ck in checkpoint.list_for(data, "shard-0")] == before
    assert checkpoint.shards_in(data) == ["shard-0"]

    w, _ = _serves(["--from", data], 10)                       # still the newest: T2
    assert np.array_equal(w, at_t2)
    w, _ = _serves(["--from", data, "--at", repr(cut)], 5)    # and T1 is still there
    assert np.array_equal(w, at_t1)
    w, _ = _serves(["--from", new[0]], 6)         # the restored cluster's own history
    assert np.array_equal(w, at_t1 - 0.5)
    assert [ck.path for ck in checkpoint.list_for(data, "shard-0")] == before


@pytest.mark.parametrize("same", ["{d}", "{d}/", "{d}/shard-0/.."])
def test_a_data_dir_that_is_the_source_is_refused(tmp_path, same):
    from gradbus.shards.core import ShardCore
    d = str(tmp_path / "data")
    checkpoint.write(d, "shard-0", ShardCore("shard-0").states(), keep=3)
    r = subprocess.run([sys.executable, "-m", "gradbus", "restore", "--from", d, "--data-dir",
                        same.format(d=d), "--port", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--data-dir" in r.stderr and "must not be --from" in r.stderr
