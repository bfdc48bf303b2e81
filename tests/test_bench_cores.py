"""bench/cores.py: the broker's and a shard's cores wired in one process apply every push and
report each one's time per push."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import cores  # noqa: E402


def test_wired_cores_apply_every_push_and_ack_it():
    wired = cores.Wired(4096)
    for _ in range(5):
        wired.push()
    wired.broker.validate_state()
    wired.shard.validate_state()
    assert wired.shard.stats["pushes_applied"] == 5
    assert wired.spent["broker"] > 0 and wired.spent["shard"] > 0


@pytest.mark.usefixtures("shm_dir")
@pytest.mark.parametrize("board", ["copy", "step"])
def test_a_shard_with_a_board_publishes_each_push_there(board):
    """``copy`` steps in place, then copies the block onto the board; ``step`` steps it straight
    into the board. Either way the board's newest version is the block's values."""
    wired = cores.Wired(4096, board)
    try:
        for _ in range(5):
            wired.push()
        wired.shard.validate_state()
        blk = wired.shard.store.blocks["w/0"]
        assert wired.shard.stats["pushes_applied"] == 5 and blk.version == 5
        assert (blk.live is not None) == (board == "step")
        view, _ = wired.board.newest("w/0")
        assert np.array_equal(np.frombuffer(view, np.float32), blk.value)
    finally:
        wired.board.close()


def test_bench_prints_a_line_per_size_and_refuses_bad_arguments():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "cores.py")]
    out = subprocess.run(cmd + ["--sizes", "64K", "--pushes", "20", "--repeat", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert line["size"] == "64K" and line["broker_core_us_per_push"] > 0
    assert line["shard_core_us_per_push"] > 0
    assert set(line["unpack_header_us"]) == {"push", "batch", "applied"}
    bad = subprocess.run(cmd + ["--sizes", "3K"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--sizes" in bad.stderr
    bad = subprocess.run(cmd + ["--boards", "step,all"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--boards" in bad.stderr
