"""Broker, shard and client-cache state machines, driven without sockets."""
from __future__ import annotations

import re

import numpy as np
import pytest

from gradbus.codecs import shm, wire
from gradbus.codecs.partition import TensorLayout, partition_of
from gradbus.shards.core import ShardCore
from gradbus.workers.cache import WeightCache

from .rigs import JIT_PATHS, SGD, CheckedShard, Rig, init_msg, jit_path, push_msg, unpack


def test_init_push_ack_and_known_answer():
    rig = Rig(("s0", "s1"))
    frames, layout = init_msg(1, "w", np.arange(10, dtype=np.float32))
    rig.client(b"c1", frames)
    assert rig.replies(b"c1") == [{"v": 1, "kind": "init_ok", "msg": 1, "created": ["w"],
                                   "existing": []}]
    for m in range(2, 7):
        rig.client(b"c1", push_msg(m, layout, np.ones(10, np.float32)))
    acks = rig.replies(b"c1")
    assert [a["msg"] for a in acks] == [2, 3, 4, 5, 6] and {a["kind"] for a in acks} == {"ack"}
    values = np.concatenate([rig.shards[rig.broker.owners[partition_of(k, 16)]]
                             .store.blocks[k].value for k in layout.block_keys()])
    assert np.array_equal(values, np.arange(10, dtype=np.float32) - 5 * 0.5)
    assert rig.broker.status(0)["tensors"][0]["version"] == 5
    rig.broker.validate_state()


def test_batching_while_shard_has_no_credit_sums_pushes():
    rig = Rig(("s0",), shard_credit=1)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.hold = True
    rig.client(b"c", push_msg(2, layout, np.ones(4, np.float32)))     # goes out, credit used
    for m in (3, 4, 5):
        rig.client(b"c", push_msg(m, layout, np.full(4, 2.0, np.float32)))  # queue up
    assert len(rig.held) == 1
    rig.hold = False
    first = rig.held.pop()
    rig.to_shard("s0", first.frames)              # APPLIED returns credit -> next flush
    rig.deliver(rig.broker.flush(rig.now))
    last = unpack(rig.to_clients[-1][1][0])
    assert last["kind"] == "ack" and last["msgs"] == [3, 4, 5]   # one ACK for the batch
    batch_sizes = rig.broker.counters["batched_entries"], rig.broker.counters["batches"]
    assert batch_sizes == (5, 3)  # init, 1 push, then 3 pushes in one batch
    assert np.array_equal(rig.shards["s0"].store.blocks["w/0"].value,
                          np.full(4, -0.5 * (1 + 6), np.float32))
    assert [r["msg"] for r in rig.replies(b"c")][1:] == [2, 3, 4, 5]


def test_duplicate_push_applied_once_and_reacked():
    rig = Rig()
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    p = push_msg(7, layout, np.ones(4, np.float32))
    rig.client(b"c", p)
    rig.client(b"c", p)   # resend after the ack
    assert [r["kind"] for r in rig.replies(b"c")] == ["ack", "ack"]
    assert np.array_equal(rig.shards["s0"].store.blocks["w/0"].value, np.full(4, -0.5, np.float32))
    assert rig.broker.counters["duplicates"] == 1


def test_dead_shard_fails_inflight_and_new_pushes():
    rig = Rig(("s0",), heartbeat_interval=0.1, liveness=3)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    rig.hold = True
    rig.client(b"c", push_msg(2, layout, np.ones(4, np.float32)))
    assert rig.broker.on_tick(0.25) and rig.broker.shards["s0"].alive   # within liveness
    rig.deliver(rig.broker.on_tick(0.31))
    assert not rig.broker.shards["s0"].alive
    err = rig.replies(b"c")
    assert err[0]["kind"] == "error" and err[0]["code"] == "SHARD_UNAVAILABLE" and err[0]["msg"] == 2
    rig.client(b"c", push_msg(3, layout, np.ones(4, np.float32)))
    assert rig.replies(b"c")[0]["code"] == "SHARD_UNAVAILABLE"
    table = unpack(rig.published[-1][1])
    assert table["kind"] == "table" and partition_of("w/0", 16) in table["down"]
    rig.broker.validate_state()


def test_back_pressure_flag():
    rig = Rig(("s0",), shard_credit=1, max_pending_bytes=100)
    frames, layout = init_msg(1, "w", np.zeros(64, np.float32))
    rig.client(b"c", frames)
    rig.hold = True
    rig.client(b"c", push_msg(2, layout, np.ones(64, np.float32)))
    assert rig.broker.accepting()
    rig.client(b"c", push_msg(3, layout, np.ones(64, np.float32)))  # 256 B queued > 100
    assert not rig.broker.accepting()


