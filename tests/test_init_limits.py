"""INIT and PUSH limits: a large INIT does not stall the broker's loop past the shards'
liveness, INIT refuses NaN and Inf initial values as pushes do, and a push's ``cnt`` is
bounded."""
from __future__ import annotations

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.broker.actions import ToClient
from gradbus.broker.core import BrokerCore
from gradbus.codecs import specs, wire
from gradbus.codecs.errors import Code
from gradbus.codecs.partition import TensorLayout


def test_ten_thousand_tensor_init_keeps_both_shards_alive(make_cluster):
    cluster = make_cluster(2)
    n = 10_000
    tensors = {f"layer{i}.w": np.full(8, i, np.float32) for i in range(n)}
    with gradbus.connect(cluster.url, timeout=120) as c:
        got = c.init(tensors, optimizer=gradbus.SGD(lr=1.0), timeout=120)
        assert len(got) == n and np.array_equal(got["layer9999.w"], tensors["layer9999.w"])
        c.push({"layer7.w": np.ones(8, np.float32)}).result(60)
        assert np.array_equal(c.pull(["layer7.w"], min_version=1, timeout=60)["layer7.w"],
                              np.full(8, 6.0, np.float32))
    st = admin.status(cluster.url)
    assert st["counters"].get("shard_deaths", 0) == 0, st["counters"]
    assert all(s["alive"] for s in st["shards"]) and not st["partitions_down"]


def _core_with_shard():
    b = BrokerCore(now=0.0)
    b.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0")], 0.0)
    return b


def _init_frames(values: np.ndarray, msg: int = 1) -> list:
    layout = TensorLayout("w", values.dtype.name, values.shape, 1 << 18)
    d, buf = wire.encode_tensor("w/0", values, "raw")
    return [wire.pack(wire.INIT, [d], msg=msg, opt=specs.SGD(lr=0.1).to_wire(),
                      tensors=[{**layout.to_wire(), "init": {"name": "given"}}]), buf]


def _errors(actions) -> list:
    heads = [wire.unpack_header(a.frames[0], wire.CLIENT_KINDS) for a in actions
             if isinstance(a, ToClient)]
    return [h for h in heads if h["kind"] == wire.ERROR]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_init_refuses_non_finite_initial_values(bad):
    b = _core_with_shard()
    v = np.ones(6, np.float32)
    v[3] = bad
    errs = _errors(b.on_frontend(b"c", _init_frames(v), 0.0))
    assert [e["code"] for e in errs] == [Code.NOT_FINITE.value] and errs[0]["msg"] == 1
    assert "w" not in b.catalog.tensors and not b.sequencer.pending_entries   # nothing changed
    ok = b.on_frontend(b"c", _init_frames(np.ones(6, np.float32), msg=2), 0.0)
    assert not _errors(ok) and "w" in b.catalog.tensors
    b.validate_state()


def test_init_refuses_non_finite_float64_values_through_the_sdk(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, timeout=20) as c:
        with pytest.raises(gradbus.GradbusError, match="NOT_FINITE"):
            c.init({"w": np.array([1.0, np.nan], np.float64)}, optimizer=gradbus.SGD(lr=1.0))
        got = c.init({"w": np.array([1.0, 2.0], np.float64)}, optimizer=gradbus.SGD(lr=1.0))
        assert np.array_equal(got["w"], [1.0, 2.0])


def test_push_cnt_is_bounded():
    assert wire.MAX_COUNT == 1 << 20
    d, buf = wire.encode_tensor("w/0", np.ones(4, np.float32), "raw")
    for cnt, ok in ((wire.MAX_COUNT, True), (wire.MAX_COUNT + 1, False), (1 << 30, False)):
        raw = {**d, "cnt": cnt}
        h = wire.unpack_header(wire.pack(wire.PUSH, [raw], msg=1, acks=1), wire.FRONTEND_KINDS)
        if ok:
            assert wire.parse_tensors(h, [buf])[0].count == cnt
        else:
            with pytest.raises(gradbus.GradbusError, match="cnt") as e:
                wire.parse_tensors(h, [buf])
            assert e.value.code == Code.BAD_FIELD


def test_a_long_init_plan_pulses_and_the_pulse_heartbeats_the_shards():
    """The catalog calls the loop's pulse while it plans a large INIT, and the pulse sends the
    live shards a heartbeat when one is due, so no single request silences the broker for
    longer than a heartbeat interval plus PULSE_EVERY tensors."""
    import zmq

    from gradbus.broker import catalog
    from gradbus.broker.server import BrokerServer

    b = _core_with_shard()
    calls = []
    b.catalog.pulse = lambda: calls.append(1)
    n = 3 * catalog.PULSE_EVERY + 1
    metas = [{**TensorLayout(f"t{i}", "float32", (4,), 4).to_wire(), "init": {"name": "zeros"}}
             for i in range(n)]
    b.on_frontend(b"c", [wire.pack(wire.INIT, msg=1, opt=specs.SGD(lr=0.1).to_wire(),
                                   tensors=metas)], 0.0)
    assert len(calls) == 4 and len(b.catalog.tensors) == n

    t = [100.0]
    srv = BrokerServer(port=0, clock=lambda: t[0])
    shard = srv.ctx.socket(zmq.DEALER)
    try:
        assert srv.core.catalog.pulse == srv._pulse
        shard.setsockopt(zmq.ROUTING_ID, b"s0")
        shard.connect(f"tcp://127.0.0.1:{srv.backend_port}")
        srv.core.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0")], t[0])
        srv.core.last_hb_sent = t[0]
        srv._pulse()                       # not due yet: nothing sent
        assert not shard.poll(200)
        t[0] += srv.core.settings.heartbeat_interval
        for _ in range(50):                # the ROUTER learns the peer once connected
            srv._pulse()
            if shard.poll(100):
                break
            srv.core.last_hb_sent = 0.0
        got = wire.unpack_header(shard.recv(), wire.SHARD_KINDS)
        assert got["kind"] == wire.HEARTBEAT
    finally:
        shard.close(linger=0)
        srv.close()
