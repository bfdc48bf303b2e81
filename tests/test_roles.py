"""CURVE keys have roles (shard, client, operator), named in the allow directory's key files:
a worker's key cannot register a shard, checkpoint, drain or rebalance; a shard's key cannot
act as a client; an allow directory of role-less files keeps working (every role, one
warning per file). Against real brokers and shards on ephemeral ports."""
from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import zmq
from click.testing import CliRunner

import gradbus
from gradbus import admin
from gradbus.broker.server import BrokerServer
from gradbus.cli import main
from gradbus.codecs import net, security, wire

from .rigs import register_as, unpack


@pytest.fixture
def keys(tmp_path):
    return security.ClusterKeys.ensure(tmp_path / "keys")


def _worker(keys, tmp_path, roles=("client",)) -> security.Curve:
    """A key pair whose public file is in the cluster's allow directory with ``roles``."""
    pub, sec = security.generate(tmp_path / "w", "worker", roles=roles)
    shutil.copy(pub, keys.allow)
    return security.Curve.from_files(sec, keys.path("broker"))


def test_the_role_table():
    p = security.permits
    assert p(None, True, wire.REGISTER) and p(None, False, wire.ADMIN)       # CURVE off
    assert p({"shard"}, True, wire.REGISTER) and not p({"client", "operator"}, True, wire.REGISTER)
    for kind in (wire.PUSH, wire.INIT, wire.SNAPSHOT, wire.ROWS, wire.CATALOG,
                 wire.DIGEST, wire.HEARTBEAT, wire.BYE):
        assert p({"client"}, False, kind) and p({"operator"}, False, kind)
        assert not p({"shard"}, False, kind)
    for kind in (wire.CHECKPOINT, wire.ADMIN):
        assert p({"operator"}, False, kind) and not p({"client", "shard"}, False, kind)
    for kind in (wire.HELLO, wire.STATUS):      # discovery, and the read-only healthcheck
        assert all(p({r}, False, kind) for r in security.ROLES)
        assert not p(frozenset(), False, kind)  # a key no longer in the directory


def test_a_workers_key_cannot_act_as_a_shard_or_an_operator(make_cluster, keys, tmp_path):
    cluster = make_cluster(1, curve_dir=keys.directory)
    worker = _worker(keys, tmp_path)
    with gradbus.connect(cluster.url, curve=worker) as c:     # a worker's requests work
        c.init({"w": np.zeros(8, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
        c.push({"w": np.ones(8, np.float32)}).result(10)
        assert admin.status(cluster.url, curve=worker)["counters"]["pushes_applied"] == 1
        # ... the ops commands that change the cluster do not
        for call in (lambda: admin.checkpoint(cluster.url, 10, curve=worker),
                     lambda: admin.drain(cluster.url, "shard-0", curve=worker),
                     lambda: admin.rebalance(cluster.url, curve=worker)):
            with pytest.raises(gradbus.GradbusError, match="FORBIDDEN.*operator role"):
                call()
        # ... nor does a REGISTER on the backend, under any routing id
        for rid in (b"intruder", b"shard-9"):
            reply = register_as(cluster.url, "shard-0", curve=worker, routing_id=rid)
            assert reply["code"] == "FORBIDDEN" and "shard role" in reply["message"], reply
        st = admin.status(cluster.url, curve=cluster.curve)       # client + operator
        assert [s["id"] for s in st["shards"]] == ["shard-0"] and st["shards"][0]["alive"]
        assert not st["partitions_down"] and st["errors"]["FORBIDDEN"] == 5
        c.push({"w": np.ones(8, np.float32)}).result(10)
        assert admin.rebalance(cluster.url, curve=cluster.curve)["moves_started"] == 0
    # a shard's key is not a client's: it may ask status (its container's healthcheck does),
    # nothing a worker does
    shard = security.Curve.from_files(keys.path("shard", True), keys.path("broker"))
    assert admin.status(cluster.url, curve=shard)["shards"][0]["id"] == "shard-0"
    with pytest.raises(gradbus.GradbusError, match="FORBIDDEN"):
        admin.request(cluster.url, wire.CATALOG, curve=shard)


def test_a_role_less_allow_directory_keeps_working(tmp_path, caplog):
    """Key files made before roles existed: every role, and one warning per file."""
    d, allow = tmp_path / "k", tmp_path / "allow"
    allow.mkdir()
    for name in ("broker", "old"):
        security.generate(d, name)
    shutil.copy(d / "old.key", allow / "old.key")
    assert security.read_roles(allow / "old.key") is None
    caplog.set_level(logging.WARNING, "gradbus.security")
    srv = BrokerServer("127.0.0.1", 0, curve=security.Curve.from_files(
        d / "broker.key_secret", allow=allow))
    t = srv.start_thread()
    try:
        old = security.Curve.from_files(d / "old.key_secret", d / "broker.key")
        assert admin.status(srv.url, 5.0, curve=old)["partitions"] == 256
        assert admin.rebalance(srv.url, curve=old)["moves_started"] == 0   # operator too
        ctx = zmq.Context()
        try:     # ... and the shard role: its REGISTER is answered REGISTERED
            welcome = net.hello(ctx, srv.url, "shard", 10.0, curve=old)
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            security.client_setup(s, old)
            s.connect(net.url("127.0.0.1", welcome["backend"]))
            s.send(wire.pack(wire.REGISTER, shard="s-old", holds=[]))
            assert s.poll(10_000) and unpack(s.recv())["kind"] == wire.REGISTERED
            s.send(wire.pack(wire.BYE))
            s.close(linger=0)
        finally:
            ctx.term()
    finally:
        srv.stop()
        t.join(10)
    warned = [r for r in caplog.records if "names no roles" in r.getMessage()]
    assert len(warned) == 1 and "old.key" in warned[0].getMessage()


def test_keys_generate_with_roles(tmp_path):
    d = tmp_path / "k"
    r = CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "w1", "--role",
                                  "client"])
    assert r.exit_code == 0, r.output
    assert security.read_roles(d / "w1.key") == {"client"} and "roles: client" in r.output
    r = CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "ops", "--role",
                                  "client", "--role", "operator"])
    assert r.exit_code == 0 and security.read_roles(d / "ops.key") == {"client", "operator"}
    security.load_secret(d / "ops.key_secret")
    r = CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "x", "--role", "root"])
    assert r.exit_code != 0
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [
        "ops.key", "ops.key_secret", "w1.key", "w1.key_secret"]


def test_a_tier_moves_import_and_drop_need_the_operator_role(make_cluster, keys, tmp_path):
    """An INIT carrying a tier move's ``imp`` or ``drop`` is an ops command's: a worker's key
    is refused before anything else; an operator's reaches the tier check."""
    from gradbus import tier_admin
    cluster = make_cluster(1, curve_dir=keys.directory)
    worker = _worker(keys, tmp_path)
    for curve, why in ((worker, "FORBIDDEN.*operator role"),
                       (cluster.curve, "BAD_REQUEST.*not a tier member")):
        m = tier_admin._Member(cluster.url, curve, 10)
        try:
            with pytest.raises(gradbus.GradbusError, match=why):
                m.ask(wire.INIT, opt={"name": "sgd", "lr": 0.1}, tensors=[], drop=["w"])
            with pytest.raises(gradbus.GradbusError, match=why):
                m.tier("map", map={})
        finally:
            m.close()
