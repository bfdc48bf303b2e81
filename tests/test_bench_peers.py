"""bench/peers.py's shared-memory floor: the seqlock board under a concurrent writer, and the
segments' removal. No torch needed."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import peers  # noqa: E402

N = 1 << 16                 # 256 KiB blocks: a copy is long enough for a read to overlap a write
READS = 1000
DEADLINE = 120.0

pytestmark = pytest.mark.skipif(not os.path.isdir(peers.floor.SHM_DIR), reason="no /dev/shm")


def _bench_segments() -> set:
    return {f for f in os.listdir(peers.floor.SHM_DIR) if f.startswith(peers.floor.SHM_PREFIX)}


def writer(path, n):
    """Rewrites the board with constant blocks k, k+1, ... until it is terminated."""
    board, block, k = peers.Board(path, n), np.empty(n, np.float32), 1
    while True:
        block.fill(k)
        board.write(block)
        k += 1


def test_seqlock_board_never_returns_a_torn_block():
    before = _bench_segments()
    with peers.Segments() as segs:
        path = segs.make("board", peers.Board.size(N))
        assert os.path.basename(path).startswith("gradbus-bench-")
        assert os.stat(path).st_mode & 0o777 == 0o600
        code = f"from tests.test_bench_peers import writer; writer({path!r}, {N})"
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
        try:
            board, out = peers.Board(path, N), np.empty(N, np.float32)
            deadline = time.monotonic() + DEADLINE
            while board.read(out) == 0:             # the writer's first block
                assert proc.poll() is None and time.monotonic() < deadline, "no writer"
                time.sleep(0.01)
            values, versions = set(), []
            while len(versions) < READS:
                assert time.monotonic() < deadline, "the reader made no progress"
                versions.append(board.read(out))
                assert out[0] == out[-1] and (out == out[0]).all(), "a torn block"
                values.add(float(out[0]))
            moved = len(values)
        finally:
            proc.terminate()
            proc.wait(DEADLINE)
        del board, out
    assert moved > 1, "the writer never changed the board while it was read"
    assert versions == sorted(versions)
    assert _bench_segments() <= before


def test_segments_are_removed_on_error():
    before = _bench_segments()
    with pytest.raises(RuntimeError), peers.Segments() as segs:
        segs.make("ring0", 4096)
        segs.make("board", peers.Board.size(16))
        assert len(_bench_segments() - before) == 2
        raise RuntimeError("a failure inside the run")
    assert _bench_segments() <= before
