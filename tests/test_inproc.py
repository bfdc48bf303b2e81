"""Shards inside the broker's process (``gradbus broker --inproc-shards``, ``gradbus up
--inproc``): the pipe between them, and the same cluster behaviour as with shard processes:
every push answered and applied once (also when the transport drops pushes and acks),
replicas equal, partitions moved to a shard process added at runtime, a drained shard gone,
checkpoints written at the stop and read at the next start, and the operator's mistakes
refused with a clear message."""
from __future__ import annotations

import collections
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import zmq

import gradbus
from gradbus import admin, metrics
from gradbus.broker.server import BrokerServer
from gradbus.cluster import LocalCluster
from gradbus.codecs import security, wire
from gradbus.codecs.errors import Code
from gradbus.codecs.pipe import Pipe
from gradbus.shards import checkpoint
from gradbus.shards.server import ShardServer

from .rigs import wait_for

N = 4096
BOTH_DATA_PATHS = True       # tensor bytes through shared memory, and as frames over the pipe


# -- the pipe ------------------------------------------------------------------------------------
def test_the_pipe_hands_whole_messages_over_as_views_in_order():
    pipe = Pipe()
    end = pipe.shard
    assert end.poll(0) == 0
    with pytest.raises(zmq.Again):
        end.recv_multipart(zmq.NOBLOCK)
    arr = np.arange(8, dtype=np.float32)
    assert pipe.put([b"head", zmq.Frame(b"zmq-frame"), arr])
    assert pipe.put([b"second"])
    assert end.poll(0) == 1
    got = end.recv_multipart(zmq.NOBLOCK, copy=False)
    assert [type(f) for f in got] == [memoryview] * 3
    assert bytes(got[0]) == b"head" and bytes(got[1]) == b"zmq-frame"
    assert np.array_equal(np.frombuffer(got[2], np.float32), arr)
    assert [bytes(f) for f in end.recv_multipart()] == [b"second"]
    assert end.take() is None                  # the loop's drain: empty says so, no exception
    pipe.put([b"third"])
    assert [bytes(f) for f in end.take()] == [b"third"] and end.take() is None
    end.send(b"one")
    end.send_multipart([b"two", b"parts"])
    assert [bytes(f) for f in pipe.take()] == [b"one"]
    assert [bytes(f) for f in pipe.take()] == [b"two", b"parts"]
    assert pipe.take() is None


def test_a_closed_pipe_refuses_messages_but_keeps_what_the_shard_sent_before():
    pipe = Pipe()
    pipe.put([b"unread"])
    pipe.shard.send(b"bye")
    pipe.shard.close()
    assert pipe.shard.lost and pipe.shard.poll(0) == 1      # the loop sees it at once
    assert not pipe.put([b"late"])
    with pytest.raises(zmq.Again):
        pipe.shard.recv_multipart()                       # what waited for the shard is gone
    pipe.shard.send(b"after")                               # dropped
    assert [bytes(f) for f in pipe.take()] == [b"bye"]
    assert pipe.take() is None


# -- a cluster whose shards run in the broker's process -----------------------------------------
def test_inproc_shards_answer_and_apply_every_push_once(make_cluster, data_path):
    cluster = make_cluster(2, inproc=True)
    assert cluster.shard_procs == {}                       # no shard process
    with gradbus.connect(cluster.url, resend_after=60) as c:
        c.init({"w": np.zeros(N, np.float32), "v": np.zeros(64, np.float32)},
               optimizer=gradbus.SGD(lr=1.0))
        for _ in range(300):             # one at a time
            ack = c.push({"w": np.ones(N, np.float32), "v": np.ones(64, np.float32)}).result(30)
        futs = collections.deque()
        for _ in range(700):             # a window in flight
            futs.append(c.push({"w": np.ones(N, np.float32), "v": np.ones(64, np.float32)}))
            while len(futs) > 16:
                ack = futs.popleft().result(30)
        for f in futs:
            ack = f.result(30)
        got = c.pull(min_version=ack["ver"], timeout=30)
        assert np.array_equal(got["w"], np.full(N, -1000.0, np.float32))
        assert np.array_equal(got["v"], np.full(64, -1000.0, np.float32))
        assert c.stats["resends"] == 0
    st = admin.status(cluster.url)
    assert sorted(s["id"] for s in st["shards"] if s["alive"]) == ["shard-0", "shard-1"]
    assert st["counters"]["pushes_applied"] == 1000
    # shared memory: the client's link only (the shards need none); frames: no link at all
    assert st["counters"].get("links_opened", 0) == (1 if data_path == "shm" else 0)