# ---------------------------------------------------------------- shard core
def _batch(p, seq, entries, descs, frames):
    return [wire.pack(wire.BATCH, descs, parts=[{"p": p, "seq": seq, "epoch": 1, "e": entries}]),
            *frames]


OPTS = [{"name": "sgd", "lr": 0.5, "momentum": 0.5},
        {"name": "adam", "lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8},
        {"name": "adagrad", "lr": 0.1, "eps": 1e-10}]


def _textbook(opt, w, grads):
    """Each gradient one step, as the papers write it."""
    m, v, t = np.zeros_like(w), np.zeros_like(w), 0
    for g in grads:
        if opt["name"] == "sgd":
            m = 0.5 * m + g
            w = w - 0.5 * m
        elif opt["name"] == "adam":
            t += 1
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            w = w - 0.1 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        else:
            v = v + g * g
            w = w - 0.1 * g / (np.sqrt(v) + 1e-10)
    return w


def _shard_with(opt, w0):
    sc = CheckedShard("s")
    layout = TensorLayout("w", "float64", (w0.size,), 64)
    d, buf = wire.encode_tensor("w/0", w0)
    sc.handle(_batch(0, 1, [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
                             "rule": {"name": "given"}, "opt": opt, "i": 0}], [d], [bytes(buf)]))
    return sc


def _apply(sc, seq, grads):
    encs = [wire.encode_tensor("w/0", g) for g in grads]
    sc.handle(_batch(0, seq, [{"op": "push", "i": i} for i in range(len(grads))],
                     [e[0] for e in encs], [bytes(e[1]) for e in encs]))


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o["name"])
def test_shard_optimizers_one_push_per_batch_match_textbook(opt):
    w0 = np.linspace(-1, 1, 5)
    sc = _shard_with(opt, w0)
    grads = [np.random.default_rng(i).normal(size=5) for i in range(6)]
    for seq, g in enumerate(grads, start=2):
        _apply(sc, seq, [g])
    np.testing.assert_allclose(sc.store.blocks["w/0"].value, _textbook(opt, w0, grads), rtol=1e-12)
    assert sc.store.blocks["w/0"].version == 6


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o["name"])
def test_shard_batch_of_k_is_k_steps_of_the_mean(opt):
    """A batch of k pushes moves the weights about as far as k steps of their mean would:
    the outcome must not hinge on how the broker happened to batch."""
    w0 = np.linspace(-1, 1, 5)
    rng = np.random.default_rng(7)
    sc = _shard_with(opt, w0)
    base = rng.normal(size=5)
    seq_grads = []
    for seq in range(2, 6):
        grads = [base + 0.01 * rng.normal(size=5) for _ in range(4)]
        _apply(sc, seq, grads)
        seq_grads += [sum(grads) / 4] * 4
    got, ref = sc.store.blocks["w/0"].value, _textbook(opt, w0, seq_grads)
    if opt["name"] == "sgd":     # exact in closed form for k equal gradients
        np.testing.assert_allclose(got, ref, rtol=1e-12)
    else:
        moved, ref_moved = got - w0, ref - w0
        np.testing.assert_allclose(moved, ref_moved, rtol=0.1, atol=0.1 * np.abs(ref_moved).max())
    assert sc.store.blocks["w/0"].version == 16


def test_shard_redelivered_batch_is_not_reapplied_and_bad_entry_isolated():
    sc = CheckedShard("s")
    layout = TensorLayout("w", "float32", (4,), 4)
    sc.handle(_batch(3, 1, [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
                             "rule": {"name": "zeros"}, "opt": SGD}], [], []))
    good = wire.encode_tensor("w/0", np.ones(4, np.float32))
    bad = wire.encode_tensor("w/0", np.array([np.inf, 0, 0, 0], np.float32))
    msg = _batch(3, 2, [{"op": "push", "i": 0}, {"op": "push", "i": 1}],
                 [good[0], bad[0]], [bytes(good[1]), bytes(bad[1])])
    out = sc.handle(msg)
    res = unpack(out[0][0])["parts"][0]
    assert res["errors"][0][:2] == [1, "NOT_FINITE"]
    sc.handle(msg)   # redelivery
    assert np.array_equal(sc.store.blocks["w/0"].value, np.full(4, -0.5, np.float32))
    upd = unpack(out[0][1])
    assert upd["kind"] == "update" and upd["p"] == 3 and upd["seq"] == 2
    assert upd["t"][0]["ver"] == 1


