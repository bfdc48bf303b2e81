"""A REGISTER that reuses the id of a shard alive on another connection is refused (counted,
answered SHARD_ID_IN_USE): the live shard keeps its partitions. Once that shard has been
silent past liveness, a replacement may take the id."""
from __future__ import annotations

import numpy as np

import gradbus
from gradbus import admin
from gradbus.broker.actions import ToShard
from gradbus.codecs import wire

from .rigs import RepRig, init_msg, register_as, unpack

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
