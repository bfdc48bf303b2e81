"""Replication, failover, fencing and catch-up in the broker and shard state machines
(no sockets: the broker core and shard cores are wired in memory, messages can be held back)."""
from __future__ import annotations

import numpy as np
import pytest

from gradbus.broker.core import BrokerCore
from gradbus.broker.faults import FaultInjector
from gradbus.codecs import wire
from gradbus.codecs.partition import partition_of
from gradbus.shards.core import ShardCore

from .rigs import ADAM, RepRig, init_msg, push_msg, unpack


def _push_all(rig, layout, n, start=2, acks=1, grad=None):
    g = np.ones(layout.size, np.float32) if grad is None else grad
    for m in range(start, start + n):
        frames = push_msg(m, layout, g)
        if acks != 1:
            h = unpack(frames[0])
            h["acks"] = acks
            frames[0] = wire.pack(h.pop("kind"), h.pop("t"), **{k: v for k, v in h.items()
                                                                  if k != "v"})
        rig.client(b"c", frames)


def test_every_partition_gets_a_primary_and_standby_and_replicas_are_identical():
    rig = RepRig(replicas=2)
    frames, layout = init_msg(1, "w", np.arange(12, dtype=np.float32), opt=ADAM)
    rig.client(b"c", frames)
    _push_all(rig, layout, 6)
    b = rig.broker
    for key in layout.block_keys():
        p = partition_of(key, 16)
        assert b.owners[p] and len(b.standbys[p]) == 1 and b.standbys[p][0] != b.owners[p]
        d = rig.digests(p)
        assert len(d) == 2 and len(set(d.values())) == 1, d     # bit-identical, Adam state too
    # only the primary published weights
    assert all(unpack(m[1])["kind"] in ("update", "table") for m in rig.published)
    assert len([m for m in rig.published if m[0].startswith(b"p")]) == 7 * layout.nblocks
    b.validate_state()


def test_acks_all_waits_for_every_replica_acks_1_for_the_primary():
    rig = RepRig(replicas=2)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    p = partition_of("w/0", 16)
    standby = rig.broker.standbys[p][0]
    rig.intercept = lambda sid, kind: sid == standby and kind == "batch"
    _push_all(rig, layout, 1, start=2, acks=1)
    _push_all(rig, layout, 1, start=3, acks=wire.ACKS_ALL)
    assert [r["msg"] for r in rig.replies(b"c")] == [2]      # acks=all still waits
    rig.intercept = None
    rig.release(standby)
    assert [r["msg"] for r in rig.replies(b"c")] == [3]
    rig.broker.validate_state()


def test_primary_death_promotes_standby_and_nothing_acked_is_lost():
    rig = RepRig(replicas=2, heartbeat_interval=0.1, liveness=3)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    p = partition_of("w/0", 16)
    primary, standby = rig.broker.owners[p], rig.broker.standbys[p][0]
    epoch = rig.broker.epochs[p]
    # the primary stops answering: batches reach the standby only
    rig.dead = {primary}
    rig.intercept = lambda sid, kind: sid == primary
    _push_all(rig, layout, 5, start=2, acks=wire.ACKS_ALL)
    assert rig.replies(b"c") == []
    for _ in range(5):
        rig.tick(0.1)
    assert not rig.broker.shards[primary].alive
    assert rig.broker.owners[p] == standby and rig.broker.epochs[p] == epoch + 1
    assert sorted(r["msg"] for r in rig.replies(b"c") if r["kind"] == "ack") == [2, 3, 4, 5, 6]
    _push_all(rig, layout, 3, start=7, acks=wire.ACKS_ALL)   # new primary, no error
    assert all(r["kind"] == "ack" for r in rig.replies(b"c"))
    assert np.array_equal(rig.shards[standby].store.blocks["w/0"].value,
                          np.full(4, -0.5 * 8, np.float32))
    assert rig.broker.failovers[-1]["to"] == standby
    table = unpack(rig.published[-1][1]) if rig.published[-1][0] == b"t" else None
    assert table is None or table["owners"][p] == standby
    rig.broker.validate_state()


