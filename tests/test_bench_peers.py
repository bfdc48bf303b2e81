"""bench/peers.py's pieces: the shared-memory floor's seqlock board under a concurrent writer,
the segments' removal, and the round-trip samples. No torch needed."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import floor  # noqa: E402
import peers  # noqa: E402, F401  (the bench imports)

N = 1 << 16                 # 256 KiB blocks: a copy is long enough for a read to overlap a write
READS = 1000
DEADLINE = 120.0

pytestmark = pytest.mark.skipif(not os.path.isdir(floor.SHM_DIR), reason="no /dev/shm")


def _bench_segments() -> set:
    """This process's bench segments (another test process's, under xdist, are its own)."""
    mine = f"{floor.SHM_PREFIX}{os.getpid()}-"      # floor.SegmentSet's names
    return {f for f in os.listdir(floor.SHM_DIR) if f.startswith(mine)}


def writer(path, n):
    """Rewrites the board with constant blocks k, k+1, ... until it is terminated."""
    board, block, k = floor.Board(path, n), np.empty(n, np.float32), 1
    while True:
        block.fill(k)
        board.write(block)
        k += 1


def test_seqlock_board_never_returns_a_torn_block():
    before = _bench_segments()
    with floor.Segments() as segs:
        path = segs.make("board", floor.Board.size(N))
        assert os.path.basename(path).startswith("gradbus-bench-")
        assert os.stat(path).st_mode & 0o777 == 0o600
        code = f"from tests.test_bench_peers import writer; writer({path!r}, {N})"
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
        try:
            board, out = floor.Board(path, N), np.empty(N, np.float32)
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
    with pytest.raises(RuntimeError), floor.Segments() as segs:
        segs.make("ring0", 4096)
        segs.make("board", floor.Board.size(16))
        assert len(_bench_segments() - before) == 2
        raise RuntimeError("a failure inside the run")
    assert _bench_segments() <= before


def test_samples_window_takes_the_updates_made_fresh_in_it():
    import ctypes
    import types
    s = floor.Samples(types.SimpleNamespace(RawArray=lambda _t, n: (ctypes.c_double * n)()))
    for k in range(5):
        s.sent(k)
        s.acked(k)
        s.fresh(k)
    t = list(np.frombuffer(s.t, np.float64)[:15])
    s.sent(5)                          # sent, never acked: not a round trip
    s.t[17] = t[14] + 1.0
    acks, fresh = s.window(t[2], t[11])       # updates 1, 2 and 3 were made fresh in it
    assert len(acks) == len(fresh) == 3
    assert all(0 <= a <= f for a, f in zip(acks, fresh))
    s.sent(5 + floor.Samples.CAPACITY)        # the slot of update 5 again: its old times go
    assert s.t[16] == 0.0 and s.t[17] == 0.0


_PIPELINE = """
import json, multiprocessing as mp, sys, time
sys.path.insert(0, sys.argv[1])
import floor
ctx = mp.get_context("spawn")
counters, stop = ctx.RawArray("q", 2), ctx.RawValue("b", 0)
lat = [floor.Samples(ctx) for _ in range(2)]
with floor.shm_pipeline(4 << 10, counters, stop, 2, 2, lat, sys.argv[2],
                        sys.argv[4]) as procs:
    deadline = time.monotonic() + float(sys.argv[3])
    while min(counters) < 50 and time.monotonic() < deadline:
        if any(p.exitcode is not None for p in procs):
            break
        time.sleep(0.05)
    counts, pids = list(counters), [p.pid for p in procs]
acks, fresh = lat[0].window(0.0, time.monotonic() + 1)
print(json.dumps({"counts": counts, "pids": pids, "acks": acks, "fresh": fresh,
                  "ended": [p.exitcode is not None for p in procs]}))