def test_shard_catch_up_holds_batches_installs_the_state_then_applies_the_rest():
    """ADOPT holds the partition's batches; STATE installs the primary's export at its seq and
    applies the held batches after it; the standby ends equal to the primary; DROP forgets it.
    Both cores check their invariants after every message."""
    w0 = np.linspace(-1, 1, 8)
    primary = _shard_with({"name": "adam", "lr": 0.1}, w0)
    _apply(primary, 2, [np.ones(8)])
    standby = CheckedShard("b")
    assert standby.handle([wire.pack(wire.ADOPT, p=0)]) == []
    g3 = [np.random.default_rng(3).normal(size=8), np.full(8, 0.5)]
    encs = [wire.encode_tensor("w/0", g) for g in g3]
    batch3 = _batch(0, 3, [{"op": "push", "i": i} for i in range(2)],
                    [e[0] for e in encs], [bytes(e[1]) for e in encs])
    held = standby.handle(batch3)
    assert unpack(held[0][0])["parts"] == [] and len(standby.installing[0]) == 1
    state = primary.handle([wire.pack(wire.STATE_REQ, p=0, to="b")])[0]
    assert unpack(state[0])["seq"] == 2
    primary.handle(batch3)
    synced = standby.handle([bytes(f) for f in state])
    assert [(h["kind"], h["p"], h["seq"]) for h in (unpack(m[0]) for m in synced)] == [
        ("synced", 0, 3)]
    assert standby.installing == {}
    assert standby.partition_digest(0) == primary.partition_digest(0)
    assert standby.store.blocks["w/0"].version == 3
    assert standby.handle([wire.pack(wire.DROP, ps=[0])]) == []
    assert standby.store.blocks == {} and standby.store.partitions == {}


def test_shard_validate_state_names_the_broken_invariant():
    sc = _shard_with(SGD, np.zeros(4))
    sc.validate_state()
    pst, blk = sc.store.partitions[0], sc.store.blocks["w/0"]
    breaks = [
        (lambda: pst.keys.discard("w/0"), lambda: pst.keys.add("w/0"), "named by no partition"),
        (lambda: setattr(blk, "version", -1), lambda: setattr(blk, "version", 0), "version -1"),
        (lambda: setattr(pst, "seq", "1"), lambda: setattr(pst, "seq", 1), "seq '1'"),
        (lambda: setattr(blk, "value", np.zeros(3)), lambda: setattr(blk, "value", np.zeros(4)),
         "layout float64[4]"),
        (lambda: sc.installing.update({1: [({"p": 2}, [], [])]}),
         lambda: sc.installing.clear(), "held for 1"),
        (lambda: setattr(blk, "published", np.zeros(4)),
         lambda: setattr(blk, "published", None), "without a delta chain"),
    ]
    for brk, fix, says in breaks:
        brk()
        with pytest.raises(AssertionError, match=re.escape(says)):
            sc.validate_state()
        fix()
        sc.validate_state()


# ---------------------------------------------------------------- client cache
def _checked(cache: WeightCache) -> WeightCache:
    """``cache``, with its invariants checked after every event it is fed."""
    def checking(method):
        def call(*args, **kw):
            out = method(*args, **kw)
            cache.validate_state()
            return out
        return call
    for name in ("track", "on_snapshot", "on_update", "on_heartbeat"):
        setattr(cache, name, checking(getattr(cache, name)))
    return cache


def _cache_with(name="w", n=6, block=2, P=4):
    cache = _checked(WeightCache(P))
    layout = TensorLayout(name, "float32", (n,), block)
    parts, keys = cache.track(layout)
    return cache, layout, parts, keys