def test_returning_zombie_is_fenced_then_rebuilt_as_an_identical_standby():
    rig = RepRig(("s0", "s1"), replicas=2, heartbeat_interval=0.1, liveness=3)
    frames, layout = init_msg(1, "w", np.arange(8, dtype=np.float32), opt=ADAM)
    rig.client(b"c", frames)
    p = partition_of("w/0", 16)
    primary = rig.broker.owners[p]
    rig.dead = {primary}
    rig.intercept = lambda sid, kind: sid == primary     # a stalled process: messages queue
    _push_all(rig, layout, 3)
    for _ in range(5):
        rig.tick(0.1)
    assert rig.broker.owners[p] != primary
    # it wakes up and processes what queued: its APPLIED is refused (declared dead) ...
    queued = [a for a in rig.held if unpack(a.frames[0])["kind"] == "batch"]
    assert len(queued) == 2          # the third push waits for the credit of the first two
    rig.intercept = None
    rig.dead = set()
    rig.release(primary)
    assert rig.broker.errors["NOT_REGISTERED"] == len(queued)    # one per APPLIED
    # ... it registers again with its stale partitions: told to drop them, then rebuilt
    rig.register(primary)
    held = {partition_of(k, 16) for k in layout.block_keys()}    # each on both shards
    assert rig.broker.counters["fenced_partitions"] == len(held)
    _push_all(rig, layout, 2, start=10)
    rig.tick(0.05)      # repair: adopt + state from the new primary
    _push_all(rig, layout, 2, start=20)
    d = rig.digests(p)
    assert set(d) == {"s0", "s1"} and len(set(d.values())) == 1, d
    assert rig.broker.standbys[p] == [primary]
    rig.broker.validate_state()


def test_catch_up_buffers_batches_sent_while_the_state_is_in_transit():
    rig = RepRig(shards=("s0",), replicas=2)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32), opt=ADAM)
    rig.client(b"c", frames)
    _push_all(rig, layout, 3)
    p = partition_of("w/0", 16)
    assert rig.broker.standbys[p] == []                    # under-replicated: one shard
    assert rig.broker.status(0)["under_replicated"] == 1     # the one block's
    rig.shards["s1"] = ShardCore("s1")
    rig.register("s1")
    rig.intercept = lambda sid, kind: sid == "s1" and kind == "state"
    rig.tick(0.01)                                         # adopt sent, state held in transit
    assert "s1" in rig.broker.syncing[p]
    _push_all(rig, layout, 4, start=10)                    # batches reach s1 before the state
    assert rig.shards["s1"].installing[p]
    rig.intercept = None
    rig.release("s1")
    assert rig.broker.standbys[p] == ["s1"] and p not in rig.broker.syncing
    _push_all(rig, layout, 2, start=20)
    d = rig.digests(p)
    assert set(d) == {"s0", "s1"} and len(set(d.values())) == 1
    rig.broker.validate_state()


def test_losing_the_only_copy_still_fails_fast():
    rig = RepRig(shards=("s0",), replicas=2, heartbeat_interval=0.1, liveness=3)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    rig.dead = {"s0"}
    rig.intercept = lambda sid, kind: True
    _push_all(rig, layout, 1)
    for _ in range(5):
        rig.tick(0.1)
    assert [r["code"] for r in rig.replies(b"c")] == ["SHARD_UNAVAILABLE"]


@pytest.mark.parametrize("drop", [0.3])
def test_fault_drop_is_seeded_and_counted(drop):
    def run():
        core = BrokerCore(16, replicas=1)
        b = FaultInjector(core, drop, seed=7)     # at the transport, as the server loop does
        b.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0")], 0)
        frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
        b.on_frontend(b"c", frames, 0)
        out = [b.on_frontend(b"c", push_msg(m, layout, np.ones(4, np.float32)), 0)
               for m in range(2, 40)]
        return core.counters["fault_dropped_pushes"], [len(o) for o in out]
    first, second = run(), run()
    assert first == second and 3 <= first[0] <= 25


def test_bad_acks_value_is_refused():
    rig = RepRig(shards=("s0",))
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    _push_all(rig, layout, 1, acks=5)
    assert rig.replies(b"c")[0]["code"] == "BAD_FIELD"
