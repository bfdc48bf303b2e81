"""A REGISTER that reuses the id of a shard alive on another connection is refused (counted,
answered SHARD_ID_IN_USE): the live shard keeps its partitions. Once that shard has been
silent past liveness, a replacement may take the id; at once, the same process on a new
connection (its token). A routing id is no credential: a peer connecting with a shard's name,
or with the live shard's own routing id, takes no route from it (CURVE on or off); with CURVE,
a shard's name is bound to the key that registered it."""
from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.broker.actions import ToShard
from gradbus.codecs import security, wire
from gradbus.codecs.partition import TensorLayout, partition_of

from .rigs import RepRig, backend_peer, init_msg, register_as, unpack, wait_for

FAST = ["--heartbeat-interval", "0.1", "--liveness", "5"]


def test_a_register_reusing_a_live_shards_id_does_not_evict_it(make_cluster):
    """A real shard (one copy of everything) serves; a second connection sends one REGISTER
    with its id. It is refused, counted, and the shard and its partitions stay up."""
    cluster = make_cluster(1, broker_args=FAST, shard_args=FAST)
    w0 = np.zeros(2000, np.float32)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=0.5))
        c.push({"w": np.ones_like(w0)}).result(10)
        reply = register_as(cluster.url, "shard-0")
        assert reply["kind"] == wire.ERROR and reply["code"] == "SHARD_ID_IN_USE", reply
        assert "in use by a live shard" in reply["message"]
        st = admin.status(cluster.url)
        assert st["errors"].get("SHARD_ID_IN_USE") == 1
        assert [s["alive"] for s in st["shards"]] == [True] and not st["partitions_down"]
        assert st["counters"].get("shards_lost", 0) == 0
        c.push({"w": np.ones_like(w0)}).result(10)      # still served, by the same shard
        w = c.pull(["w"], min_version=2, timeout=10)["w"]
    np.testing.assert_array_equal(w, np.full_like(w0, -1.0))


def test_a_shard_silent_past_liveness_can_be_replaced_on_another_connection():
    """Core only: the same REGISTER from another routing id is refused while s0 is heard
    from, and accepted (s0 declared dead first) once s0 has been silent past liveness, even
    before a tick noticed it. On s0's own connection (a restart, same routing id) it is
    accepted at once."""
    rig = RepRig(("s0",))
    frames, _ = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    b = rig.broker
    deadline = b.settings.shard_deadline
    reg = [wire.pack(wire.REGISTER, shard="s0", **rig.shards["s0"].register_fields())]
    out = b.on_backend(b"other", reg, b.now + deadline / 2)
    assert unpack(out[0].frames[0])["code"] == "SHARD_ID_IN_USE" and b.shards["s0"].alive
    assert b.shards["s0"].identity == b"s0" and b.errors["SHARD_ID_IN_USE"] == 1
    out = b.on_backend(b"s0", reg, b.now)                # its own connection: re-registers
    assert any(unpack(a.frames[0])["kind"] == wire.REGISTERED for a in out
               if isinstance(a, ToShard))
    out = b.on_backend(b"other", reg, b.now + deadline + 0.01)
    assert any(unpack(a.frames[0])["kind"] == wire.REGISTERED for a in out
               if isinstance(a, ToShard))
    assert b.shards["s0"].identity == b"other" and b.shards["s0"].alive
    assert b.counters["shards_lost"] == 2               # the restart, then the silent one
    b.validate_state()
    assert b.errors["SHARD_ID_IN_USE"] == 1


def _registered(actions) -> dict | None:
    for a in actions:
        if isinstance(a, ToShard) and unpack(a.frames[0])["kind"] == wire.REGISTERED:
            return unpack(a.frames[0])
    return None


