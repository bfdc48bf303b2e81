"""A partition whose only copy was lost comes back when a shard registers holding a copy at
least as new as what the broker acknowledged for it; until then pushes say it is lost."""
from __future__ import annotations

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
