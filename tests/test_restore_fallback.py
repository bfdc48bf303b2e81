"""`gradbus restore` with a shard whose newest checkpoint is damaged: refused, naming the file,
unless `--fallback-to-older` is given; then the newest undamaged one is restored, and each
skipped checkpoint is named in a warning. The dry run chooses as the restore does."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.shards import checkpoint

from .rigs import CHECKPOINT_DAMAGES as DAMAGES
from .rigs import damage_checkpoint as _damage
from .rigs import restored_serves as _serves
from .rigs import wait_for


def _restore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradbus", "restore", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_newest_checkpoint_is_refused_naming_the_file(two_checkpoints, kind):  # noqa: F811
    root, old, new = two_checkpoints
    path = _damage(kind, old, new)
    r = _restore("--from", root, "--dry-run")
    assert r.returncode == 1 and path in r.stderr, (r.stdout, r.stderr)
    assert "--fallback-to-older" in r.stderr, r.stderr       # what to do about it
    assert old.path not in r.stdout and new.path not in r.stdout, r.stdout


@pytest.mark.parametrize("kind", DAMAGES)
def test_the_fallback_dry_run_offers_the_older_one_and_names_the_damaged(two_checkpoints,  # noqa: F811
                                                                         kind):
    root, old, new = two_checkpoints
    _damage(kind, old, new)
    r = _restore("--from", root, "--fallback-to-older", "--dry-run")
    assert r.returncode == 0, (r.stdout, r.stderr)
    plan = [line for line in r.stdout.splitlines() if line.startswith("s0 ")]
    assert len(plan) == 1 and plan[0].endswith(old.path), r.stdout
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and new.path in warned[0] and "falling back" in warned[0], r.stderr


def test_a_shard_whose_every_checkpoint_is_damaged_is_refused_with_the_fallback(
        two_checkpoints):  # noqa: F811
    root, old, new = two_checkpoints
    _damage("header_byte", old, new)
    _damage("manifest", new, old)
    r = _restore("--from", root, "--fallback-to-older", "--dry-run")
    assert r.returncode == 1 and "every checkpoint of s0" in r.stderr, (r.stdout, r.stderr)
    assert new.path in r.stderr and old.path in r.stderr, r.stderr      # both named
    assert "starts empty" not in r.stdout, r.stdout


def test_an_undamaged_newest_checkpoint_is_restored_as_before(two_checkpoints):  # noqa: F811
    root, old, new = two_checkpoints
    for args in ([], ["--fallback-to-older"]):
        r = _restore("--from", root, "--dry-run", *args)
        assert r.returncode == 0 and new.path in r.stdout and not r.stderr, (r.stdout, r.stderr)


def test_restore_falls_back_to_the_older_state_when_told(make_cluster, tmp_path):
    """A real restore: the shard's newest checkpoint (at version 10) has a damaged partition
    file; with --fallback-to-older the cluster serves the older one's state (version 5)."""
    data = str(tmp_path / "data")
    cluster = make_cluster(1, shard_args=["--data-dir", data, "--checkpoint-interval", "0"])
    rng = np.random.default_rng(5)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(32, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
        for _ in range(5):
            c.push({"w": rng.standard_normal(32).astype(np.float32)}).result(10)
        at_5 = c.pull(["w"], min_version=5)["w"].copy()
        t1 = admin.checkpoint(cluster.url)[0]["time"]
        wait_for(lambda: time.time() > t1 + 0.01, 2, "the clock to pass the first checkpoint")
        for _ in range(5):
            c.push({"w": rng.standard_normal(32).astype(np.float32)}).result(10)
        c.pull(["w"], min_version=10)
    cluster.stop()       # the final checkpoint, at version 10
    old, new = checkpoint.list_for(data, "shard-0")
    damaged = _damage("header_byte", old, new)
    out = str(tmp_path / "restored")
    r = _restore("--from", data, "--port", "0", "--data-dir", out, "--dry-run")
    assert r.returncode == 1 and damaged in r.stderr, r.stderr
    w, said = _serves(["--from", data, "--data-dir", out, "--fallback-to-older"], 5)
    assert np.array_equal(w, at_5)
    assert any(line.startswith("shard-0 ") and line.endswith(old.path) for line in said), said
    assert os.path.exists(damaged)              # the history read is left as it was
    shutil.rmtree(out)