def test_the_same_process_on_a_new_connection_registers_at_once_with_its_token():
    """Core only: a REGISTER for the live s0 from another routing id is accepted at once with
    the token of the process that registered s0 (a reconnect, whether or not that process
    heard its REGISTERED), refused with another one or none, and the old connection no longer
    speaks for s0."""
    rig = RepRig(("s0",))
    b = rig.broker
    token = b"T" * 16
    fields = rig.shards["s0"].register_fields()
    out = b.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0", token=token, **fields)],
                       b.now)                          # on its own connection: its token kept
    assert _registered(out) is not None and b.shards["s0"].token == token
    for bad in ({}, {"token": b"x" * 16}):
        out = b.on_backend(b"new", [wire.pack(wire.REGISTER, shard="s0", **fields, **bad)], b.now)
        assert unpack(out[0].frames[0])["code"] == "SHARD_ID_IN_USE"
    out = b.on_backend(b"new", [wire.pack(wire.REGISTER, shard="s0", token=token, **fields)],
                       b.now)
    assert _registered(out) is not None
    assert b.shards["s0"].identity == b"new" and b.shards["s0"].alive
    assert b.members.by_identity == {b"new": "s0"}
    out = b.on_backend(b"s0", [wire.pack(wire.HEARTBEAT)], b.now)   # the old connection
    assert unpack(out[0].frames[0])["code"] == "NOT_REGISTERED"
    b.validate_state()
    assert b.errors["SHARD_ID_IN_USE"] == 2
    out = b.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0", token=b"t", **fields)],
                       b.now)
    assert unpack(out[0].frames[0])["code"] == "BAD_FIELD"        # a token is 16..64 bytes


def test_with_curve_a_shards_name_is_bound_to_its_key():
    """Core only: the key that registered s0 may register it again from a new connection with
    its token; another key never takes the name, not even once s0 is dead."""
    rig = RepRig(("s0",))
    b = rig.broker
    fields = rig.shards["s0"].register_fields()
    b.shards["s0"].key = "K" * 40                  # as if it had registered with CURVE key K
    token = b.shards["s0"].token = b"T" * 16

    def register(ident, key, now, **kw):
        return b.on_backend(ident, [wire.pack(wire.REGISTER, shard="s0", **fields, **kw)], now,
                            roles={"shard"}, key=key)

    out = register(b"other", "L" * 40, b.now, token=token)
    assert "bound to another CURVE key" in unpack(out[0].frames[0])["message"]
    out = register(b"other", "L" * 40, b.now + 10 * b.settings.shard_deadline)  # s0 silent
    assert "bound to another CURVE key" in unpack(out[0].frames[0])["message"]
    assert _registered(register(b"mine", "K" * 40, b.now, token=token)) is not None
    assert b.shards["s0"].identity == b"mine" and b.shards["s0"].key == "K" * 40
    b.validate_state()


# ---- a borrowed routing id, through real processes -----------------------------------------
FAST_SHARDS = ["--heartbeat-interval", "0.1", "--liveness", "5"]
N = 4000        # floats of w: 63 blocks of 256, over partitions of both shards


def _pushes_after(c, w0, rounds: int) -> list:
    """``rounds`` pushes of ones, each waited for; the errors they raised."""
    failed = []
    for _ in range(rounds):
        try:
            c.push({"w": np.ones_like(w0)}, acks=1).result(30)
        except gradbus.GradbusError as e:
            failed.append(e)
    return failed


def _owned_by_both(url, curve) -> None:
    table = admin.partitions(url, curve=curve)
    layout = TensorLayout("w", "float32", (N,), 256)
    owners = {table["owners"][partition_of(k, len(table["owners"]))]
              for k in layout.block_keys()}
    assert owners == {"shard-0", "shard-1"}, owners


@pytest.mark.parametrize("curve_on", [False, True], ids=["plain", "curve"])
def test_a_peer_borrowing_a_shards_name_as_routing_id_takes_no_route(make_cluster, tmp_path,
                                                                    curve_on):
    """A second process opens a DEALER to the backend with routing id ``b"shard-0"`` and
    sends one REGISTER for shard-0, and stays connected: it gets a clear ERROR (FORBIDDEN for
    a client's key, SHARD_ID_IN_USE without CURVE), and the real shard-0 keeps hearing the
    broker: every push after it is applied, none fails, no shard is declared dead."""
    cluster = make_cluster(2, curve_dir=str(tmp_path / "keys") if curve_on else None,
                           broker_args=FAST_SHARDS, shard_args=FAST_SHARDS)
    url, curve = cluster.url, cluster.curve
    w0 = np.zeros(N, np.float32)
    with gradbus.connect(url, block_bytes=1024, curve=curve if curve_on else False) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=0.5))
        _owned_by_both(url, curve)
        assert _pushes_after(c, w0, 3) == []
        with backend_peer(url, curve, routing_id=b"shard-0") as rogue:
            rogue.send(wire.pack(wire.REGISTER, shard="shard-0", holds=[]))
            assert rogue.poll(10_000), "no answer to the register"
            reply = unpack(rogue.recv())
            assert reply["kind"] == wire.ERROR, reply
            assert reply["code"] == ("FORBIDDEN" if curve_on else "SHARD_ID_IN_USE"), reply
            failed = _pushes_after(c, w0, 30)     # the rogue still connected
            assert failed == []
        w = c.pull(["w"], min_version=33, timeout=30)["w"]
    np.testing.assert_array_equal(w, np.full_like(w0, -0.5 * 33))
    st = admin.status(url, curve=curve)
    assert st["counters"].get("shards_lost", 0) == 0
    assert [s["alive"] for s in st["shards"]] == [True, True] and not st["partitions_down"]


