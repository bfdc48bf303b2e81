"""Sparse embedding tables through the broker and shards: lazy rows placed by id over every
partition, duplicate ids summed, reads that see the reader's own pushes, replication, moves,
checkpoints, a restarted broker, the frequency filter and row expiry."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.broker.actions import ToClient
from gradbus.broker.core import BrokerCore
from gradbus.codecs import specs, wire
from gradbus.codecs.errors import Code
from gradbus.codecs.partition import row_key, row_partitions
from gradbus.shards.core import ShardCore
from gradbus.shards.rows import row_init
from gradbus.workers import tables as rows_mod

from .rigs import RepRig, Rig, unpack, wait_for

P = 16
SGD = {"name": "sgd", "lr": 0.5}


def table_init_msg(msg, name="emb", dim=4, opt=SGD, init=None, **cfg):
    t = {"name": name, "dim": dim, "init": init or {"name": "normal", "mean": 0.0, "std": 0.1,
                                                   "seed": 7}, "opt": opt, **cfg}
    return [wire.pack(wire.INIT, msg=msg, opt=opt, tensors=[], tables=[t])]


def rows_push_msg(msg, name, ids, grads, partitions=P):
    uniq, summed = rows_mod.sum_duplicates(np.asarray(ids, np.int64), np.asarray(grads,
                                                                                 np.float32))
    descs, bufs = [], []
    for p, where in rows_mod.by_partition(name, uniq, partitions):
        d, buf = wire.encode_tensor(row_key(name, p), np.ascontiguousarray(summed[where]))
        d["ids"] = uniq[where].tobytes()
        descs.append(d)
        bufs.append(bytes(buf))
    return [wire.pack(wire.PUSH, descs, msg=msg, acks=1), *bufs]


def stored(rig, name, ids, dim=4):
    """Rows as the owning primaries hold them (initial values where not created)."""
    out = []
    for i in ids:
        p = int(row_partitions(name, np.array([i]), rig.broker.P)[0])
        tbl = rig.shards[rig.broker.owners[p]].store.tables[row_key(name, p)]
        out.append(tbl.lookup(np.array([i], np.int64))[0])
    return np.array(out).reshape(len(ids), dim)


def test_rows_are_created_on_push_spread_over_shards_and_summed_per_id():
    rig = Rig(("s0", "s1"), partitions=P)
    rig.client(b"c", table_init_msg(1))
    assert rig.replies(b"c")[0]["created"] == ["emb"]
    rule = {"name": "normal", "mean": 0.0, "std": 0.1, "seed": 7}
    ids = np.arange(200, dtype=np.int64)
    g = np.ones((200, 4), np.float32)
    rig.client(b"c", rows_push_msg(2, "emb", np.concatenate([ids, ids[:50]]),
                                   np.concatenate([g, g[:50]])))
    assert [r["kind"] for r in rig.replies(b"c")] == ["ack"]
    want = row_init(ids, 4, rule, np.float32) - 0.5 * np.where(ids < 50, 2.0, 1.0)[:, None]
    np.testing.assert_allclose(stored(rig, "emb", ids), want, rtol=1e-6)
    held = {sid: sc.store.rows for sid, sc in rig.shards.items()}
    assert sum(held.values()) == 200 and min(held.values()) > 40, held
    st = rig.broker.status(0)["tables"][0]
    assert st["name"] == "emb" and st["rows"] == 200 and st["version"] > 0
    assert st["bytes"] == sum(sc.store.nbytes for sc in rig.shards.values())


def test_a_read_goes_out_after_the_readers_push_and_never_creates_rows():
    rig = RepRig(("s0",), partitions=P)
    rig.client(b"c", table_init_msg(1, init={"name": "zeros"}))
    rig.replies(b"c")
    rig.intercept = lambda sid, kind: True     # hold what the broker sends, in order
    rig.client(b"c", rows_push_msg(2, "emb", [5], np.ones((1, 4))))
    parts = row_partitions("emb", np.arange(100), P)
    other = int(np.flatnonzero(parts == parts[5])[1])     # another id of 5's partition
    q = [[int(parts[5]), np.array([5, other], np.int64).tobytes()]]
    rig.client(b"c", [wire.pack(wire.ROWS, req=9, table="emb", q=q)])
    assert [unpack(a.frames[0])["kind"] for a in rig.held] == ["batch", "rows"]
    rig.intercept = None
    rig.release()
    got = [f for i, f in rig.to_clients if unpack(f[0])["kind"] == "rows_reply"]
    h = unpack(got[0][0])
    desc = wire.parse_tensors(h, got[0][1:])[0]
    assert np.array_equal(wire.decode_tensor(desc, got[0][1]),
                          [[-0.5] * 4, [0.0] * 4])     # its own push; the other reads as its init
    assert rig.shards["s0"].store.rows == 1


def test_bad_row_messages_are_refused_with_clear_codes():
    rig = Rig(("s0",), partitions=P)
    rig.client(b"c", table_init_msg(1))
    rig.replies(b"c")
    # a row sent in a partition it does not hash to
    ids = np.array([3], np.int64)
    p = int(row_partitions("emb", ids, P)[0])
    d, buf = wire.encode_tensor(row_key("emb", (p + 1) % P), np.ones((1, 4), np.float32))
    d["ids"] = ids.tobytes()
    rig.client(b"c", [wire.pack(wire.PUSH, [d], msg=2, acks=1), bytes(buf)])
    # wrong dim; unknown table; ids whose count does not match the shape
    d2, buf2 = wire.encode_tensor(row_key("emb", p), np.ones((1, 3), np.float32))
    d2["ids"] = ids.tobytes()
    rig.client(b"c", [wire.pack(wire.PUSH, [d2], msg=3, acks=1), bytes(buf2)])
    d3, buf3 = wire.encode_tensor(row_key("nope", p), np.ones((1, 4), np.float32))
    d3["ids"] = ids.tobytes()
    rig.client(b"c", [wire.pack(wire.PUSH, [d3], msg=4, acks=1), bytes(buf3)])
    d4 = dict(d, ids=np.array([3, 4], np.int64).tobytes())
    rig.client(b"c", [wire.pack(wire.PUSH, [d4], msg=5, acks=1), bytes(buf)])
    codes = {r["msg"]: r["code"] for r in rig.replies(b"c")}
    assert codes == {2: Code.BAD_FIELD.value, 3: Code.BAD_SHAPE.value,
                     4: Code.UNKNOWN_KEY.value, 5: Code.BAD_SHAPE.value}
    # a table settings error, a name clash, and ftrl on dense tensors
    rig.client(b"c", table_init_msg(6, dim=0))
    rig.client(b"c", table_init_msg(7, dim=8))
    rig.client(b"c", table_init_msg(8, opt={"name": "adam", "lr": 0.1}))
    rig.client(b"c", [wire.pack(wire.INIT, msg=9, opt={"name": "ftrl", "lr": 0.1},
                                tensors=[{"name": "d", "dtype": "float32", "shape": [2],
                                          "block": 2, "init": {"name": "zeros"}}])])
    errs = {r["msg"]: r["code"] for r in rig.replies(b"c")}
    assert errs == {6: Code.BAD_FIELD.value, 7: Code.SHAPE_MISMATCH.value,
                    8: Code.BAD_FIELD.value, 9: Code.BAD_FIELD.value}
    assert rig.shards["s0"].store.rows == 0


@pytest.mark.parametrize("opt", [SGD, {"name": "adagrad", "lr": 0.1},
                                 {"name": "ftrl", "lr": 0.1, "l1": 0.01}])
def test_standbys_hold_identical_rows_and_a_moved_partition_keeps_them(opt):
    rig = RepRig(("s0", "s1"), replicas=2, partitions=P)
    rig.client(b"c", table_init_msg(1, opt=opt))
    rng = np.random.default_rng(0)
    for m in range(2, 8):
        ids = rng.integers(0, 300, 64)
        rig.client(b"c", rows_push_msg(m, "emb", ids, rng.normal(size=(64, 4))))
    for p in range(P):
        d = rig.digests(p)
        assert len(d) == 2 and len(set(d.values())) == 1, (p, d)
    before = {p: rig.digests(p)[rig.broker.owners[p]] for p in range(P)}
    ids = np.arange(300)
    values = stored(rig, "emb", ids)
    # a third shard joins: partitions move to it (state export, install, catch-up)
    rig.join("s2")
    assert rig.shards["s2"].store.partitions, "nothing moved"
    for p in range(P):
        assert set(rig.digests(p).values()) == {before[p]}
    np.testing.assert_array_equal(stored(rig, "emb", ids), values)


def test_checkpointed_states_restore_rows_and_a_restarted_broker_relearns_the_table():
    rig = Rig(("s0",), partitions=P)
    rig.client(b"c", table_init_msg(1, opt={"name": "adagrad", "lr": 0.1}))
    rng = np.random.default_rng(1)
    for m in range(2, 5):
        rig.client(b"c", rows_push_msg(m, "emb", rng.integers(0, 100, 32),
                                       rng.normal(size=(32, 4))))
    old = rig.shards["s0"]
    fresh = ShardCore("s0")
    for st in old.states():
        st = [bytes(memoryview(f)) for f in st]
        h = unpack(st[0])
        fresh.install_state(h, wire.parse_tensors(h, st[1:]), st[1:])
    assert all(fresh.partition_digest(p) == old.partition_digest(p) for p in range(P))
    # a new broker learns the table from the shard's registration and takes pushes for it
    b2 = BrokerCore(P, now=0.0)
    b2.on_backend(b"s0", [wire.pack(wire.REGISTER, shard="s0", **fresh.register_fields())], 0.0)
    assert "emb" in b2.tables and b2.tables["emb"].cfg["opt"]["name"] == "adagrad"
    acts = b2.on_frontend(b"c", rows_push_msg(9, "emb", [1, 2], np.ones((2, 4))), 0.0)
    assert not [a for a in acts if isinstance(a, ToClient)]  # accepted, not refused
    assert b2.pending_entries


def test_frequency_filter_and_expiry_through_the_shard():
    sc = ShardCore("s0")
    cfg = specs.table_from_wire({"dim": 2, "init": {"name": "zeros"}, "opt": SGD,
                                 "min_count": 2, "expiry": 10.0})
    rig = Rig(("s0",), partitions=1)
    rig.shards["s0"] = sc
    rig.client(b"c", [wire.pack(wire.INIT, msg=1, opt=SGD, tensors=[],
                                tables=[{"name": "t", **cfg}])])
    times = iter([100.0, 101.0, 102.0, 200.0])
    rig.broker.wall = lambda: next(times)
    tbl = sc.store.tables["t#0"]
    rig.client(b"c", rows_push_msg(2, "t", [1, 2], np.ones((2, 2)), 1))
    assert tbl.rows == 0                               # seen once: filtered
    rig.client(b"c", rows_push_msg(3, "t", [1], np.ones((1, 2)), 1))
    assert tbl.rows == 1 and np.array_equal(tbl.lookup(np.array([1])), [[-0.5, -0.5]])
    rig.client(b"c", rows_push_msg(4, "t", [2], np.ones((1, 2)), 1))
    assert tbl.rows == 2
    rig.client(b"c", rows_push_msg(5, "t", [7], np.ones((1, 2)), 1))   # 98 s later
    assert tbl.rows == 0 and tbl.stats["rows_expired"] == 2
    assert sc.info()["rows_expired"] == 2 and sc.info()["rows_filtered"] == 3   # 1, 2 and 7


def test_sdk_tables_end_to_end(make_cluster):
    cl = make_cluster(shards=2, processes=False, partitions=P)
    with gradbus.connect(cl.url) as a, gradbus.connect(cl.url) as b:
        a.init_table("emb", 8, gradbus.Normal(std=0.1, seed=3), gradbus.SGD(lr=0.5))
        b.init_table("emb", 8, gradbus.Zeros(), gradbus.Adagrad(lr=0.1))     # exists: no-op
        ids = np.array([[1, 2], [2, 10**15]])
        first = a.pull_rows("emb", ids)
        assert first.shape == (2, 2, 8)
        rule = {"name": "normal", "mean": 0.0, "std": 0.1, "seed": 3}
        np.testing.assert_array_equal(first.reshape(-1, 8),
                                      row_init(ids.reshape(-1), 8, rule, np.float32))
        assert np.array_equal(b.pull_rows("emb", ids), first)      # the same initial rows
        a.push_rows("emb", ids.reshape(-1), np.ones((4, 8))).result(10)
        got = a.pull_rows("emb", [2, 1, 10**15, 5])
        base = row_init(np.array([2, 1, 10**15, 5]), 8, rule, np.float32)
        np.testing.assert_allclose(got, base - 0.5 * np.array([2, 1, 1, 0])[:, None],
                                   rtol=1e-6)
        many = np.arange(5000)
        b.push_rows("emb", many, np.full((5000, 8), 0.5), codec="bf16").result(10)
        assert np.allclose(b.pull_rows("emb", many[100:]), row_init(
            many[100:], 8, rule, np.float32) - 0.25, atol=1e-6)
        st = wait_for(lambda: (s := a.status())["tables"] and s["tables"][0]["rows"] == 5001
                      and s, 10, "row counts in status")
        assert st["tables"][0]["dim"] == 8
        held = [s["bytes"] for s in st["shards"]]          # what rebalancing weighs
        assert sum(held) == 5001 * 8 * 4 and min(held) > sum(held) / 4, held
        from click.testing import CliRunner

        from gradbus.cli import main
        out = CliRunner().invoke(main, ["status", "--broker", cl.url]).output
        line = next(x for x in out.splitlines() if x.startswith("emb "))
        assert line.split()[1:4] == ["float32", "8", "5001"], out
        with pytest.raises(ValueError):
            a.push_rows("emb", [1, 2], np.ones((2, 7)))
        with pytest.raises(ValueError):
            a.pull_rows("emb", [1.5])
        with pytest.raises(ValueError):
            a.push_rows("emb", [1], np.ones((1, 8)), codec="topk:0.1")
        with pytest.raises(gradbus.UnknownKeyError):
            a.pull_rows("nope", [1])
        with pytest.raises(gradbus.GradbusError, match="SHAPE_MISMATCH"):
            a.init_table("emb", 4)                                    # other dim
        with pytest.raises(ValueError):
            a.init_table("bad", 4, optimizer=gradbus.Adam(lr=0.1))


def test_bounded_staleness_for_tables(make_cluster):
    """ssp:S on a table: a push of rows read more than S pushes ago is refused, and with
    scale_lr a stale push is scaled by 1/staleness; staleness counts pushes to the table."""
    cl = make_cluster(shards=2, processes=False, partitions=P)
    with gradbus.connect(cl.url) as a, gradbus.connect(cl.url) as b:
        a.init_table("ssp", 2, gradbus.Zeros(), gradbus.SGD(lr=1.0), consistency="ssp:5",
                     scale_lr=True)
        a.init_table("strict", 2, gradbus.Zeros(), gradbus.SGD(lr=1.0), consistency="ssp:2")
        ids = [1, 2, 3]
        a.pull_rows("ssp", ids)
        a.pull_rows("strict", ids)
        for _ in range(4):                     # b reads before each push: never stale
            for name in ("ssp", "strict"):
                b.pull_rows(name, ids)
                b.push_rows(name, ids, np.ones((3, 2))).result(10)
        a.push_rows("ssp", ids, np.ones((3, 2))).result(10)      # 4 behind: scaled by 1/4
        np.testing.assert_allclose(b.pull_rows("ssp", ids), np.full((3, 2), -4.25))
        with pytest.raises(gradbus.StaleError):
            a.push_rows("strict", ids, np.ones((3, 2))).result(10)
        np.testing.assert_array_equal(b.pull_rows("strict", ids), np.full((3, 2), -4.0))
        st = a.status()
        assert {t["name"]: t["version"] for t in st["tables"]} == {"ssp": 5, "strict": 4}
        assert st["staleness"]["count"] >= 10
        with pytest.raises(ValueError):
            a.init_table("bad", 2, consistency="bsp:0")


def test_bsp_tables_apply_a_step_once_every_worker_pushed_and_reads_wait_for_it(make_cluster):
    cl = make_cluster(shards=2, processes=False, partitions=P)
    with gradbus.connect(cl.url) as a, gradbus.connect(cl.url) as b:
        a.init_table("bsp", 2, gradbus.Zeros(), gradbus.SGD(lr=1.0), consistency="bsp:2")
        ids = [5, 6]
        for step in range(1, 3):
            a.pull_rows("bsp", ids)
            b.pull_rows("bsp", ids)
            fa = a.push_rows("bsp", ids, np.ones((2, 2)))
            with ThreadPoolExecutor(1) as ex:
                read = ex.submit(a.pull_rows, "bsp", ids)       # waits for the step
                with pytest.raises(TimeoutError):
                    fa.result(0.3)                              # held: b has not pushed
                assert not read.done()
                b.push_rows("bsp", ids, np.ones((2, 2))).result(10)
                fa.result(10)
                np.testing.assert_array_equal(read.result(10), np.full((2, 2), -2.0 * step))
        with pytest.raises(gradbus.StaleError):             # b's step 2 is over
            b.push_rows("bsp", ids, np.ones((2, 2))).result(10)
        assert [t["version"] for t in a.status()["tables"]] == [4]


def test_a_table_spread_over_fewer_partitions(make_cluster):
    """spread=S keeps a table's rows in S partitions (the same S for every process), so a
    push of many ids is S messages' worth of work, not one per partition of the cluster."""
    from gradbus.codecs.partition import table_partitions
    cl = make_cluster(shards=2, processes=False, partitions=P)
    with gradbus.connect(cl.url) as c:
        c.init_table("few", 4, gradbus.Zeros(), gradbus.SGD(lr=0.5), spread=4)
        ids = np.arange(1000)
        c.push_rows("few", ids, np.ones((1000, 4))).result(10)
        np.testing.assert_array_equal(c.pull_rows("few", ids), np.full((1000, 4), -0.5))
        parts = set(row_partitions("few", ids, P, 4).tolist())
        assert parts == set(table_partitions("few", P, 4).tolist()) and len(parts) == 4
        st = c.status()
        assert st["tables"][0]["rows"] == 1000
        pt = admin.partitions(cl.url)
        owners = {pt["owners"][p] for p in parts}
        assert len(owners) == 2                  # 4 partitions still reach both shards
        with pytest.raises(ValueError):
            c.init_table("bad", 4, spread=-1)