def test_cache_snapshot_then_updates_in_order_and_gap_resync():
    cache, layout, parts, keys = _cache_with()
    assert set(keys) == set(layout.block_keys()) and parts
    key = keys[0]
    p = partition_of(key, 4)
    # updates before the snapshot are buffered, applied after if newer
    cache.on_update(p, 6, [(key, np.full(2, 6.0, np.float32), 6, None)])
    snap = {pp: 5 for pp in {partition_of(k, 4) for k in keys}}
    blocks = [(k, np.zeros(2, np.float32), 5, None) for k in keys]
    assert cache.on_snapshot(snap, blocks) == []
    assert cache.blocks[key].version == 6
    assert not cache.on_update(p, 6, [(key, np.full(2, 99.0, np.float32), 99, None)])  # stale dropped
    assert cache.blocks[key].version == 6 and cache.stats["stale_updates"] == 1
    assert cache.on_update(p, 8, [(key, np.full(2, 8.0, np.float32), 8, None)])   # gap -> resync
    assert cache.parts[p].resync
    assert cache.on_snapshot({p: 8}, [(k, np.full(2, 8.0, np.float32), 8, None)
                                      for k in cache.resync_keys(p)]) == []
    assert not cache.parts[p].resync and cache.parts[p].last_seq == 8
    t = cache.tensor("w")
    assert t.shape == (6,) and not t.flags.writeable


def test_cache_validate_state_names_a_broken_invariant():
    cache, layout, parts, keys = _cache_with()
    p = partition_of(keys[0], 4)
    cache.on_snapshot({pp: 1 for pp in parts}, [(k, np.zeros(2, np.float32), 1, None)
                                                 for k in keys])
    cache.parts[p].buffered.append((2, []))            # buffered while in sync
    with pytest.raises(AssertionError, match="buffered while in sync"):
        cache.validate_state()


def test_cache_version_is_min_overencode_blocks():
    cache, layout, parts, keys = _cache_with()
    snap = {partition_of(k, 4): 1 for k in keys}
    cache.on_snapshot(snap, [(k, np.zeros(2, np.float32), i + 3, None) for i, k in enumerate(keys)])
    assert cache.version("w") == 3


def test_cache_heartbeat_reveals_a_dropped_tail():
    cache, layout, parts, keys = _cache_with()
    snap = {partition_of(k, 4): 3 for k in keys}
    cache.on_snapshot(snap, [(k, np.zeros(2, np.float32), 3, None) for k in keys])
    p = partition_of(keys[0], 4)
    assert cache.on_heartbeat([p], [3]) == []          # up to date
    assert cache.on_heartbeat([p], [4]) == [p]         # seq 4 was published, never seen
    assert cache.parts[p].resync


def test_broker_heartbeat_names_published_seqs():
    rig = Rig(("s0",))
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.client(b"c", push_msg(2, layout, np.ones(4, np.float32)))
    rig.deliver(rig.broker.on_tick(1.0))
    hb = [unpack(m[1]) for m in rig.published if m[0] == wire.TOPIC_HEARTBEAT][-1]
    p = partition_of("w/0", 16)
    assert dict(zip(hb["ps"], hb["seqs"]))[p] == 2


def test_shard_scatter_adds_sparse_gradients_with_dense_ones():
    sc = _shard_with({"name": "sgd", "lr": 1.0}, np.zeros(64))
    rng = np.random.default_rng(3)
    dense = rng.normal(size=64)
    sparse = rng.normal(size=64)
    encs = [wire.encode_tensor("w/0", dense), wire.encode_tensor("w/0", sparse, "topk:0.125")]
    sc.handle(_batch(0, 2, [{"op": "push", "i": 0}, {"op": "push", "i": 1}],
                     [e[0] for e in encs], [bytes(e[1]) for e in encs]))
    kept = np.zeros(64)
    top = np.argsort(-np.abs(sparse))[:8]
    kept[top] = sparse[top]
    np.testing.assert_allclose(sc.store.blocks["w/0"].value, -(dense + kept), rtol=1e-12)
    sc2 = _shard_with({"name": "sgd", "lr": 1.0}, np.zeros(64))
    _apply(sc2, 2, [sparse])
    assert encs[1][0]["c"].startswith("topk")
    one = wire.encode_tensor("w/0", sparse, "topk:0.125")
    sc2.handle(_batch(0, 3, [{"op": "push", "i": 0}], [one[0]], [bytes(one[1])]))
    np.testing.assert_allclose(sc2.store.blocks["w/0"].value, -(sparse + kept), rtol=1e-12)


