"""Checkpoints (atomic, last K kept, validated on load), restore to a point in time, and a
broker restart that loses no acknowledged update."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.cluster import free_ports
from gradbus.codecs import wire
from gradbus.codecs.errors import WireError
from gradbus.codecs.partition import TensorLayout, partition_of
from gradbus.shards import checkpoint
from gradbus.shards.core import ShardCore

from .rigs import RepRig, init_msg, push_msg, shard_with_state, wait_for

# every test twice: tensor bytes through shared memory (the default), then as frames
BOTH_DATA_PATHS = True
# a restore's logic does not depend on the path; the broker restart tests run both by default
FRAMES_SLOW = {"test_checkpoint_command_then_restore_at_a_time",
               "test_update_log_restores_exactly_to_the_update"}

LR = 2.0 ** -6


def test_checkpoint_round_trip_restores_values_versions_and_optimizer_state(tmp_path):
    core = shard_with_state()
    ck = checkpoint.write(str(tmp_path), "s0", core.states(), keep=2, now=1000.0)
    assert ck.time == 1000.0 and ck.partitions
    fresh = ShardCore("s0")
    for h, descs, frames in checkpoint.load(ck):
        fresh.install_state(h, descs, frames)
    for p in core.store.partitions:
        assert fresh.partition_digest(p) == core.partition_digest(p)
        assert fresh.store.partition(p).seq == core.store.partition(p).seq
    assert fresh.register_fields()["holds"] == core.register_fields()["holds"]


def test_keeps_the_last_k_and_ignores_torn_writes(tmp_path):
    core = shard_with_state()
    for t in (1.0, 2.0, 3.0, 4.0):
        checkpoint.write(str(tmp_path), "s0", core.states(), keep=2, now=t)
    assert [c.time for c in checkpoint.list_for(str(tmp_path), "s0")] == [3.0, 4.0]
    torn = tmp_path / "s0" / "ckpt-00000000000000000009.tmp"
    torn.mkdir()
    (torn / "p00001.gbs").write_bytes(b"half")
    assert [c.time for c in checkpoint.list_for(str(tmp_path), "s0")] == [3.0, 4.0]
    assert checkpoint.newest(str(tmp_path), "s0", at=3.5).time == 3.0
    assert checkpoint.newest(str(tmp_path), "s0", at=0.5) is None
    checkpoint.write(str(tmp_path), "s0", core.states(), keep=2, now=5.0)
    assert not torn.exists()       # the next write clears leftovers


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic"])
def test_a_damaged_checkpoint_is_refused_not_loaded(tmp_path, damage):
    core = shard_with_state()
    ck = checkpoint.write(str(tmp_path), "s0", core.states(), keep=1)
    path = os.path.join(ck.path, f"p{ck.partitions[0][0]:05d}.gbs")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[:-5]
    else:
        data[:4] = b"XXXX"
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(WireError):
        checkpoint.load(ck)




def _spawn(args):
    return subprocess.Popen([sys.executable, "-m", "gradbus", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()


def test_checkpoint_command_then_restore_at_a_time(make_cluster, tmp_path):
    data = str(tmp_path / "data")
    cluster = make_cluster(2, shard_args=["--data-dir", data, "--checkpoint-interval", "0"])
    w0 = np.zeros(5000, np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        c.init({"w": w0}, optimizer=gradbus.Adam(lr=1e-2))
        rng = np.random.default_rng(1)
        for _ in range(20):
            c.push({"w": rng.standard_normal(5000).astype(np.float32)})
        c.flush()
        at_ckpt = c.pull(["w"], min_version=20)["w"].copy()
        digests = admin.digest(cluster.url)
        replies = admin.checkpoint(cluster.url)
        # each shard's share depends on which registered first: only "some" is fixed
        assert len(replies) == 2 and all(r["path"] and r["partitions"] > 0 for r in replies)
        t_ckpt = max(r["time"] for r in replies)
        wait_for(lambda: time.time() > t_ckpt + 0.01, 2, "the clock to pass the checkpoint")
        cut = time.time()
        for _ in range(10):
            c.push({"w": rng.standard_normal(5000).astype(np.float32)})
        c.flush()
        final = c.pull(["w"], min_version=30)["w"].copy()
    cluster.stop()      # a clean stop writes one more checkpoint per shard
    assert len(checkpoint.list_for(data, "shard-0")) == 2

    for when, expect, version in ((str(cut), at_ckpt, 20), (None, final, 30)):
        args = ["restore", "--from", data, "--port", "0", "--data-dir", str(tmp_path / "new")]
        args += ["--at", when] if when else []
        proc = _spawn(args)
        try:
            url = _ready_url(proc)
            with gradbus.connect(url) as c:
                w = c.pull(["w"], min_version=version, timeout=20)["w"]
                assert np.array_equal(w, expect)
                assert c.version("w") == version
                if when:   # the optimizer state came back too: replicas' digests as before
                    assert {s: d for s, d in admin.digest(url).items()} == digests
                c.push({"w": np.ones(5000, np.float32)}).result(10)
        finally:
            _stop([proc])


def _ready_url(proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited with {proc.wait()}")
        if line.startswith("ready: "):
            return line.split(" ", 1)[1].strip()
    raise AssertionError("never ready")


def test_restore_with_nothing_to_restore_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gradbus", "restore", "--from", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no checkpoint" in r.stderr


@pytest.mark.parametrize("replicas", [1, 2])
def test_broker_restart_loses_no_acknowledged_update(replicas):
    port, backend, events = free_ports(3)
    fast = ["--heartbeat-interval", "0.1", "--liveness", "5"]
    broker_cmd = ["broker", "--port", str(port), "--backend-port", str(backend), "--events-port",
                  str(events), "--replicas", str(replicas), *fast]
    url = f"tcp://127.0.0.1:{port}"
    procs = [_spawn(broker_cmd)]
    try:
        assert procs[0].stdout.readline().startswith("listening")
        procs += [_spawn(["shard", "--broker", url, "--id", f"s{i}", *fast]) for i in range(2)]
        wait_for(lambda: _alive(url) == 2, 30, "2 shards")
        n, w0 = 60, np.full(3000, 1.0, np.float32)
        with gradbus.connect(url, block_bytes=2048, resend_after=0.5) as c:
            c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
            for _ in range(n):
                c.push({"w": np.ones_like(w0)}, acks="all" if replicas > 1 else 1)
            c.flush()
            procs[0].kill()
            procs[0].wait()
            procs[0].stdout.close()
            procs[0] = _spawn(broker_cmd)
            assert procs[0].stdout.readline().startswith("listening")
            wait_for(lambda: _alive(url) == 2, 30, "the shards to register again")
            if replicas > 1:
                wait_for(lambda: admin.status(url)["under_replicated"] == 0, 30, "replicas")
            # the client may have called the broker silent while it was down (flush then
            # raises at once); its SUB reconnects with back-off: wait until it hears again
            wait_for(lambda: c.broker_alive, 30, "the client to hear the broker again")
            for _ in range(n):
                c.push({"w": np.ones_like(w0)})
            c.flush(30)
            w = c.pull(["w"], min_version=2 * n, timeout=30)["w"]
        assert np.array_equal(w, w0 - 2 * n * LR)
        st = admin.status(url)
        # the restarted broker takes each partition holding w from the first shard that names it
        held = {partition_of(k, st["partitions"])
                for k in TensorLayout("w", "float32", (3000,), 2048 // 4).block_keys()}
        assert st["counters"]["partitions_adopted"] == len(held)
        assert st["counters"]["pushes_applied"] == n
        assert [t["name"] for t in st["tensors"]] == ["w"] and st["tensors"][0]["version"] == 2 * n
    finally:
        _stop(procs)


def _alive(url):
    try:
        return sum(1 for s in admin.status(url, timeout=1.0)["shards"] if s["alive"])
    except gradbus.GradbusError:
        return 0


def test_register_holds_are_validated():
    from gradbus.broker.core import BrokerCore
    b = BrokerCore(8)
    out = b.on_backend(b"s", [wire.pack(wire.REGISTER, shard="s", holds=[[99, 1, 1]])], 0)
    assert b"BAD_FIELD" in out[0].frames[0]


def test_a_push_resent_through_a_restarted_broker_applies_once():
    from gradbus.broker.core import BrokerCore
    rig = RepRig(("s0", "s1"), replicas=2)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    push = push_msg(2, layout, np.ones(4, np.float32))
    rig.client(b"c", push)
    before = {sid: sc.store.blocks["w/0"].value.copy() for sid, sc in rig.shards.items()}
    rig.broker = BrokerCore(16, replicas=2)          # the broker restarts: no dedupe window
    for sid in rig.shards:
        rig.register(sid)
    rig.replies(b"c")
    rig.client(b"c", push)                            # the SDK resends the unacked push
    assert [r["kind"] for r in rig.replies(b"c")] == ["ack"]
    for sid, sc in rig.shards.items():
        assert np.array_equal(sc.store.blocks["w/0"].value, before[sid])
        assert sc.stats["duplicates_skipped"] == 1
    rig.client(b"c", push_msg(3, layout, np.ones(4, np.float32)))   # a new push still applies
    assert rig.shards["s0"].store.blocks["w/0"].value[0] == before["s0"][0] - 0.5


def test_update_log_restores_exactly_to_the_update(make_cluster, tmp_path):
    """Checkpoints plus the broker's update log: restore --at T holds exactly the pushes
    logged up to T, each once; without --at, all of them, including a tensor created after
    the last checkpoint."""
    data, log = str(tmp_path / "data"), str(tmp_path / "log")
    cluster = make_cluster(2, broker_args=["--log-dir", log, "--log-fsync", "always"],
                           shard_args=["--data-dir", data, "--checkpoint-interval", "0"])
    n, acked_at = 24, {}
    with gradbus.connect(cluster.url, block_bytes=64) as c:      # 16 floats per block
        c.init({"L": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1.0))

        def push(i):
            row = np.zeros(n, np.float32)
            row[i] = 1.0
            c.push({"L": row}).result(10)
            acked_at[i] = time.time()
            wait_for(lambda: time.time() > acked_at[i] + 0.03, 1, "the clock to move on")
        for i in range(8):
            push(i)
        assert all(r.get("path") for r in admin.checkpoint(cluster.url))
        for i in range(8, n):
            push(i)
        c.init({"late": np.full(40, 5.0, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"late": np.ones(40, np.float32)}).result(10)
    cluster.stop()
    cut = acked_at[15] + 0.01
    for at, rows, late in ((cut, 16, None), (None, n, 4.0)):
        args = ["restore", "--from", data, "--log", log, "--port", "0",
                "--data-dir", str(tmp_path / f"new{at is None}")]
        if at is not None:     # a checkpoint from before the cut, plus the log up to it
            args += ["--at", repr(at)]
        else:                  # without the clean stop's checkpoints: the log does it all
            import shutil
            for sid in checkpoint.shards_in(data):
                shutil.rmtree(checkpoint.list_for(data, sid)[-1].path)
        proc = _spawn(args)
        try:
            url = _ready_url(proc)
            with gradbus.connect(url) as c:
                got = c.pull(["L"], min_version=rows, timeout=30)["L"]
                assert np.array_equal(got, -np.array([1.0] * rows + [0.0] * (n - rows),
                                                     np.float32)), got
                names = [t["name"] for t in c.status()["tensors"]]
                if late is None:
                    assert "late" not in names
                else:
                    assert np.array_equal(c.pull(["late"], min_version=1, timeout=30)["late"],
                                          np.full(40, late, np.float32))
        finally:
            _stop([proc])


def test_update_log_survives_a_torn_tail(tmp_path):
    from gradbus.broker import log as ulog
    lg = ulog.UpdateLog(str(tmp_path), "never")
    d, buf = wire.encode_tensor("w/0", np.ones(4, np.float32))
    for seq in (1, 2, 3):
        lg.append([{"p": 5, "seq": seq, "epoch": 1, "e": [{"op": "push", "i": 0}]}], [d],
                  [bytes(buf)], 100.0 + seq)
    lg.close()
    seg = lg.segments()[-1]
    with open(seg, "r+b") as f:
        f.truncate(os.path.getsize(seg) - 7)           # a crash mid-record
    idx = ulog.LogIndex(str(tmp_path))
    assert [h["seq"] for h, _ in idx.after(5, 0)] == [1, 2]
    assert [h["seq"] for h, _ in idx.after(5, 1, until=101.5)] == []
    assert [h["seq"] for h, _ in idx.after(5, 0, until=101.5)] == [1]


@pytest.mark.parametrize("restore", [True, False])
def test_a_shard_with_no_standby_is_rebuilt_from_checkpoint_plus_the_log(make_cluster, tmp_path,
                                                                          restore):
    """One copy of everything, the broker logging: the shard is killed after a checkpoint and
    more pushes, and comes back from that checkpoint (or from nothing); the broker replays its
    log after the seq the shard brings back, so the weights hold every acknowledged push."""
    data, log = str(tmp_path / "data"), str(tmp_path / "log")
    fast = ["--heartbeat-interval", "0.1", "--liveness", "5"]
    cluster = make_cluster(1, broker_args=[*fast, "--log-dir", log, "--log-fsync", "always"],
                           shard_args=[*fast, "--data-dir", data, "--checkpoint-interval", "0"])
    w0 = (np.arange(3000) % 32 / 32).astype(np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        for _ in range(10):
            c.push({"w": np.ones_like(w0)}).result(10)
        ck = admin.checkpoint(cluster.url)[0]["path"]
        for _ in range(10):
            c.push({"w": np.ones_like(w0)}).result(10)
        cluster.kill_shard("shard-0")
        wait_for(lambda: admin.status(cluster.url)["counters"].get("shards_lost"), 10,
                 "the broker to notice")
        cluster.shard_extra["shard-0"] = ["--restore", ck] if restore else []
        cluster.add_shard("shard-0")
        wait_for(lambda: not admin.status(cluster.url)["partitions_down"]
                 and admin.status(cluster.url)["shards"][0]["alive"], 20, "the shard back")
        c.push({"w": np.ones_like(w0)}).result(20)
        w = c.pull(["w"], min_version=21, timeout=30)["w"]
    assert np.array_equal(w, w0 - 21 * LR)
    # log records replayed: one per batch, and how pushes fell into batches is timing's
    assert admin.status(cluster.url)["counters"]["replay_scheduled"] >= 1


def test_a_restarted_broker_hearing_first_from_an_empty_rejoining_shard_still_recovers():
    """The first shard back may hold nothing (fenced and not rebuilt): it says it rejoins, so
    pushes of keys the broker has not relearned yet get RECOVERING, not UNKNOWN_KEY."""
    from gradbus.broker.core import BrokerCore
    rig = RepRig(("s0", "s1"))
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    for fresh, code in ((False, "RECOVERING"), (True, "UNKNOWN_KEY")):
        rig.broker = BrokerCore(16)
        rig.deliver(rig.broker.on_backend(b"s9", [wire.pack(wire.REGISTER, shard="s9",
                                                            rejoin=not fresh)], 0))
        rig.client(b"c", push_msg(5, layout, np.ones(4, np.float32)))
        assert rig.replies(b"c")[0]["code"] == code
        # a client's layout lookup of the tensor too: asked again, not told it is unknown
        rig.client(b"c", [wire.pack(wire.CATALOG, req=7, names=["w"])])
        r = rig.replies(b"c")[0]
        if fresh:
            assert r["kind"] == wire.CATALOG_REPLY and r["tensors"] == [], r
        else:
            assert r["code"] == "RECOVERING" and "catalog of w" in r["message"], r