def test_dropped_pushes_and_acks_are_sent_again_and_applied_once(make_cluster):
    cluster = make_cluster(1, inproc=True, broker_args=["--fault-drop", "0.05",
                                                        "--fault-seed", "7"])
    total = 300
    with gradbus.connect(cluster.url, resend_after=0.3) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        futs = collections.deque()
        for _ in range(total):
            futs.append(c.push({"w": np.ones(N, np.float32)}))
            if len(futs) >= 8:
                futs.popleft().result(60)
        for f in futs:
            f.result(60)
        assert c.stats["resends"] > 0                      # the drops happened
        w = c.pull(["w"], min_version=total, timeout=30)["w"]
    assert np.array_equal(w, np.full(N, -float(total), np.float32))
    assert admin.status(cluster.url)["counters"]["pushes_applied"] == total


def test_inproc_replicas_hold_equal_state(make_cluster):
    # replicas=2: each partition on both shards; the fixture compares their digests
    cluster = make_cluster(2, inproc=True, replicas=2)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.Adam(lr=0.01))
        rng = np.random.default_rng(1)
        for _ in range(50):
            ack = c.push({"w": rng.standard_normal(N).astype(np.float32)}, acks="all").result(30)
        c.pull(min_version=ack["ver"], timeout=30)
    digests = admin.digest(cluster.url)
    assert set(digests) == {"shard-0", "shard-1"}
    assert digests["shard-0"] == digests["shard-1"]


def _sixteen_tensors(c, n: int, pushes: int) -> dict:
    """Sixteen tensors of ``n`` over the partitions, SGD at lr 1, ``pushes`` pushes of ones;
    returns the ones."""
    c.init({f"t{i}": np.zeros(n, np.float32) for i in range(16)}, optimizer=gradbus.SGD(lr=1.0))
    ones = {f"t{i}": np.ones(n, np.float32) for i in range(16)}
    for _ in range(pushes):
        c.push(ones).result(30)
    return ones


def test_partitions_move_to_a_shard_process_added_at_runtime(make_cluster):
    cluster = make_cluster(1, inproc=True)
    with gradbus.connect(cluster.url) as c:
        ones = _sixteen_tensors(c, 256, 20)
        cluster.add_shard("outside")                       # a shard process of its own
        cluster.wait_ready(2)
        admin.rebalance(cluster.url)
        wait_for(lambda: any(s["id"] == "outside" and s["primary"] > 0
                             for s in admin.status(cluster.url)["shards"]), 60,
                 "partitions to move to the shard process")
        for _ in range(20):
            ack = c.push(ones).result(30)
        got = c.pull(min_version=ack["ver"], timeout=30)
    for name, w in got.items():
        assert np.array_equal(w, np.full(256, -40.0, np.float32)), name


def test_a_drained_inproc_shard_stops_and_the_other_holds_everything(make_cluster):
    cluster = make_cluster(2, inproc=True)
    with gradbus.connect(cluster.url) as c:
        ones = _sixteen_tensors(c, 128, 10)
        admin.drain(cluster.url, "shard-0")
        wait_for(lambda: [s["id"] for s in admin.status(cluster.url)["shards"]
                          if s["alive"]] == ["shard-1"], 60, "shard-0 to drain and leave")
        for _ in range(10):
            ack = c.push(ones).result(30)
        got = c.pull(min_version=ack["ver"], timeout=30)
    assert cluster.broker_proc.poll() is None              # the broker runs on
    for name, w in got.items():
        assert np.array_equal(w, np.full(128, -20.0, np.float32)), name


def test_inproc_shards_checkpoint_at_the_stop_and_start_from_it(tmp_path):
    data = str(tmp_path / "data")
    with LocalCluster(1, port=0, inproc=True, data_dir=data) as cluster:
        with gradbus.connect(cluster.url) as c:
            c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
            for _ in range(30):
                ack = c.push({"w": np.ones(N, np.float32)}).result(30)
            c.pull(min_version=ack["ver"], timeout=30)
    assert checkpoint.newest(data, "shard-0") is not None
    with LocalCluster(1, port=0, inproc=True, data_dir=data) as cluster:
        with gradbus.connect(cluster.url) as c:
            w = c.pull(["w"], timeout=30)["w"]
    assert np.array_equal(w, np.full(N, -15.0, np.float32))


def test_a_shard_process_named_like_a_live_inproc_shard_is_refused(make_cluster):
    cluster = make_cluster(1, inproc=True)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.ones(N, np.float32)}).result(30)
        cluster.add_shard("shard-0")            # the operator's mistake: a second shard-0
        wait_for(lambda: admin.status(cluster.url)["errors"].get(
            Code.SHARD_ID_IN_USE.value, 0) >= 1, 60, "the impostor's REGISTER refused")
        ack = c.push({"w": np.ones(N, np.float32)}).result(30)
        w = c.pull(["w"], min_version=ack["ver"], timeout=30)["w"]
    assert np.array_equal(w, np.full(N, -2.0, np.float32))     # the inproc shard kept it all
    shards = admin.status(cluster.url)["shards"]
    assert [(s["id"], s["alive"]) for s in shards] == [("shard-0", True)]


