"""Checkpoints on a full disk: a failed write leaves nothing behind, and a shard whose final
checkpoint at a clean stop fails says so and exits non-zero."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

import gradbus
from gradbus.shards import checkpoint

from .rigs import shard_with_state, wait_for

FAILURES = 13


def _leftovers(base) -> list[str]:
    return sorted(e for e in os.listdir(base) if e.endswith(".tmp")) if os.path.isdir(base) else []


def _full_after(limit: int):
    """A checkpoint._write_file that writes at most ``limit`` bytes in all, then fails as a
    full disk does: part of a file written, then ENOSPC."""
    real = checkpoint._write_file
    left = [limit]

    def write_file(path, chunks):
        data = b"".join(bytes(c) for c in chunks)
        if len(data) <= left[0]:
            left[0] -= len(data)
            return real(path, [data])
        with open(path, "wb") as f:
            f.write(data[:left[0]])
        left[0] = 0
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return write_file


def test_failed_writes_leave_no_tmp_and_keep_the_good_checkpoints(tmp_path, monkeypatch):
    core = shard_with_state()
    root, base = str(tmp_path), tmp_path / "s0"
    good = checkpoint.write(root, "s0", core.states(), keep=2, now=1.0)
    crashed = base / "ckpt-00000000000000000002.tmp"      # a write a crash interrupted
    crashed.mkdir()
    (crashed / "p00001.gbs").write_bytes(b"half")
    for i in range(FAILURES):
        monkeypatch.setattr(checkpoint, "_write_file", _full_after(100 * i))
        with pytest.raises(OSError) as e:
            checkpoint.write(root, "s0", core.states(), keep=2, now=10.0 + i)
        assert e.value.errno == errno.ENOSPC
        assert _leftovers(base) == []         # nor the crashed write's, swept before this one
    monkeypatch.undo()
    assert [c.path for c in checkpoint.list_for(root, "s0")] == [good.path]
    assert len(checkpoint.load(good)) == len(good.partitions)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs (root only): a disk that fills up for real."""
    path = tmp_path / "tiny"
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _shard_stops(make_cluster, data: str, capfd, block, interval: str = "0"):
    """A cluster whose shard checkpoints into ``data``, 1 MiB of state in it; ``block(base)``
    makes the disk refuse writes; the shard is stopped with SIGTERM. Returns (exit status,
    the shard's log, the most .tmp directories seen at once)."""
    cluster = make_cluster(1, quiet=False, shard_args=["--data-dir", data,
                                                       "--checkpoint-interval", interval])
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.arange(1 << 18, dtype=np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.ones(1 << 18, np.float32)}).result(30)
    base = os.path.join(data, "shard-0")
    block(base)
    log, most = [], 0

    def failed_enough():
        nonlocal most
        most = max(most, len(_leftovers(base)))
        log.append(capfd.readouterr().err)
        return "".join(log).count("checkpoint failed") >= (FAILURES if interval != "0" else 0)
    wait_for(failed_enough, 60, f"{FAILURES} failed checkpoints")
    proc = cluster.shard_procs["shard-0"]
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    log.append(capfd.readouterr().err)
    return code, "".join(log), most


def test_periodic_checkpoints_on_a_full_disk_do_not_pile_up(make_cluster, tiny_fs, capfd):
    code, log, most = _shard_stops(make_cluster, tiny_fs, capfd, lambda base: None, "0.05")
    assert log.count("checkpoint failed") >= FAILURES
    assert most <= 1                      # only the write in progress, never a pile
    assert _leftovers(os.path.join(tiny_fs, "shard-0")) == []
    assert code != 0 and "final checkpoint failed" in log


def test_a_full_disk_at_the_final_checkpoint_exits_non_zero(make_cluster, tiny_fs, capfd):
    code, log, _ = _shard_stops(make_cluster, tiny_fs, capfd, lambda base: None)
    assert code != 0
    assert "shard-0: final checkpoint failed" in log and "No space left on device" in log
    assert _leftovers(os.path.join(tiny_fs, "shard-0")) == []


def test_a_final_checkpoint_that_cannot_be_written_exits_non_zero(make_cluster, tmp_path,
                                                                  capfd):
    """Without root: the shard's checkpoint directory is a file by the time it stops."""
    def block(base):
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        with open(base, "w") as f:
            f.write("in the way")
    code, log, _ = _shard_stops(make_cluster, str(tmp_path / "data"), capfd, block)
    assert code != 0 and "shard-0: final checkpoint failed" in log