def test_a_peer_with_the_live_shards_own_routing_id_gets_nothing(make_cluster):
    """In-process, so that the test can read the routing id shard-0 connected with: a peer
    connecting with that very id is ignored by the backend (no hand-over): its REGISTER gets
    no answer, and shard-0 keeps its route."""
    cluster = make_cluster(2, processes=False, broker_args=FAST_SHARDS)
    w0 = np.zeros(N, np.float32)
    with gradbus.connect(cluster.url, block_bytes=1024) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=0.5))
        _owned_by_both(cluster.url, None)
        rid = cluster.broker.core.shards["shard-0"].identity
        assert rid[:1] != b"\0"      # not an id libzmq makes itself
        with backend_peer(cluster.url, routing_id=rid) as rogue:
            rogue.send(wire.pack(wire.REGISTER, shard="shard-0", holds=[]))
            failed = _pushes_after(c, w0, 30)
            assert failed == []
            assert not rogue.poll(0), unpack(rogue.recv())
        assert cluster.broker.core.shards["shard-0"].identity == rid
    assert cluster.broker.core.counters.get("shards_lost", 0) == 0


def test_with_curve_another_shard_key_cannot_take_a_live_shards_name(make_cluster, tmp_path):
    """A second key with the shard role registers as shard-0: refused, the name is bound to
    the key that registered it; the cluster's own shard key on a new connection, without the
    token, is refused while shard-0 lives."""
    keys = security.ClusterKeys.ensure(tmp_path / "keys")
    cluster = make_cluster(1, curve_dir=keys.directory, broker_args=FAST_SHARDS,
                           shard_args=FAST_SHARDS)
    pub, sec = security.generate(tmp_path / "other", "other", roles=("shard",))
    shutil.copy(pub, keys.allow)
    other = security.Curve.from_files(sec, keys.path("broker"))
    reply = register_as(cluster.url, "shard-0", curve=other, routing_id=b"shard-0")
    assert reply["code"] == "SHARD_ID_IN_USE" and "another CURVE key" in reply["message"]
    same = security.Curve.from_files(keys.path("shard", True), keys.path("broker"))
    reply = register_as(cluster.url, "shard-0", curve=same)
    assert reply["code"] == "SHARD_ID_IN_USE" and "live shard" in reply["message"]
    st = admin.status(cluster.url, curve=cluster.curve)
    assert st["errors"]["SHARD_ID_IN_USE"] == 2 and st["shards"][0]["alive"]
    assert st["counters"].get("shards_lost", 0) == 0


def test_a_shard_that_reconnects_registers_again_at_once_on_its_new_connection(make_cluster):
    """The broker stops (SIGSTOP) for several of the shard's silence windows: the shard calls
    it silent and connects again, under a new routing id, while its old connection still
    looks alive to the broker (what it sent meanwhile is read first). Its REGISTER carries
    its process's token: accepted at once, no SHARD_ID_IN_USE, and it serves again."""
    cluster = make_cluster(1, broker_args=["--heartbeat-interval", "0.25", "--liveness", "40"],
                           shard_args=FAST_SHARDS)        # the shard's window: 0.5 s
    w0 = np.zeros(N, np.float32)
    with gradbus.connect(cluster.url, block_bytes=1024) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=0.5))
        os.kill(cluster.broker_proc.pid, signal.SIGSTOP)
        try:
            time.sleep(2.0)          # the fault: four of the shard's windows without a word
        finally:
            os.kill(cluster.broker_proc.pid, signal.SIGCONT)
        wait_for(lambda: admin.status(cluster.url)["counters"].get("shards_lost", 0) >= 1, 30,
                 "the shard registered again on its new connection")
        st = admin.status(cluster.url)
        assert st["errors"].get("SHARD_ID_IN_USE", 0) == 0, st["errors"]
        assert [s["alive"] for s in st["shards"]] == [True]
        c.push({"w": np.ones_like(w0)}).result(30)
        assert np.array_equal(c.pull(["w"], min_version=1, timeout=30)["w"], w0 - 0.5)
