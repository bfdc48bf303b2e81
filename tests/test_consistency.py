"""Consistency models per tensor: async, ssp:S (refuse or delay), bsp:N; staleness-scaled steps;
the staleness histogram."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gradbus
from gradbus.codecs import specs, wire
from gradbus.codecs.partition import TensorLayout

from .rigs import RepRig, encode_blocks

SGD1 = {"name": "sgd", "lr": 1.0}


def _init(rig, cons, n=4, ident=b"c"):
    layout = TensorLayout("w", "float32", (n,), 4)
    descs, bufs = encode_blocks(layout, np.zeros(n, np.float32))
    rig.client(ident, [wire.pack(wire.INIT, descs, msg=1, opt=SGD1, cons=cons,
                                 tensors=[{**layout.to_wire(), "init": {"name": "given"}}]),
                       *bufs])
    rig.replies(ident)
    return layout


def _push(rig, ident, msg, layout, ver, value=1.0):
    descs, bufs = encode_blocks(layout, np.full(layout.size, value, np.float32))
    rig.client(ident, [wire.pack(wire.PUSH, descs, msg=msg, acks=1, ver=ver), *bufs])


def _value(rig):
    return rig.shards["s0"].store.blocks["w/0"].value


def test_ssp_refuses_a_push_computed_too_far_behind():
    rig = RepRig(("s0",))
    layout = _init(rig, specs.parse_consistency("ssp:2"))
    for m in range(2, 7):
        _push(rig, b"c", m, layout, ver=m - 2)          # up to date each time
    assert [r["kind"] for r in rig.replies(b"c")] == ["ack"] * 5
    _push(rig, b"late", 10, layout, ver=2)               # version is 5: 3 behind
    _push(rig, b"late", 11, layout, ver=3)               # 2 behind: allowed
    r = rig.replies(b"late")
    assert [x.get("code") for x in r] == ["STALE", None]
    assert np.array_equal(_value(rig), np.full(4, -6.0, np.float32))
    st = rig.broker.status(0)
    assert st["staleness"]["count"] == 7 and st["counters"]["pushes_received"] == 6
    assert [w["errors"] for w in st["workers"] if w["id"] == b"late".hex()] == [{"STALE": 1}]
    late = [w for w in st["workers"] if w["id"] == b"late".hex()][0]
    on_time = [w for w in st["workers"] if w["id"] == b"c".hex()][0]
    assert on_time["staleness"] == 0 and late["staleness"] > 0     # smoothed, per worker


def test_staleness_scaled_step():
    rig = RepRig(("s0",))
    layout = _init(rig, specs.parse_consistency("ssp:100", scale_lr=True))
    for m in range(2, 6):
        _push(rig, b"c", m, layout, ver=m - 2)           # versions 0..3, staleness 0
    _push(rig, b"c", 6, layout, ver=0)                   # 4 behind: a quarter of a step
    assert np.array_equal(_value(rig), np.full(4, -4.25, np.float32))


def test_bsp_applies_a_step_when_every_worker_is_in():
    rig = RepRig(("s0",))
    layout = _init(rig, specs.parse_consistency("bsp:2"), ident=b"a")
    rig.deliver(rig.broker.on_frontend(b"b", [wire.pack(wire.HEARTBEAT)], 0))  # b connects
    _push(rig, b"a", 2, layout, ver=0)
    assert rig.replies(b"a") == [] and _value(rig)[0] == 0      # held: b is missing
    _push(rig, b"b", 2, layout, ver=0, value=3.0)
    assert [r["kind"] for r in rig.replies(b"a") + rig.replies(b"b")] == ["ack", "ack"]
    assert _value(rig)[0] == -4.0 and rig.broker.counters["bsp_steps"] == 1
    _push(rig, b"a", 3, layout, ver=0)                   # that step is over
    assert rig.replies(b"a")[0]["code"] == "STALE"
    _push(rig, b"a", 4, layout, ver=2)                   # the next step: held again
    assert rig.replies(b"a") == []
    # b leaves: the step is released with the workers that are left
    rig.deliver(rig.broker.on_frontend(b"b", [wire.pack(wire.BYE)], rig.now))
    rig.tick(0.01)
    assert [r["kind"] for r in rig.replies(b"a")] == ["ack"] and _value(rig)[0] == -5.0


def test_bsp_push_without_a_version_is_refused_and_bad_models_are_refused():
    rig = RepRig(("s0",))
    layout = _init(rig, specs.parse_consistency("bsp:2"))
    descs, bufs = encode_blocks(layout, np.ones(4, np.float32))
    rig.client(b"c", [wire.pack(wire.PUSH, descs, msg=5, acks=1), *bufs])
    assert rig.replies(b"c")[0]["code"] == "BAD_REQUEST"
    for bad in ("bsp:0", "ssp:x", "sync", "ssp:-1"):
        with pytest.raises(ValueError):
            specs.parse_consistency(bad)
    rig.client(b"c", [wire.pack(wire.INIT, msg=9, opt=SGD1, cons={"mode": "weird"},
                                tensors=[{"name": "x", "dtype": "float32", "shape": [2],
                                          "block": 4, "init": {"name": "zeros"}}])])
    assert rig.replies(b"c")[0]["code"] == "BAD_FIELD"


def test_bsp_workers_through_a_cluster_apply_whole_steps(make_cluster):
    cluster = make_cluster(1)
    steps, seen = 6, {0: [], 1: []}
    with gradbus.connect(cluster.url) as setup:
        setup.init({"w": np.zeros(8, np.float32)}, optimizer=gradbus.SGD(lr=0.5),
                   consistency="bsp:2")

    # a barrier counts the workers the broker knows: both are known (their first pull has a
    # reply) before either pushes, or the first step could go with one worker
    both_known = threading.Barrier(2, timeout=30)

    def worker(i):
        with gradbus.connect(cluster.url) as c:
            c.pull(["w"], timeout=30)
            both_known.wait()
            for _ in range(steps):
                w = c.pull(["w"], timeout=30)["w"]          # waits for the last step
                seen[i].append(c.version("w"))
                c.push({"w": np.full(8, i + 1, np.float32)}).result(30)
            c.pull(["w"], timeout=30)
            seen[i].append(c.version("w"))
        return w
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(v % 2 == 0 for v in seen[0] + seen[1])      # never half a step
    assert seen[0] == seen[1] == list(range(0, 2 * steps + 1, 2))
    with gradbus.connect(cluster.url) as c:
        w = c.pull(["w"], min_version=2 * steps)["w"]
    assert np.array_equal(w, np.full(8, -0.5 * 3 * steps, np.float32))


def test_ssp_delay_makes_pull_wait_for_fresh_enough_weights(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as fast, gradbus.connect(cluster.url) as slow:
        fast.init({"w": np.zeros(4, np.float32)}, optimizer=gradbus.SGD(lr=0.1),
                   consistency="ssp:3", stale_policy="delay")
        slow.pull(["w"])
        slow._cons["w"] = specs.parse_consistency("ssp:3", "delay")
        for _ in range(10):
            fast.push({"w": np.ones(4, np.float32)}).result(10)
        # the broker names the tensor's version in its heartbeat; pull then waits until the
        # local weights are at most 3 versions behind it
        from .rigs import wait_for
        wait_for(lambda: slow._server_versions.get("w") == 10, 10, "the heartbeat's version")
        slow.pull(["w"], timeout=10)
        assert slow.version("w") >= 7