"""


@pytest.mark.parametrize("transport,step", [("zmq", "numpy"), ("link", "numpy"),
                                            ("link", "onepass"), ("link", "inplace")])
def test_floor_pipeline_acks_every_worker_over_either_transport_and_leaves_nothing(transport,
                                                                                     step):
    import json
    before = _bench_segments()
    out = subprocess.run([sys.executable, "-c", _PIPELINE, os.path.join(ROOT, "bench"),
                          transport, str(DEADLINE), step], capture_output=True, text=True,
                         timeout=DEADLINE + 60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert min(got["counts"]) >= 50, got["counts"]
    assert all(got["ended"])                        # every process of it was reaped
    assert all(not os.path.exists(f"/proc/{pid}") for pid in got["pids"])
    assert _bench_segments() <= before
    assert len(got["acks"]) >= 50
    assert all(0 < a <= f for a, f in zip(got["acks"], got["fresh"]))


def test_floor_pipeline_refuses_an_unknown_transport():
    import types
    before = _bench_segments()
    with pytest.raises(ValueError, match="transport"):
        with floor.shm_pipeline(4 << 10, [0], types.SimpleNamespace(value=0), 1, 1, None,
                                "tcp"):
            pass
    with pytest.raises(ValueError, match="step"):
        with floor.shm_pipeline(4 << 10, [0], types.SimpleNamespace(value=0), 1, 1, None,
                                "link", "twice"):
            pass
    assert _bench_segments() <= before


def test_a_step_in_place_on_the_board_is_one_write_readers_see_whole():
    n = 1 << 10
    with floor.Segments() as segs:
        board = floor.Board(segs.make("board", floor.Board.size(n)), n)
        board.write(np.zeros(n, np.float32))
        out = np.empty(n, np.float32)
        assert board.read(out) == 1
        step = floor._sgd_loop()
        board.step_in_place(step, np.full(n, 2.0, np.float32), np.float32(-0.25))
        assert board.read(out) == 2 and set(out) == {-0.5}


def test_a_pause_after_each_update_holds_the_workers_back_and_is_named():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--configs",
                          "gradbus_inproc", "--sizes", "64K", "--depth", "1", "--workers", "1",
                          "--seconds", "1", "--warmup", "0.5", "--pause-us", "5000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert line["config"] == "gradbus_inproc" and line["pause_us"] == 5000
    # one worker sleeping 5 ms after each update makes at most 200 a second, however fast
    assert 0 < line["updates_per_s"] <= 200, line


@pytest.mark.parametrize("args", [["--pause-us", "-1"],
                                  ["--pause-us", "10", "--configs", "floor_shm"]])
def test_a_bad_pause_is_refused(args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--pause-us" in out.stderr


@pytest.mark.parametrize("size", ["64K", "4M", "16M"])
@pytest.mark.parametrize("pieces,partitions", [(2, 256), (3, 256), (2, 16)])
def test_a_model_in_pieces_has_each_block_in_a_partition_of_its_own(size, pieces, partitions):
    from gradbus.codecs.partition import partition_of
    nbytes = peers.throughput.SIZES[size]
    names = peers.piece_names(pieces, nbytes, partitions)
    sizes = peers.throughput.parts(nbytes // 4, pieces)
    assert len(set(names)) == pieces and sum(sizes) * 4 == nbytes
    keys = [k for n, m in zip(names, sizes) for k in peers._block_keys(n, m)]
    assert len({partition_of(k, partitions) for k in keys}) == len(keys)


def test_the_two_server_configurations_split_the_model_and_say_the_cores_they_keep_busy():
    import importlib.util
    configs = ["gradbus_shm2", "gradbus_inproc2"]
    if importlib.util.find_spec("torch") is not None:
        configs.insert(0, "rpc2")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--configs",
                          ",".join(configs), "--sizes", "64K", "--depth", "1", "--workers", "1",
                          "--seconds", "1", "--warmup", "0.5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {x["config"]: x for x in map(json.loads, out.stdout.splitlines())}
    assert list(got) == configs, out.stderr[-2000:]
    for config, line in got.items():
        assert line["servers"] == 2 and line["updates_per_s"] > 0, line
        assert line["cores_busy"] == pytest.approx(
            line["cpu_s_per_update"] * line["updates_per_s"], rel=0.01), line
        if config.startswith("gradbus"):
            # where the broker's partition table put the pieces' bytes: on both shards
            held = line["shard_bytes"]
            assert len(held) == 2 and all(b > 0 for b in held.values()), held
            assert sum(held.values()) == line["bytes"] == 64 << 10
            if "rpc2" in got:
                assert line["vs_rpc2"] == pytest.approx(
                    line["updates_per_s"] / got["rpc2"]["updates_per_s"], rel=0.01)


def test_the_tier_configuration_spreads_the_model_over_its_members_beside_one_broker():
    """gradbus_tier2: a tier of 2 brokers, the model in 2 tensors each held by another
    member; every member applies pushes, and the line names its ratio to one broker."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--configs",
                          "gradbus_inproc,gradbus_tier2", "--sizes", "64K", "--depth", "2",
                          "--workers", "1", "--seconds", "1", "--warmup", "0.5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {x["config"]: x for x in map(json.loads, out.stdout.splitlines())}
    line = got["gradbus_tier2"]
    assert line["servers"] == 2 and line["updates_per_s"] > 0, line
    applied = line["member_applied"]
    assert len(applied) == 2 and all(n > 0 for n in applied), line
    assert line["vs_gradbus_inproc"] == pytest.approx(
        line["updates_per_s"] / got["gradbus_inproc"]["updates_per_s"], rel=0.01), line
