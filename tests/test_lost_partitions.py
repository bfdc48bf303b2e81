"""A partition whose only copy was lost comes back when a shard registers holding a copy at
least as new as what the broker acknowledged for it; until then pushes say it is lost."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.broker.actions import ToShard
from gradbus.codecs import wire
from gradbus.shards.core import ShardCore

from .rigs import RepRig, init_msg, push_msg, wait_for

LR = 2.0 ** -6
FAST = ["--heartbeat-interval", "0.1", "--liveness", "5"]


def _status(url):
    return admin.status(url, timeout=5.0)


def test_a_lost_partition_comes_back_when_its_shard_returns_with_a_checkpoint(make_cluster,
                                                                             tmp_path):
    """One shard, one copy of everything, no update log. The shard is killed after a
    checkpoint; it comes back holding nothing (its partitions are lost, pushes refused with
    the reason); it is killed again and comes back restored from the checkpoint: the
    partitions are up again and the weights hold every acknowledged push."""
    data = str(tmp_path / "data")
    cluster = make_cluster(1, broker_args=FAST,
                           shard_args=[*FAST, "--data-dir", data, "--checkpoint-interval", "0"])
    w0 = (np.arange(3000) % 32 / 32).astype(np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        for _ in range(10):
            c.push({"w": np.ones_like(w0)}).result(10)
        ck = admin.checkpoint(cluster.url)[0]["path"]

        cluster.kill_shard("shard-0")
        wait_for(lambda: _status(cluster.url)["counters"].get("shards_lost") == 1, 10,
                 "the broker to notice")
        cluster.add_shard("shard-0")                       # no --restore: it holds nothing
        wait_for(lambda: (st := _status(cluster.url))["shards"][0]["alive"]
                 and st["partitions_down"], 20, "the empty shard, its partitions lost")
        with pytest.raises(gradbus.GradbusError,
                           match=r"is lost: no registered shard holds a copy at seq >= \d+"):
            c.push({"w": np.ones_like(w0)}).result(10)

        cluster.kill_shard("shard-0")
        wait_for(lambda: _status(cluster.url)["counters"].get("shards_lost") == 2, 10,
                 "the broker to notice again")
        cluster.shard_extra["shard-0"] = ["--restore", ck]
        cluster.add_shard("shard-0")
        wait_for(lambda: (st := _status(cluster.url))["shards"][0]["alive"]
                 and not st["partitions_down"], 20, "the partitions back")
        c.push({"w": np.ones_like(w0)}).result(20)
        w = c.pull(["w"], min_version=11, timeout=30)["w"]
    assert np.array_equal(w, w0 - 11 * LR)
    assert _status(cluster.url)["counters"]["partitions_revived"] >= 1


def _lose(rig, layout, pushes):
    """s0 (the only shard) applies ``pushes`` and comes back empty: its partitions are lost."""
    for m in range(2, 2 + pushes):
        rig.client(b"c", push_msg(m, layout, np.ones(4, np.float32)))
    rig.replies(b"c")
    rig.shards["s0"] = ShardCore("s0")
    rig.register("s0")
    assert rig.broker.lost


def test_an_older_copy_does_not_bring_a_lost_partition_back_and_a_new_enough_one_does():
    """Core only: a copy behind what was acknowledged keeps the partition lost (pushes say
    which seq is needed); another shard registering with a copy that has it takes it over."""
    rig = RepRig(("s0",), partitions=1)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    p = next(iter(rig.broker.shards["s0"].partitions))
    need = rig.broker.acked.need(p)
    old = (need[0], need[1])           # the copy right after the init ...
    _lose(rig, layout, 3)              # ... then 3 pushes acknowledged, then lost
    assert rig.broker.acked.need(p)[1] == old[1] + 3
    rig.client(b"c", init_msg(21, "v", np.zeros(4, np.float32))[0])   # a new tensor there
    r = rig.replies(b"c")[0]
    assert r["code"] == "SHARD_UNAVAILABLE" and "is lost" in r["message"], r
    b = rig.broker
    out = b.on_backend(b"s9", [wire.pack(wire.REGISTER, shard="s9", holds=[[p, *old]])], b.now)
    assert p in b.lost and any(b"drop" in bytes(a.frames[0]) for a in out
                               if isinstance(a, ToShard))
    rig.client(b"c", push_msg(20, layout, np.ones(4, np.float32)))
    r = rig.replies(b"c")[0]
    assert r["code"] == "SHARD_UNAVAILABLE" and f"seq >= {old[1] + 3}" in r["message"], r
    new = b.acked.need(p)
    b.on_backend(b"s8", [wire.pack(wire.REGISTER, shard="s8", holds=[[p, *new]])], b.now)
    assert p not in b.lost and b.owners[p] == "s8" and p in b.shards["s8"].partitions
    assert p not in b.shards["s0"].partitions and p not in b.table.down()
    assert b.epochs[p] > new[0]
    b.validate_state()


def test_a_pull_does_not_fail_on_a_stale_table_and_does_on_a_true_one(make_cluster):
    """A client's table can be stale: a TABLE dropped on the way (the events socket drops past
    its queue), or still behind an ACK that came on the local link. A pull that finds its
    partitions down by that table asks the broker for its table first: with every partition
    up it returns the weights; with the shard truly gone it fails SHARD_UNAVAILABLE."""
    cluster = make_cluster(1, broker_args=FAST, shard_args=FAST)
    w0 = np.zeros(3000, np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096, timeout=20) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.ones_like(w0)}).result(10)
        parts = c.cache.partitions_of("w")
        assert parts and not _status(cluster.url)["partitions_down"]
        with c._cond:                 # the state a dropped "up" TABLE leaves behind
            c.cache.down = set(parts)

        def push_once_asked():        # the version the pull waits for, once it asked
            wait_for(lambda: c.stats["table_asks"] == 1, 20, "the pull to ask for the table")
            c.push({"w": np.ones_like(w0)}).result(10)

        pusher = threading.Thread(target=push_once_asked)
        pusher.start()
        try:
            w = c.pull(["w"], min_version=2, timeout=20)["w"]
        finally:
            pusher.join(30)
        assert np.array_equal(w, np.full_like(w0, -2.0))
        assert c.stats["table_asks"] == 1 and not c.cache.down

        cluster.kill_shard("shard-0")
        wait_for(lambda: _status(cluster.url)["partitions_down"], 10, "the broker to notice")
        with pytest.raises(gradbus.ShardUnavailableError, match="have no live shard"):
            c.pull(["w"], min_version=3, timeout=20)
        assert c.stats["table_asks"] == 2


def test_a_subscriber_to_the_table_gets_it_at_once(make_cluster):
    """The broker publishes its table on every subscription to the table topic: a client
    that subscribes again (its table may be stale) is answered without waiting for a
    change."""
    import zmq

    cluster = make_cluster(1, broker_args=FAST, shard_args=FAST)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(8, np.float32)})
        events = c.agent._events_url
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.connect(events)
        for ask in range(2):
            sub.subscribe(wire.TOPIC_TABLE)
            assert sub.poll(10_000), f"no TABLE after subscription {ask + 1}"
            topic, header = sub.recv_multipart()
            t = wire.unpack_header(header, frozenset({wire.TABLE}))
            assert topic == wire.TOPIC_TABLE and t["down"] == [] and "shard-0" in t["owners"]
            sub.unsubscribe(wire.TOPIC_TABLE)
    finally:
        ctx.destroy(linger=0)