@pytest.mark.parametrize("chain", ["delta", "delta|raw|shuffle|zstd", "delta|bf16"])
def test_delta_weights_reconstruct_what_the_shard_published(chain):
    """A subscriber fed the shard's UPDATEs holds exactly the shard's published values; with a
    lossless chain they are the weights themselves, with bf16 the error stays bounded (it is
    carried into the next delta, never accumulated)."""
    sc = CheckedShard("s", weights_codec=chain)
    layout = TensorLayout("w", "float32", (256,), 256)
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=256).astype(np.float32)
    d, buf = wire.encode_tensor("w/0", w0)
    out = sc.handle(_batch(0, 1, [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
                                   "rule": {"name": "given"}, "opt": {"name": "sgd", "lr": 0.01},
                                   "i": 0}], [d], [bytes(buf)]))
    cache = _checked(WeightCache(1))
    cache.track(layout)

    def feed(msg):
        upd = unpack(msg[0][1])
        blocks = [(t["k"], wire.decode_tensor(wire.parse_desc(t), msg[0][2]), t["ver"],
                   t.get("base")) for t in upd["t"]]
        return blocks, upd["seq"]

    snap = sc.handle([wire.pack(wire.SNAPSHOT, req=1, keys=["w/0"], client=b"c", of=1)])[0]
    sd = unpack(snap[0])
    cache.on_snapshot({0: sd["parts"][0][1]}, [(
        "w/0", wire.decode_tensor(wire.parse_desc(sd["t"][0]), snap[1]), 0,
        sd["t"][0].get("base"))])
    assert feed(out)[0][0][3] is None                      # the first publish is whole
    for seq in range(2, 40):
        g = rng.normal(size=256).astype(np.float32)
        e = wire.encode_tensor("w/0", g)
        out = sc.handle(_batch(0, seq, [{"op": "push", "i": 0}], [e[0]], [bytes(e[1])]))
        blocks, useq = feed(out)
        assert blocks[0][3] == seq - 1                      # a delta on the previous publish
        assert not cache.on_update(0, useq, blocks)
    blk = sc.store.blocks["w/0"]
    got = cache.tensor("w")
    assert np.array_equal(got, blk.published)
    if chain == "delta|bf16":
        assert np.abs(got - blk.value).max() <= 2 ** -7 * np.abs(blk.value).max()
    else:
        np.testing.assert_allclose(got, blk.value, rtol=0, atol=1e-6)
    # a delta whose base the subscriber does not hold is a gap, never misapplied
    e = wire.encode_tensor("w/0", np.ones(256, np.float32))
    sc.handle(_batch(0, 40, [{"op": "push", "i": 0}], [e[0]], [bytes(e[1])]))   # lost
    out = sc.handle(_batch(0, 41, [{"op": "push", "i": 0}], [e[0]], [bytes(e[1])]))
    blocks, useq = feed(out)
    cache.parts[0].last_seq = useq - 1                      # even with the seq gap hidden
    assert cache.on_update(0, useq, blocks) is True


def test_a_large_snapshot_is_answered_in_parts_of_at_most_a_batch():
    """A shard's heartbeats queue behind its replies: one snapshot reply carries at most
    max_batch_bytes of blocks, and the client is told how many replies to expect."""
    rig = Rig(("s0",), partitions=1, max_batch_bytes=40)
    frames, layout = init_msg(1, "w", np.arange(40, dtype=np.float32))   # 10 blocks of 16 B
    rig.client(b"c", frames)
    while rig.broker.pending_entries:        # the init goes out 2 blocks per batch
        rig.deliver(rig.broker.flush(rig.now))
    rig.replies(b"c")
    sent = []
    orig = rig.to_shard
    rig.to_shard = lambda sid, fr: (sent.append(unpack(fr[0])), orig(sid, fr))
    rig.client(b"c", [wire.pack(wire.SNAPSHOT, req=5, keys=layout.block_keys())])
    asks = [h for h in sent if h["kind"] == "snapshot"]
    assert [len(h["keys"]) for h in asks] == [2, 2, 2, 2, 2]
    assert {h["of"] for h in asks} == {5}
    replies = [r for r in rig.replies(b"c") if r["kind"] == "snapshot_reply"]
    assert len(replies) == 5 and sorted(d["k"] for r in replies for d in r["t"]) == sorted(
        layout.block_keys())