def test_inproc_shards_serve_their_own_metrics(make_cluster):
    cluster = make_cluster(2, inproc=True, metrics_port=0)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.ones(N, np.float32)}).result(30)
    urls = wait_for(lambda: len(u := admin.status(cluster.url)["metrics_urls"]) == 3 and u,
                    30, "the broker's and both shards' metrics URLs")
    assert sorted(urls) == ["broker", "shard-0", "shard-1"]
    applied = 0.0
    for sid in ("shard-0", "shard-1"):
        with urllib.request.urlopen(urls[sid], timeout=10) as r:
            text = r.read().decode()
        assert "gradbus_shard_" in text
        applied += sum(v for k, v in metrics.parse(text).items()
                       if k.startswith("gradbus_shard_pushes_applied_total"))
    assert applied == 1.0                      # the one push, counted by the shard holding w


# -- in one process: a socket naming an inproc shard's identity, and refusals ------------------
def test_a_socket_naming_an_inproc_shards_identity_takes_nothing():
    srv = BrokerServer("127.0.0.1", 0)
    srv.add_shard(lambda connect: ShardServer(srv.url, "s0", ctx=srv.ctx, connect=connect))
    thread = srv.start_thread()
    ctx = zmq.Context()
    try:
        ident = next(iter(srv.inproc.pipes))
        wait_for(lambda: any(s["alive"] for s in admin.status(srv.url)["shards"]), 30,
                 "the inproc shard to register")
        rogue = ctx.socket(zmq.DEALER)
        rogue.linger = 0
        rogue.setsockopt(zmq.ROUTING_ID, ident)
        rogue.connect(f"tcp://127.0.0.1:{srv.backend_port}")
        rogue.send(wire.pack(wire.BYE))
        wait_for(lambda: admin.status(srv.url)["counters"].get("links_impersonated", 0) >= 1,
                 30, "the impersonation to be counted")
        assert [s["id"] for s in admin.status(srv.url)["shards"] if s["alive"]] == ["s0"]
        rogue.close()
    finally:
        srv.stop()
        thread.join(30)
        ctx.term()
    assert not thread.is_alive()


def test_a_failing_inproc_shard_is_counted_and_the_broker_serves_on():
    srv = BrokerServer("127.0.0.1", 0)
    shard = srv.add_shard(lambda connect: ShardServer(srv.url, "s0", ctx=srv.ctx,
                                                      connect=connect))
    turn, failures = shard.turn, []

    def failing_turn():          # a bug in the shard's housekeeping, a few times
        if len(failures) < 3:
            failures.append(1)
            raise RuntimeError("a bug")
        turn()
    shard.turn = failing_turn
    thread = srv.start_thread()
    try:
        wait_for(lambda: len(failures) == 3, 30, "the shard's turns to fail")
        st = wait_for(lambda: (s := admin.status(srv.url))["errors"].get("INTERNAL", 0) >= 3
                      and s, 30, "the failures to be counted")
        assert [s["id"] for s in st["shards"] if s["alive"]] == ["s0"]
        with gradbus.connect(srv.url) as c:        # and it still applies pushes
            c.init({"w": np.zeros(16, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            ack = c.push({"w": np.ones(16, np.float32)}).result(30)
            assert np.array_equal(c.pull(["w"], min_version=ack["ver"], timeout=30)["w"],
                                  np.full(16, -1.0, np.float32))
    finally:
        srv.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_an_inproc_shard_is_refused_with_curve(tmp_path):
    security.generate(tmp_path, "broker")
    curve = security.Curve.from_files(str(tmp_path / "broker.key_secret"),
                                      allow=str(tmp_path))
    srv = BrokerServer("127.0.0.1", 0, curve=curve)
    try:
        with pytest.raises(ValueError, match="without CURVE"):
            srv.add_shard(lambda connect: ShardServer(srv.url, "s0", ctx=srv.ctx,
                                                      connect=connect))
    finally:
        srv.close()


@pytest.mark.parametrize("args, says", [
    (["broker", "--port", "0", "--inproc-shards", "1", "--peer", "tcp://127.0.0.1:1"],
     "without --peer"),
    (["broker", "--port", "0", "--data-dir", "somewhere"], "is for --inproc-shards"),
    (["up", "--port", "0", "--inproc", "--brokers", "2"], "one broker process"),
])
def test_the_operators_mistakes_are_refused_with_a_clear_message(args, says):
    out = subprocess.run([sys.executable, "-m", "gradbus", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert says in out.stderr
