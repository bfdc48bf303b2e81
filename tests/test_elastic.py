"""Shards added and drained at runtime: partitions move (catch-up, then the owner flips with a
new epoch) while pushes go on; nothing is lost or applied twice."""
from __future__ import annotations

import json

import numpy as np

import gradbus
from gradbus import admin
from gradbus.codecs import wire
from gradbus.codecs.errors import Code
from gradbus.codecs.partition import partition_of
from gradbus.shards.core import ShardCore

from .rigs import RepRig, init_msg, push_msg, unpack, wait_for

LR = 2.0 ** -6


def _tensor(rig, n=64, name="w"):
    frames, layout = init_msg(1, name, np.zeros(n, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    return layout


def _value(rig, layout):
    b = rig.broker
    out = []
    for key in layout.block_keys():
        p = partition_of(key, 16)
        out.append(rig.shards[b.owners[p]].store.blocks[key].value)
    return np.concatenate(out)


def test_a_new_shard_gets_a_share_and_moves_keep_every_push():
    rig = RepRig(("s0",))
    layout = _tensor(rig)
    m = 2
    for _ in range(5):
        rig.client(b"c", push_msg(m, layout, np.ones(64, np.float32)))
        m += 1
    before = rig.broker.shards["s0"].bytes
    rig.shards["s1"] = ShardCore("s1")
    rig.register("s1")
    assert rig.broker.rebalance_wanted
    rig.intercept = lambda sid, kind: sid == "s1" and kind == "state"   # states in transit
    rig.tick(0.01)
    moving = dict(rig.broker.moves)
    assert moving and all(mv["to"] == "s1" for mv in moving.values())
    for _ in range(3):                                 # pushes while partitions move
        rig.client(b"c", push_msg(m, layout, np.ones(64, np.float32)))
        m += 1
    rig.intercept = None
    rig.release("s1")
    for p in moving:
        assert rig.broker.owners[p] == "s1" and rig.broker.epochs[p] == 2
        assert p not in rig.shards["s0"].store.partitions      # dropped at the source
    moved = 16 * sum(partition_of(k, 16) in moving for k in layout.block_keys())  # 16 B a block
    assert rig.broker.shards["s1"].bytes == moved > 0
    assert rig.broker.shards["s0"].bytes == before - moved
    for _ in range(2):
        rig.client(b"c", push_msg(m, layout, np.ones(64, np.float32)))
        m += 1
    acks = [r for r in rig.replies(b"c") if r["kind"] == "ack"]
    assert len(acks) == 10
    assert np.array_equal(_value(rig, layout), np.full(64, -0.5 * 10, np.float32))
    assert len(rig.broker.move_log) == len(moving)
    rig.broker.validate_state()


def test_drain_moves_everything_off_then_stops_the_shard():
    rig = RepRig(("s0", "s1"), auto_rebalance=False)
    layout = _tensor(rig, n=128)
    for m in range(2, 6):
        rig.client(b"c", push_msg(m, layout, np.ones(128, np.float32)))
    held = set(rig.broker.shards["s0"].partitions)
    assert held
    stops = []
    orig = rig.to_shard

    def spy(sid, frames):
        if unpack(frames[0])["kind"] == "stop":
            stops.append(sid)
            return
        orig(sid, frames)
    rig.to_shard = spy
    rig.deliver(rig.broker.on_frontend(b"ops", [wire.pack(wire.ADMIN, req=1, op="drain",
                                                          shard="s0")], 0))
    for _ in range(3):
        rig.tick(0.01)
    assert rig.broker.shards["s0"].partitions == set() and stops == ["s0"]
    assert all(rig.broker.owners[p] == "s1" for p in held)
    rig.client(b"c", push_msg(9, layout, np.ones(128, np.float32)))
    assert np.array_equal(_value(rig, layout), np.full(128, -0.5 * 5, np.float32))
    rig.broker.validate_state()


def test_draining_the_only_shard_is_refused():
    rig = RepRig(("s0",))
    _tensor(rig)
    rig.deliver(rig.broker.on_frontend(b"ops", [wire.pack(wire.ADMIN, req=1, op="drain",
                                                          shard="s0")], 0))
    assert rig.replies(b"ops")[0]["code"] == "BAD_REQUEST"


def test_grow_to_three_shrink_to_two_known_answer_and_digests(make_cluster):
    """Training starts on 1 shard, grows to 3 and shrinks to 2 while it runs; the final weights
    are exact (SGD) and every partition's digest equals a run that never moved anything."""
    n_push = 150
    w0 = (np.arange(20000) % 64 / 64).astype(np.float32)   # every step exact in float32
    fast = ["--heartbeat-interval", "0.1", "--liveness", "5"]

    def train(cluster, grow):
        with gradbus.connect(cluster.url, block_bytes=4096) as c:
            c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
            for i in range(n_push):
                c.push({"w": np.ones_like(w0)}, acks=1)
                if grow and i == 30:
                    cluster.add_shard("shard-1")
                    cluster.add_shard("shard-2")
                if grow and i == 80:
                    wait_for(lambda: admin.status(cluster.url)["counters"].get("moves", 0) > 0,
                             20, "partitions to move to the new shards")
                    admin.drain(cluster.url, "shard-0")
            c.flush(30)
            if grow:
                wait_for(lambda: _settled(cluster.url), 30, "the drain to finish")
            w = c.pull(["w"], min_version=n_push, timeout=30)["w"]
            return w, admin.digest(cluster.url)

    moving = make_cluster(1, broker_args=fast, shard_args=fast)
    w_moved, d_moved = train(moving, True)
    static = make_cluster(1)
    w_static, d_static = train(static, False)
    assert np.array_equal(w_moved, w0 - n_push * LR) and np.array_equal(w_moved, w_static)
    st = admin.status(moving.url)
    alive = sorted(s["id"] for s in st["shards"] if s["alive"])
    # moves: as many as the rebalancer chose while shards came and went (timing-dependent)
    assert alive == ["shard-1", "shard-2"] and st["counters"]["moves"] > 0
    assert st["counters"]["pushes_applied"] == n_push
    flat = lambda d: {p: v[1] for parts in d.values() for p, v in parts.items()}  # noqa: E731
    assert flat(d_moved) == flat(d_static)     # same values, versions and optimizer state
    # the moves are logged: partition, from, to, seconds
    assert all(m["to"] in ("shard-1", "shard-2") for m in st["moves"])


def _settled(url):
    st = admin.status(url)
    return (not st["moves_in_progress"]
            and [s["alive"] for s in st["shards"] if s["id"] == "shard-0"] == [False])


def test_rebalance_and_drain_commands(make_cluster):
    import subprocess
    import sys
    cluster = make_cluster(2, broker_args=["--heartbeat-interval", "0.1", "--liveness", "5"])
    w0 = np.zeros(40000, np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.push({"w": np.ones_like(w0)}).result(10)
        cluster.add_shard("shard-2")
        cluster.wait_ready(3)

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "gradbus", *args, "--broker",
                                   cluster.url], capture_output=True, text=True, timeout=120)
        r = cli("rebalance")
        assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stdout + r.stderr
        st = admin.status(cluster.url)
        assert {s["id"]: s["bytes"] > 0 for s in st["shards"]}["shard-2"]
        r = cli("shard", "drain", "shard-0")
        assert r.returncode == 0 and "draining shard-0" in r.stdout and r.stdout.strip(
        ).endswith("done"), r.stdout + r.stderr
        st = admin.status(cluster.url)
        assert [s["alive"] for s in st["shards"] if s["id"] == "shard-0"] == [False]
        c.push({"w": np.ones_like(w0)}).result(10)
        assert np.array_equal(c.pull(["w"], min_version=2, timeout=20)["w"], w0 - 2 * LR)
        r = cli("rebalance", "--json")           # balanced already: nothing to move
        assert r.returncode == 0 and json.loads(r.stdout)["moves"] == [], r.stdout + r.stderr
        r = subprocess.run([sys.executable, "-m", "gradbus", "status", "--broker", cluster.url],
                           capture_output=True, text=True, timeout=60)
        assert "PRIMARY" in r.stdout and "moves " in r.stdout
        r = cli("shard", "drain", "nope")
        assert r.returncode != 0 and "no live shard" in r.stderr


def test_partitions_catch_up_a_bounded_number_of_bytes_at_a_time():
    """Moves start while the bytes of the copies catching up stay under MAX_SYNC_BYTES (one
    partition always may): states in transit delay the heartbeats queued behind them."""
    rig = RepRig(("s0",), max_sync_bytes=600)     # about two partitions of this tensor
    layout = _tensor(rig, n=1024)                 # 256 blocks of 16 B over 16 partitions
    rig.shards["s1"] = ShardCore("s1")
    rig.intercept = lambda sid, kind: sid == "s1" and kind == "state"   # states in transit
    rig.register("s1")
    rig.tick(0.01)
    b = rig.broker
    first = dict(b.moves)
    assert 1 <= len(first) < 8
    assert sum(b.pbytes[p] for p in first) <= 600 or len(first) == 1
    rig.intercept = None
    for _ in range(40):            # the rest follow as the first ones finish
        rig.release("s1")
        rig.tick(0.01)
        if not b.moves and not b.rebalance_wanted:
            break
    assert b.counters["moves"] > len(first) and not b.moves
    assert abs(b.shards["s0"].bytes - b.shards["s1"].bytes) <= max(b.pbytes)
    np.testing.assert_array_equal(_value(rig, layout), np.zeros(1024, np.float32))


def test_a_moved_primary_still_publishes_what_it_was_sent_so_subscribers_see_no_gap():
    """The new copy catches up and takes over while the old primary is still applying the
    batches it was sent as primary: it publishes them after the flip, so the partition's
    updates reach subscribers with every seq, in order (nobody re-fetches the partition)."""
    rig = RepRig(("s0",))
    layout = _tensor(rig)
    for m in range(2, 4):
        rig.client(b"c", push_msg(m, layout, np.ones(64, np.float32)))
    rig.shards["s1"] = ShardCore("s1")
    rig.register("s1")
    rig.intercept = lambda sid, kind: sid == "s1" and kind == "state"   # catching up
    rig.tick(0.01)
    b = rig.broker
    moving = set(b.moves)
    assert moving
    rig.intercept = lambda sid, kind: (sid, kind) in (("s1", "state"), ("s0", "batch"))
    for m in range(4, 7):                           # s0 falls behind on these
        rig.client(b"c", push_msg(m, layout, np.ones(64, np.float32)))
    rig.release("s1")                               # s1 installs, applies, is in sync
    assert all(b.owners[p] == "s1" for p in moving)
    assert set(b.handover) == moving                # flipped before s0 reported
    rig.intercept = None
    rig.release("s0")
    rig.tick(0.01)
    assert not b.handover and not b.errors.get(Code.FENCED.value)
    for p in moving:
        seqs = [unpack(m[1])["seq"] for m in rig.published if m[0] == wire.topic_partition(p)]
        assert seqs == list(range(1, b.seq[p] + 1)), (p, seqs)   # every seq, in order
        assert b.published_seq[p] == b.seq[p]
    np.testing.assert_array_equal(_value(rig, layout), -5 * 0.5 * np.ones(64, np.float32))


def _init_blocks(rig, msg, name, n, block):
    from gradbus.codecs.partition import TensorLayout
    layout = TensorLayout(name, "float32", (n,), block)
    descs, bufs = [], []
    for i, key in enumerate(layout.block_keys()):
        d, buf = wire.encode_tensor(key, np.zeros(layout.block_range(i)[1]
                                                  - layout.block_range(i)[0], np.float32))
        descs.append(d)
        bufs.append(bytes(buf))
    rig.client(b"c", [wire.pack(wire.INIT, descs, msg=msg, opt={"name": "sgd", "lr": 0.1},
                                tensors=[{**layout.to_wire(), "init": {"name": "given"}}]),
                      *bufs])
    return layout


def test_rebalance_weighs_update_rate_as_well_as_bytes():
    """Big idle partitions and small hot ones on one shard: a new shard gets a share of both
    (by bytes alone the hot ones, a few bytes each, would all stay where they are; by a sum of
    the two, all the big ones could go one way and all the hot ones stay)."""
    from gradbus.codecs.partition import partition_of
    rig = RepRig(("s0",))
    big = _init_blocks(rig, 1, "big", 4 * 4096, 4096)      # 4 blocks of 16 KiB
    hot = _init_blocks(rig, 2, "hot", 4 * 4, 4)            # 4 blocks of 16 B
    pb = {partition_of(k, 16) for k in big.block_keys()}
    ph = {partition_of(k, 16) for k in hot.block_keys()}
    assert len(ph - pb) >= 2, (pb, ph)
    for m in range(3, 40):
        rig.client(b"c", push_msg(m, hot, np.ones(16, np.float32)))
        rig.tick(0.05)
    rig.join("s1")
    b = rig.broker
    on = {sid: {p for p in range(16) if b.owners[p] == sid} for sid in ("s0", "s1")}
    assert all(on[sid] & (ph - pb) for sid in on), (on, ph - pb)     # the hot ones are split
    assert all(on[sid] & pb for sid in on), (on, pb)                 # and so are the big ones
    loads = {s["id"]: s["load"] for s in b.status(rig.now)["shards"]}   # [bytes, rate] shares
    assert all(0.2 < x < 0.8 for sid in loads for x in loads[sid]), loads