def test_batches_and_snapshot_asks_carry_at_most_max_batch_entries_blocks():
    """A shard applies a message whole before it heartbeats again: an init or push of many
    small blocks goes out in batches of at most max_batch_entries entries, and a snapshot of
    them in asks of at most as many keys; everything is applied once, and the answers are
    whole."""
    rig = Rig(("s0",), partitions=2, max_batch_entries=8)
    sent = []
    orig = rig.to_shard
    rig.to_shard = lambda sid, fr: (sent.append(unpack(fr[0])), orig(sid, fr))
    values = np.arange(400, dtype=np.float32)               # 100 blocks of 4 values
    frames, layout = init_msg(1, "w", values)
    rig.client(b"c", frames)
    while rig.broker.pending_entries:
        rig.deliver(rig.broker.flush(rig.now))
    batches = [h for h in sent if h["kind"] == "batch"]
    sizes = [sum(len(part["e"]) for part in h["parts"]) for h in batches]
    assert max(sizes) == 8 and sum(sizes) == 100, sizes
    assert [r["kind"] for r in rig.replies(b"c")] == ["init_ok"]
    sent.clear()
    rig.client(b"c", push_msg(2, layout, np.ones(400, np.float32)))
    while rig.broker.pending_entries:
        rig.deliver(rig.broker.flush(rig.now))
    sizes = [sum(len(part["e"]) for part in h["parts"]) for h in sent if h["kind"] == "batch"]
    assert max(sizes) == 8 and sum(sizes) == 100, sizes
    assert [r["kind"] for r in rig.replies(b"c")] == ["ack"]
    sent.clear()
    rig.client(b"c", [wire.pack(wire.SNAPSHOT, req=5, keys=layout.block_keys())])
    asks = [h for h in sent if h["kind"] == "snapshot"]
    assert max(len(h["keys"]) for h in asks) == 8
    assert sum(len(h["keys"]) for h in asks) == 100
    replies = [r for r in rig.replies(b"c") if r["kind"] == "snapshot_reply"]
    assert sorted(d["k"] for r in replies for d in r["t"]) == sorted(layout.block_keys())
    assert {d.get("ver") for r in replies for d in r["t"]} == {1}
    rig.check()


# ---------------------------------------------------------------- streamed sums
def _shard_sgd(dtype, n, lr=1.0, nan_policy="refuse", board=None):
    """A shard holding w/0 (zeros, SGD); with ``board`` (a weights board) its steps go onto
    the board, where plain SGD steps while it reads the gradients (``steps_in_one_pass``)."""
    sc = CheckedShard("s", nan_policy=nan_policy)
    sc.publisher.board = board
    layout = TensorLayout("w", dtype, (n,), n)
    sc.handle(_batch(0, 1, [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
                             "rule": {"name": "zeros"}, "opt": {"name": "sgd", "lr": lr}}],
                     [], []))
    return sc


@pytest.fixture(params=["in_place", "board"])
def board(request):
    """None (steps in place), or a weights board the shard steps onto."""
    if request.param == "in_place":
        yield None
        return
    request.getfixturevalue("shm_dir")
    b = shm.Board("5ea11ed0", segment_bytes=1 << 20)
    yield b
    b.close()


def _one_pass_steps(sc) -> int:
    return sc.stats.get("steps_in_one_pass", 0)


def _steps_reading(sc) -> bool:
    """Whether this shard's SGD steps onto its board read the gradients as they step."""
    return sc.store.board is not None and sc.backend.fused is not None


def _push_batch(sc, seq, encs, entries=None):
    entries = entries or [{"op": "push", "i": i} for i in range(len(encs))]
    out = sc.handle(_batch(0, seq, entries, [e[0] for e in encs], [bytes(e[1]) for e in encs]))
    return unpack(out[0][0])["parts"][0]


@pytest.mark.parametrize("path", JIT_PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("chain", ["raw", "bf16", "fp16", "bf16,raw,fp16,bf16",
                                   "fp16,bf16,bf16,raw"])
def test_streamed_sum_is_the_one_at_a_time_sum_bit_for_bit(chain, dtype, path, board,
                                                           monkeypatch):
    """Raw, fp16 and bf16 frames of one key are checksummed, decoded, scaled and summed piece
    by piece (or, half precision with numba, each in one pass): the weights equal the textbook
    sum of the decoded gradients in batch order, and the whole-frame decoder is never called
    for them. Onto a board, the step itself is taken piece by piece as they are read: the
    same bits."""
    n = 3 * ShardCore("x").backend.chunk_len(np.dtype(dtype)) + 17     # a short last piece
    rng = np.random.default_rng(11)
    grads = [rng.normal(size=n).astype(dtype) for _ in range(4)]
    chains = (chain.split(",") * 4)[:4]
    encs = [wire.encode_tensor("w/0", g, c) for g, c in zip(grads, chains)]
    entries = [{"op": "push", "i": i} for i in range(4)]
    entries[2]["w"] = 0.25                   # a staleness-scaled push
    if chain.startswith("fp16"):
        entries[0]["w"] = 0.5                # the first, scaled: out = v * w
    decoded = [wire.decode_tensor(wire.parse_desc(d), b).reshape(-1) for d, b in encs]
    decoded[2] = decoded[2] * np.asarray(0.25, dtype)
    if "w" in entries[0]:
        decoded[0] = decoded[0] * np.asarray(0.5, dtype)
    want = decoded[0].copy()
    for g in decoded[1:]:
        want += g
    sc = _shard_sgd(dtype, n, board=board)

    def whole(*a, **k):
        raise AssertionError("a streamable frame was decoded whole")
    monkeypatch.setattr(wire, "decode_tensor_staged", whole)
    one_pass = []
    add_into = wire.TensorStream.add_into
    monkeypatch.setattr(wire.TensorStream, "add_into",
                        lambda *a: one_pass.append(add_into(*a)) or one_pass[-1])
    with jit_path(path):
        res = _push_batch(sc, 2, encs, entries)
    assert res["errors"] == [] and res["vers"] == {"w/0": 4}
    leading_half = next((i for i, c in enumerate(chains) if c == "raw"), 4)
    if _steps_reading(sc):
        assert _one_pass_steps(sc) == 1 and one_pass == []
        assert board.holds("w/0", 4) and sc.store.blocks["w/0"].live is not None
    else:
        assert _one_pass_steps(sc) == 0
        assert one_pass.count(True) == (leading_half if path == "numba" else 0)
    assert np.array_equal(sc.store.blocks["w/0"].value, -want)
    assert sc.stats["pushes_applied"] == 4


@pytest.mark.parametrize("path", JIT_PATHS)
@pytest.mark.parametrize("chain", ["raw", "bf16", "fp16"])
def test_streamed_sum_refuses_exactly_the_corrupt_and_non_finite_frames(chain, path, board):
    """Onto a board, the step taken while reading is given up (its version never published)
    and the frames are checked one at a time."""
    n = 2 * ShardCore("x").backend.chunk_len(np.dtype(np.float32)) + 5
    rng = np.random.default_rng(5)
    grads = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
    grads[3][n - 1] = np.nan                                   # in the last piece
    encs = [wire.encode_tensor("w/0", g, chain) for g in grads]
    corrupt = bytearray(bytes(encs[1][1]))
    corrupt[len(corrupt) // 2] ^= 0x10
    encs[1] = (encs[1][0], bytes(corrupt))
    sc = _shard_sgd("float32", n, board=board)
    with jit_path(path):
        res = _push_batch(sc, 2, encs)
    assert sorted(e[:2] for e in res["errors"]) == [[1, "BAD_CHECKSUM"], [3, "NOT_FINITE"]]
    good = [wire.decode_tensor(wire.parse_desc(encs[i][0]), encs[i][1]).reshape(-1)
            for i in (0, 2)]
    assert np.array_equal(sc.store.blocks["w/0"].value, -(good[0] + good[1]))
    assert sc.stats["pushes_applied"] == 2 and sc.stats["pushes_refused"] == 2
    assert _one_pass_steps(sc) == 0 and sc.store.blocks["w/0"].version == 2
    if board is not None:
        board.close()
        board = shm.Board("5ea11ed0", segment_bytes=1 << 20)
    # nan_policy allow: the non-finite one is summed in, the corrupt one still refused
    sc = _shard_sgd("float32", n, nan_policy="allow", board=board)
    with jit_path(path):
        res = _push_batch(sc, 2, encs)
    assert [e[:2] for e in res["errors"]] == [[1, "BAD_CHECKSUM"]]
    assert np.isnan(sc.store.blocks["w/0"].value[n - 1])
    # the two good frames and the non-finite one, no corrupt one: one pass onto a board
    good3 = [encs[i] for i in (0, 2, 3)]
    sc2 = _shard_sgd("float32", n, nan_policy="allow", board=board)
    with jit_path(path):
        res = _push_batch(sc2, 2, good3)
    assert res["errors"] == [] and np.isnan(sc2.store.blocks["w/0"].value[n - 1])
    assert _one_pass_steps(sc2) == (1 if _steps_reading(sc2) else 0)
    if board is not None:
        board.close()


def test_streamed_sum_skips_resent_gradients_in_and_across_batches(board):
    n = 1000
    g = np.arange(n, dtype=np.float32)
    enc = wire.encode_tensor("w/0", g)
    sc = _shard_sgd("float32", n, board=board)
    ident = {"op": "push", "i": 0, "c": "client-a", "m": 7}
    res = _push_batch(sc, 2, [enc, enc], [ident, {**ident, "i": 1}])
    assert res["errors"] == [] and res["vers"] == {"w/0": 1}
    other = wire.encode_tensor("w/0", np.ones(n, np.float32))
    res = _push_batch(sc, 3, [enc, other], [ident, {"op": "push", "i": 1, "c": "client-a",
                                                    "m": 8}])
    assert res["vers"] == {"w/0": 2}
    assert np.array_equal(sc.store.blocks["w/0"].value, -(g + 1))
    assert sc.stats["duplicates_skipped"] == 2
    assert _one_pass_steps(sc) == (2 if _steps_reading(sc) else 0)


def test_streamed_sum_with_other_dense_and_sparse_gradients_of_the_key():
    """Streamed frames, frames decoded whole (int8) and a sparse one, all for one key."""
    n = 3000
    rng = np.random.default_rng(9)
    gs = [rng.normal(size=n) for _ in range(5)]
    encs = [wire.encode_tensor("w/0", gs[0]), wire.encode_tensor("w/0", gs[1], "int8"),
            wire.encode_tensor("w/0", gs[2]), wire.encode_tensor("w/0", gs[3], "int8"),
            wire.encode_tensor("w/0", gs[4], "topk:0.1")]
    dec = [wire.decode_tensor(wire.parse_desc(d), b).reshape(-1) for d, b in encs]
    sc = _shard_sgd("float64", n)
    res = _push_batch(sc, 2, encs)
    assert res["errors"] == [] and res["vers"] == {"w/0": 5}
    want = dec[0] + dec[2]      # the streamed pair first, then the others in batch order
    want += dec[1]
    want += dec[3]
    want += dec[4]
    np.testing.assert_array_equal(sc.store.blocks["w/0"].value, -want)


def test_a_backend_that_sums_in_its_step_gets_the_batch_as_a_list():
    """With ``sums_in_step`` (CuPy) up to SUM_GROUP dense gradients of a key go to the step as a
    list, summed in its kernel; more, or any sparse one, are summed first. Same weights."""
    from gradbus.shards import backend as bk

    class SumsInStep(bk.NumpyBackend):
        sums_in_step = True
        got: list = []

        def sgd_step(self, w, g, lr, scratch=None):
            self.got.append(len(g) if isinstance(g, list) else None)
            if isinstance(g, list):
                g = self.sum_into(np.empty_like(w), g)
            super().sgd_step(w, g, lr, scratch)

    n = 1000
    rng = np.random.default_rng(1)
    for count, sparse in ((3, False), (bk.SUM_GROUP + 1, False), (3, True)):
        grads = [rng.normal(size=n).astype(np.float32) for _ in range(count)]
        encs = [wire.encode_tensor("w/0", g, "int8") for g in grads]    # decoded whole
        if sparse:
            encs[-1] = wire.encode_tensor("w/0", grads[-1], "topk:0.1")
        results = []
        for be in (bk.NumpyBackend(jit=False), SumsInStep(jit=False)):
            sc = CheckedShard("s", backend=be)
            layout = TensorLayout("w", "float32", (n,), n)
            sc.handle(_batch(0, 1, [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
                                     "rule": {"name": "zeros"},
                                     "opt": {"name": "sgd", "lr": 1.0}}], [], []))
            assert _push_batch(sc, 2, encs)["errors"] == []
            results.append(sc.store.blocks["w/0"].value.copy())
        np.testing.assert_allclose(results[1], results[0], rtol=1e-6, atol=1e-6)
        want = count if count <= bk.SUM_GROUP and not sparse else None
        assert SumsInStep.got.pop() == want


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("layout", ["flat", "rows", "strided"])
def test_the_finiteness_check_finds_every_non_finite_value_and_no_false_one(dtype, layout):
    from gradbus.codecs.values import all_finite as _all_finite
    rng = np.random.default_rng(3)

    def shaped(a):
        if layout == "rows":
            return a.reshape(64, -1)
        if layout == "strided":
            return a[::2]
        return a
    base = rng.normal(size=4096).astype(dtype)
    assert _all_finite(shaped(base))
    big = base.copy()
    big[::7] = np.finfo(dtype).max / 2      # squares and sums overflow; every value is finite
    assert _all_finite(shaped(big))
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 2048, 4094):
            v = base.copy()
            v[at] = bad
            assert not _all_finite(shaped(v)), (bad, at)
    both = base.copy()
    both[10], both[20] = np.inf, -np.inf          # a sum would be nan: still refused
    assert not _all_finite(shaped(both))
