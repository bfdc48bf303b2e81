"""Typed messages (codecs/messages.py): every kind round-trips pack -> unpack -> typed, and every
malformed nested field is refused once, at unpacking, with BAD_FIELD naming the kind and the
field: at the module, and through the broker's and the shard's cores and a real cluster where
handlers used to catch what the schema did not pin down."""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradbus.codecs import messages, wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import TensorLayout, partition_of, row_key
from gradbus.shards.core import ShardCore

from .rigs import SGD, Rig, init_msg, make_agent_state, push_msg, unpack

ALL = frozenset(wire.SCHEMA)
LAYOUT = {"name": "w", "dtype": "float32", "shape": [8], "block": 4}
DESC = {"k": "w/0", "d": "float32", "s": [4], "c": "raw", "n": 16, "x": 0}
TABLE = {"dim": 4, "dtype": "float32", "init": {"name": "zeros"}, "opt": {"name": "sgd", "lr": 0.1}}
IDS = np.arange(3, dtype="<i8").tobytes()

# kind -> (descriptors, fields, check of the typed message)
SAMPLES = {
    wire.HELLO: ([], {"role": "client"}, lambda m: m.role == "client"),
    wire.WELCOME: ([], {"events": 5, "backend": 6, "partitions": 16, "down": [3], "hb": 0.5,
                        "shm": {"cluster": "0123abcd"}},
                   lambda m: (m.events, m.backend, m.partitions, m.down, m.hb, m.shm)
                   == (5, 6, 16, (3,), 0.5, {"cluster": "0123abcd"})),
    wire.INIT: ([DESC], {"msg": 1, "opt": SGD, "tensors": [{**LAYOUT, "init": {"name": "given"}}],
                         "tables": [{"name": "emb", **TABLE}], "cons": {"mode": "ssp", "n": 2}},
                lambda m: m.msg == 1 and m.opt == SGD and m.tensors[0].layout() == TensorLayout(
                    "w", "float32", (8,), 4) and m.tensors[0].rule == {"name": "given"}
                and m.tables[0].name == "emb" and m.tables[0].cfg["dim"] == 4
                and m.cons["mode"] == "ssp" and m.cons["n"] == 2 and m.t == [DESC]),
    wire.INIT_OK: ([], {"msg": 2, "created": ["a"], "existing": ["b"]},
                   lambda m: (m.msg, m.created, m.existing) == (2, ("a",), ("b",))),
    wire.PUSH: ([DESC], {"msg": 3, "acks": -1, "ver": 7},
                lambda m: (m.msg, m.acks, m.ver, m.t) == (3, wire.ACKS_ALL, 7, [DESC])),
    wire.ACK: ([], {"msg": 4, "msgs": [4, 5, 5]}, lambda m: m.msg == 4 and m.ids == (4, 5)
               and m.version(4) is None),
    wire.FREE: ([], {"msgs": [4, "x", 6]}, lambda m: m.msgs == (4, 6)),
    wire.SNAPSHOT: ([], {"req": 5, "keys": ["w/0"], "client": b"c", "of": 2},
                    lambda m: (m.req, m.keys, m.client, m.of) == (5, ("w/0",), b"c", 2)),
    wire.SNAPSHOT_REPLY: ([DESC], {"req": 6, "parts": [[1, 9]], "missing": ["x/0"], "of": 3},
                          lambda m: (m.req, m.parts, m.missing, m.of, m.client)
                          == (6, ((1, 9),), ("x/0",), 3, None)),
    wire.ROWS: ([], {"req": 7, "table": "emb", "q": [[2, IDS]], "min": 4, "tv": 1, "of": 1},
                lambda m: (m.req, m.table, m.q, m.malformed, m.min, m.tv)
                == (7, "emb", ((2, IDS),), 0, 4, 1)),
    wire.ROWS_REPLY: ([DESC], {"req": 8, "missing": [3], "tv": 2, "client": b"k", "of": 2},
                      lambda m: (m.req, m.missing, m.tv, m.client, m.of) == (8, (3,), 2, b"k", 2)),
    wire.CATALOG: ([], {"req": 9, "names": ["w", 1]}, lambda m: m.names == ("w",)),
    wire.CATALOG_REPLY: ([], {"req": 10, "tensors": [LAYOUT]},
                         lambda m: m.tensors == [LAYOUT] and m.tables == []
                         and m.header["req"] == 10),
    wire.STATUS: ([], {"req": 11, "table": True}, lambda m: (m.req, m.table) == (11, True)),
    wire.STATUS_REPLY: ([], {"req": 12, "status": {"a": 1}}, lambda m: m.status == {"a": 1}),
    wire.DIGEST: ([], {"req": 13, "ps": [0, 2]}, lambda m: (m.req, m.ps) == (13, (0, 2))),
    wire.DIGEST_REPLY: ([], {"req": 14, "shard": "s", "parts": [[0, 1, "ab"]]},
                        lambda m: m.parts == ((0, 1, "ab"),) and m.of == 1),
    wire.CHECKPOINT: ([], {"req": 15}, lambda m: (m.req, m.ps) == (15, None)),
    wire.CHECKPOINT_REPLY: ([], {"req": 16, "shard": "s", "path": "/p", "time": 1.5,
                                 "partitions": 2},
                            lambda m: (m.path, m.time, m.partitions, m.error)
                            == ("/p", 1.5, 2, None)),
    wire.ADMIN: ([], {"req": 17, "op": "drain", "shard": "s1"},
                 lambda m: (m.req, m.op, m.shard) == (17, "drain", "s1")),
    wire.ADMIN_REPLY: ([], {"req": 18, "result": {"moves_started": 1}},
                       lambda m: m.result == {"moves_started": 1}),
    wire.HEARTBEAT: ([], {"ps": [1, 2], "seqs": [5, 6], "tv": {"w": 3}, "info": {"keys": 1},
                          "shm": True},
                     lambda m: (m.ps, m.seqs, m.tv, m.info, m.shm)
                     == ((1, 2), (5, 6), {"w": 3}, {"keys": 1}, True)),
    wire.BYE: ([], {}, lambda m: type(m) is messages.Bye),
    wire.STOP: ([], {}, lambda m: type(m) is messages.Stop),
    wire.ERROR: ([], {"code": "STALE", "message": "old", "msg": 19},
                 lambda m: (m.code, m.message, m.msg, m.req) == ("STALE", "old", 19, None)),
    wire.REGISTER: ([], {"shard": "s0", "holds": [[1, 2, 3]], "rejoin": True,
                         "tensors": [{**LAYOUT, "opt": SGD}, {"name": "emb", "table": TABLE}],
                         "blocks": [["w/0", 4], ["emb#1", 2]], "shm": True},
                    lambda m: m.shard == "s0" and m.holds == ((1, 2, 3),) and m.rejoin
                    and m.tensors[0].spec.layout().nblocks == 2 and m.tensors[1].cfg["dim"] == 4
                    and m.blocks == (("w/0", 4), ("emb#1", 2)) and m.skipped == 0 and m.shm),
    wire.REGISTERED: ([], {"shard": "s0", "partitions": 16, "shm": True, "bepoch": 4},
                      lambda m: (m.shard, m.partitions, m.shm, m.bepoch) == ("s0", 16, True,
                                                                             4)),
    wire.BATCH: ([DESC], {"parts": [{"p": 1, "seq": 2, "epoch": 1, "o": "s0", "e": [
        {"op": "push", "i": 0, "c": b"c", "m": 9, "w": 0.5},
        {"op": "init", "key": "w/1", "layout": LAYOUT, "rule": {"name": "zeros"}, "opt": SGD},
        {"op": "init", "key": "emb#1", "table": TABLE}]}]},
        lambda m: (m.parts[0].p, m.parts[0].seq, m.parts[0].o) == (1, 2, "s0")
        and m.parts[0].e[0] == messages.PushEntry(0, b"c", 9, 0.0, 0.5)
        and m.parts[0].e[1].layout.name == "w" and m.parts[0].e[1].i is None
        and m.parts[0].e[2] == messages.TableInitEntry("emb#1", TABLE)),
    wire.APPLIED: ([], {"parts": [{"p": 1, "seq": 2, "epoch": 1, "errors": [[0, "BAD_SHAPE", "x"]],
                                   "vers": {"w/0": 3}, "n": -1, "dup": True,
                                   "tr": {"emb": [1, 16]}}], "shard": "s0"},
                   lambda m: m.shard == "s0" and m.parts[0] == messages.AppliedPart(
                       1, 2, 1, [[0, "BAD_SHAPE", "x"]], {"w/0": 3}, -1, True, {"emb": [1, 16]})),
    wire.UPDATE: ([DESC], {"p": 1, "seq": 2, "epoch": 3, "since": 1},
                  lambda m: (m.p, m.seq, m.epoch, m.t, m.since) == (1, 2, 3, [DESC], 1)),
    wire.FOLLOW: ([], {"ps": [3, 1]}, lambda m: m.ps == (3, 1)),
    wire.CREDIT: ([], {"ps": [3, 1], "seqs": [7, 0], "again": True},
                  lambda m: (m.ps, m.seqs, m.again) == ((3, 1), (7, 0), True)),
    wire.TABLE: ([], {"version": 2, "owners": ["s0", ""], "standbys": [["s1"], []],
                      "epochs": [1, 0], "down": [1]},
                 lambda m: (m.version, m.owners, m.standbys, m.epochs, m.down)
                 == (2, ("s0", ""), (("s1",), ()), (1, 0), (1,))),
    wire.ADOPT: ([], {"p": 3}, lambda m: m.p == 3),
    wire.STATE_REQ: ([], {"p": 3, "to": "s1"}, lambda m: (m.p, m.to) == (3, "s1")),
    wire.STATE: ([DESC, DESC], {"p": 3, "to": "s1", "seq": 4, "epoch": 1, "blocks": [
        {"key": "w/0", "layout": LAYOUT, "opt": SGD, "version": 2, "arrays": ["v"],
         "scalars": {"t": 1}}], "recent": [[b"c", 1, "w/0"], [None, 2, "w/0"], "junk"]},
        lambda m: m.blocks[0].nframes == 2 and m.blocks[0].version == 2
        and m.recent == ((b"c", 1, "w/0"), (None, 2, "w/0"))),
    wire.SYNCED: ([], {"p": 3, "seq": 4}, lambda m: (m.p, m.seq) == (3, 4)),
    wire.DROP: ([], {"ps": [1, "x", 2]}, lambda m: m.ps == (1, 2)),
    wire.PAIR: ([], {"role": "active", "epoch": 3, "run": 9},
                lambda m: (m.role, m.epoch, m.run) == ("active", 3, 9)),
}


def test_samples_cover_every_kind():
    assert SAMPLES.keys() == wire.SCHEMA.keys()


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_kind_round_trips(kind):
    descs, fields, check = SAMPLES[kind]
    frame = wire.pack(kind, descs, **fields)
    m = messages.unpack(frame, ALL)
    assert type(m).kind == m.kind == kind and check(m), m
    assert _fields(messages.unpack(zmq.Frame(frame), ALL, partitions=16)) == _fields(m)
    # unknown fields are ignored (a newer peer's optional fields)
    newer = messages.unpack(wire.pack(kind, descs, **fields, zz_future=[1, {"r": 2}]), ALL)
    assert _fields(newer) == _fields(m)


def _fields(m) -> dict:
    """A typed message's fields but the header it keeps for a Future."""
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "header"}


def test_optional_fields_of_the_wrong_type_are_absent():
    m = messages.unpack(wire.pack(wire.PUSH, msg=1, acks=1, ver="x"), ALL)
    assert m.ver is None
    m = messages.unpack(wire.pack(wire.ACK, msg=1, msgs=[1, "x"]), ALL)
    assert m.msgs is None and m.ids == (1,)
    m = messages.unpack(wire.pack(wire.ACK, msg=1, ver=-3), ALL)
    assert m.version(1) is None
    m = messages.unpack(wire.pack(wire.ACK, msg=1, msgs=[1, 2], vers=[5]), ALL)   # not parallel
    assert m.ids == (1, 2) and m.version(1) is None and m.version(2) is None
    m = messages.unpack(wire.pack(wire.ACK, msg=1, msgs=[1, 2], vers=[5, "x"]), ALL)
    assert m.version(1) == 5 and m.version(2) is None
    m = messages.unpack(wire.pack(wire.ACK, msg=1, ver=9), ALL)
    assert m.version(1) == 9 and m.version(2) is None and m.free == ()
    m = messages.unpack(wire.pack(wire.ACK, msg=1, free=[1, "x", 3]), ALL)
    assert m.free == (1, 3)
    m = messages.unpack(wire.pack(wire.ACK, msg=1, free="x"), ALL)
    assert m.free == ()
    m = messages.unpack(wire.pack(wire.WELCOME, events=1, backend=2, partitions=3, hb=-1), ALL)
    assert m.hb is None and m.down == ()
    m = messages.unpack(wire.pack(wire.HEARTBEAT, ps=[1], seqs=[1, 2]), ALL)
    assert m.ps is None and m.seqs is None
    m = messages.unpack(wire.pack(wire.UPDATE, p=1, seq=2, epoch=1, since=-1), ALL)
    assert m.since is None         # then the previous seq, as for every update on events
    m = messages.unpack(wire.pack(wire.CREDIT, ps=[1], seqs=[2], again="yes"), ALL)
    assert m.again is False
    ent = {"op": "push", "i": 0, "c": 5, "m": "x", "ts": "t", "w": 1.5}
    m = messages.unpack(wire.pack(wire.BATCH, [DESC], parts=[
        {"p": 0, "seq": 1, "epoch": 1, "o": 7, "e": [ent]}]), ALL)
    assert m.parts[0].o is None and m.parts[0].e[0] == messages.PushEntry(0, None, None, 0.0, None)


# -- malformed fields, at unpacking --------------------------------------------------------
def _part(**kw):
    return {"p": 0, "seq": 1, "epoch": 1, "e": [], **kw}


def _res(**kw):
    return {"p": 0, "seq": 1, "epoch": 1, "errors": [], "vers": {}, "n": -1, **kw}


BAD = {   # name -> (kind, descriptors, fields, code, words the message must hold)
    "push acks": (wire.PUSH, [], {"msg": 1, "acks": 2}, Code.BAD_FIELD, "push: acks"),
    "init opt": (wire.INIT, [], {"msg": 1, "opt": {"name": "rmsprop"}, "tensors": []},
                 Code.BAD_FIELD, "optimizer"),
    "init opt lr": (wire.INIT, [], {"msg": 1, "opt": {"name": "sgd", "lr": -1}, "tensors": []},
                    Code.BAD_FIELD, "lr"),
    "init cons": (wire.INIT, [], {"msg": 1, "opt": SGD, "tensors": [], "cons": {"mode": "x"}},
                  Code.BAD_FIELD, "init: cons"),
    "init ftrl": (wire.INIT, [], {"msg": 1, "opt": {"name": "ftrl", "lr": 1}, "tensors": [LAYOUT]},
                  Code.BAD_FIELD, "init: ftrl"),
    "snapshot keys": (wire.SNAPSHOT, [], {"req": 1, "keys": ["a", 2]}, Code.BAD_FIELD,
                      "snapshot: keys"),
    "catalog names": (wire.CATALOG, [], {"req": 1, "names": "w"}, Code.BAD_FIELD,
                      "catalog: names"),
    "digest ps type": (wire.DIGEST, [], {"req": 1, "ps": [0, "1"]}, Code.BAD_FIELD, "digest: ps"),
    "digest ps range": (wire.DIGEST, [], {"req": 1, "ps": [16]}, Code.BAD_FIELD, "digest: ps"),
    "checkpoint ps": (wire.CHECKPOINT, [], {"req": 1, "ps": 3}, Code.BAD_FIELD, "checkpoint: ps"),
    "admin op": (wire.ADMIN, [], {"req": 1, "op": "explode"}, Code.BAD_FIELD, "admin: unknown op"),
    "register shard": (wire.REGISTER, [], {"shard": ""}, Code.BAD_FIELD, "register: shard"),
    "register holds": (wire.REGISTER, [], {"shard": "s", "holds": [[1, 2]]}, Code.BAD_FIELD,
                       "register: holds"),
    "register holds range": (wire.REGISTER, [], {"shard": "s", "holds": [[16, 1, 1]]},
                             Code.BAD_FIELD, "register: holds"),
    "batch part": (wire.BATCH, [], {"parts": [3]}, Code.BAD_FIELD, "batch: parts"),
    "batch p": (wire.BATCH, [], {"parts": [_part(p="0")]}, Code.BAD_FIELD, "batch: part p"),
    "batch seq": (wire.BATCH, [], {"parts": [_part(seq=0)]}, Code.BAD_FIELD, "batch: part seq"),
    "batch epoch": (wire.BATCH, [], {"parts": [_part(epoch=-1)]}, Code.BAD_FIELD,
                    "batch: part epoch"),
    "batch e missing": (wire.BATCH, [], {"parts": [{"p": 0, "seq": 1, "epoch": 1}]},
                        Code.BAD_FIELD, "batch: part e"),
    "applied part": (wire.APPLIED, [], {"parts": [[1]]}, Code.BAD_FIELD, "applied: parts"),
    "applied p": (wire.APPLIED, [], {"parts": [_res(p=99)]}, Code.BAD_FIELD, "applied: part p"),
    "applied n": (wire.APPLIED, [], {"parts": [_res(n=-2)]}, Code.BAD_FIELD, "applied: part n"),
    "applied errors": (wire.APPLIED, [], {"parts": [_res(errors=[[0, "X"]])]}, Code.BAD_FIELD,
                       "applied: part errors"),
    "applied errors missing": (wire.APPLIED, [], {"parts": [{"p": 0, "seq": 1, "epoch": 1,
                                                             "vers": {}, "n": -1}]},
                               Code.BAD_FIELD, "applied: part errors"),
    "applied vers": (wire.APPLIED, [], {"parts": [_res(vers={"w/0": "1"})]}, Code.BAD_FIELD,
                     "applied: part vers"),
    "applied tr": (wire.APPLIED, [], {"parts": [_res(tr={"emb": [1]})]}, Code.BAD_FIELD,
                   "applied: part tr"),
    "update seq": (wire.UPDATE, [], {"p": 0, "seq": -1, "epoch": 1}, Code.BAD_FIELD, "update"),
    "state block": (wire.STATE, [], {"p": 0, "to": "", "seq": 1, "epoch": 1, "blocks": [5]},
                    Code.BAD_FIELD, "state: blocks"),
    "state layout": (wire.STATE, [DESC], {"p": 0, "to": "", "seq": 1, "epoch": 1, "blocks": [
        {"key": "w/0", "layout": {**LAYOUT, "shape": [0]}, "opt": SGD, "version": 0,
         "arrays": [], "scalars": {}}]}, Code.BAD_FIELD, "state: block layout"),
    "state version": (wire.STATE, [DESC], {"p": 0, "to": "", "seq": 1, "epoch": 1, "blocks": [
        {"key": "w/0", "layout": LAYOUT, "opt": SGD, "version": -1, "arrays": [],
         "scalars": {}}]}, Code.BAD_FIELD, "state: block version"),
    "state frames": (wire.STATE, [], {"p": 0, "to": "", "seq": 1, "epoch": 1, "blocks": [
        {"key": "w/0", "layout": LAYOUT, "opt": SGD, "version": 0, "arrays": [],
         "scalars": {}}]}, Code.BAD_FIELD, "state: blocks name"),
    "adopt p": (wire.ADOPT, [], {"p": 16}, Code.BAD_FIELD, "adopt: p"),
    "welcome port": (wire.WELCOME, [], {"events": 0, "backend": 1, "partitions": 1},
                     Code.BAD_FIELD, "welcome: events"),
    "snapshot_reply parts": (wire.SNAPSHOT_REPLY, [], {"req": 1, "parts": [[1]]},
                             Code.BAD_FIELD, "snapshot_reply: parts"),
    "rows_reply missing": (wire.ROWS_REPLY, [], {"req": 1, "missing": ["x"]}, Code.BAD_FIELD,
                           "rows_reply: missing"),
    "digest_reply parts": (wire.DIGEST_REPLY, [], {"req": 1, "shard": "", "parts": [[1, 2]]},
                           Code.BAD_FIELD, "digest_reply: parts"),
    "init_ok created": (wire.INIT_OK, [], {"msg": 1, "created": [1], "existing": []},
                        Code.BAD_FIELD, "init_ok: created"),
    "table owners": (wire.TABLE, [], {"version": 1, "owners": [None]}, Code.BAD_FIELD,
                     "table: owners"),
    "follow ps range": (wire.FOLLOW, [], {"ps": [16]}, Code.BAD_FIELD, "follow: ps"),
    "follow ps twice": (wire.FOLLOW, [], {"ps": [2, 2]}, Code.BAD_FIELD, "follow: ps"),
    "credit seqs": (wire.CREDIT, [], {"ps": [1], "seqs": [-1]}, Code.BAD_FIELD,
                    "credit: seqs"),
    "credit lengths": (wire.CREDIT, [], {"ps": [1, 2], "seqs": [1]}, Code.BAD_FIELD,
                       "credit: seqs must be as long"),
    "credit ps": (wire.CREDIT, [], {"ps": ["1"], "seqs": [1]}, Code.BAD_FIELD, "credit: ps"),
    "pair role": (wire.PAIR, [], {"role": "leader", "epoch": 1, "run": 1}, Code.BAD_FIELD,
                  "pair: role"),
    "pair epoch": (wire.PAIR, [], {"role": "active", "epoch": -1, "run": 1}, Code.BAD_FIELD,
                   "pair: role"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_malformed_field_is_refused_at_unpacking_naming_it(name):
    kind, descs, fields, code, words = BAD[name]
    with pytest.raises(messages.FieldError) as ei:
        messages.unpack(wire.pack(kind, descs, **fields), ALL, partitions=16)
    assert ei.value.code == code and words in str(ei.value), str(ei.value)
    assert ei.value.ids == {k: fields[k] for k in ("msg", "req") if k in fields}


def test_top_level_fields_are_still_the_header_schemas():
    for fields in ({"acks": 1}, {"msg": "1", "acks": 1}, {"msg": True, "acks": 1}):
        with pytest.raises(WireError) as ei:
            messages.unpack(msgpack.packb({"v": 1, "kind": "push", **fields}), ALL)
        assert ei.value.code == Code.BAD_FIELD and "push: field" in str(ei.value)


BAD_TENSORS = {   # an INIT tensor map: refused in its turn, with the code section 6.2 names
    "not a map": (5, Code.BAD_FIELD, "init: tensors"),
    "name": ({**LAYOUT, "name": ""}, Code.BAD_FIELD, "tensor name"),
    "dtype": ({**LAYOUT, "dtype": "int32"}, Code.BAD_DTYPE, "float32 or float64"),
    "dtype type": ({**LAYOUT, "dtype": []}, Code.BAD_DTYPE, "float32 or float64"),
    "shape": ({**LAYOUT, "shape": [0]}, Code.BAD_SHAPE, "shape"),
    "shape type": ({**LAYOUT, "shape": 8}, Code.BAD_SHAPE, "shape"),
    "block": ({**LAYOUT, "block": 0}, Code.BAD_FIELD, "block"),
    "block missing": ({k: v for k, v in LAYOUT.items() if k != "block"}, Code.BAD_FIELD,
                      "block"),
    "init rule": ({**LAYOUT, "init": {"name": "normal", "mean": 0, "std": -1}}, Code.BAD_FIELD,
                  "std"),
}


@pytest.mark.parametrize("name", sorted(BAD_TENSORS))
def test_an_init_tensor_map_is_checked_at_unpacking_and_refused_in_its_turn(name):
    t, code, words = BAD_TENSORS[name]
    m = messages.unpack(wire.pack(wire.INIT, msg=1, opt=SGD, tensors=[LAYOUT, t]), ALL)
    assert isinstance(m.tensors[0], messages.TensorSpec)
    bad = m.tensors[1]
    assert isinstance(bad, messages.Invalid) and bad.code == code and words in bad.message
    # through the broker: the whole INIT is refused with that code, nothing is created
    rig = Rig()
    rig.client(b"c", [wire.pack(wire.INIT, msg=1, opt=SGD, tensors=[
        {**LAYOUT, "init": {"name": "zeros"}}, t])])
    (r,) = rig.replies(b"c")
    assert (r["kind"], r["code"], r["msg"]) == ("error", code.value, 1) and words in r["message"]
    assert not rig.broker.catalog.tensors


def test_an_init_is_refused_in_protocol_order():
    """A descriptor's fault (section 4) comes before a bad tensor map, and the first tensor's
    SHAPE_MISMATCH before a later tensor's bad map (section 6.2)."""
    rig = Rig()
    frames, _ = init_msg(1, "w", np.zeros(8, np.float32))
    rig.client(b"c", frames)
    rig.client(b"c", [wire.pack(wire.INIT, [{**DESC, "d": "bool"}], msg=2, opt=SGD, tensors=[5]),
                      b"\0" * 16])
    rig.client(b"c", [wire.pack(wire.INIT, msg=3, opt=SGD, tensors=[
        {**LAYOUT, "shape": [9], "init": {"name": "zeros"}}, 5])])
    assert [(r["msg"], r["kind"], r.get("code")) for r in rig.replies(b"c")] == [
        (1, "init_ok", None), (2, "error", "BAD_DTYPE"), (3, "error", "SHAPE_MISMATCH")]


# -- through the broker's core: what the frontend catch-all used to answer -----------------
def _table_rig():
    rig = Rig(partitions=16)
    rig.client(b"c", [wire.pack(wire.INIT, msg=1, opt=SGD, tensors=[],
                                tables=[{"name": "emb", **TABLE}])])
    assert rig.replies(b"c")[0]["kind"] == "init_ok"
    return rig


FRONTEND = {   # name -> (header fields, code, words)
    "rows q pair": ({"kind": "rows", "req": 5, "table": "emb", "q": [[0]]}, "BAD_FIELD", "rows: q"),
    "rows q ids": ({"kind": "rows", "req": 5, "table": "emb", "q": [[0, b"123"]]}, "BAD_FIELD",
                   "rows: q"),
    "rows q partition": ({"kind": "rows", "req": 5, "table": "emb", "q": [[16, IDS]]},
                         "BAD_FIELD", "rows: q"),
    "admin op": ({"kind": "admin", "req": 5, "op": "explode"}, "BAD_FIELD", "admin: unknown op"),
    "digest ps": ({"kind": "digest", "req": 5, "ps": [99]}, "BAD_FIELD", "digest: ps"),
    "checkpoint ps": ({"kind": "checkpoint", "req": 5, "ps": "all"}, "BAD_FIELD",
                      "checkpoint: ps"),
    "catalog names": ({"kind": "catalog", "req": 5, "names": 7}, "BAD_FIELD", "catalog: names"),
    "snapshot keys": ({"kind": "snapshot", "req": 5, "keys": [None]}, "BAD_FIELD",
                      "snapshot: keys"),
    "push acks": ({"kind": "push", "msg": 5, "acks": 3}, "BAD_FIELD", "push: acks"),
    "init cons": ({"kind": "init", "msg": 5, "opt": SGD, "tensors": [], "cons": 3}, "BAD_FIELD",
                  "init: cons"),
    "init tables": ({"kind": "init", "msg": 5, "opt": SGD, "tensors": [], "tables": {}},
                    "BAD_FIELD", "init: tables"),
    "init table settings": ({"kind": "init", "msg": 5, "opt": SGD, "tensors": [],
                             "tables": [{"name": "t2", **TABLE, "dim": 0}]}, "BAD_FIELD",
                            "table dim"),
    "init table name": ({"kind": "init", "msg": 5, "opt": SGD, "tensors": [],
                         "tables": [{"name": "a#b", **TABLE}]}, "BAD_FIELD", "table name"),
}


@pytest.mark.parametrize("name", sorted(FRONTEND))
def test_broker_core_answers_a_malformed_request_with_bad_field(name):
    fields, code, words = FRONTEND[name]
    rig = _table_rig()
    rig.client(b"w", [msgpack.packb({"v": 1, **fields}, use_bin_type=True)])
    (r,) = rig.replies(b"w")
    assert r["kind"] == "error" and r["code"] == code and words in r["message"], r
    ids = {k: fields[k] for k in ("msg", "req") if k in fields}
    assert {k: r[k] for k in ("msg", "req") if k in r} == ids
    if fields["kind"] not in ("admin", "digest", "checkpoint"):
        assert b"w" in rig.broker.clients      # past steps 1-6: a worker
    assert not rig.broker.pending_entries


# -- through the broker's backend: APPLIED and REGISTER -------------------------------------
def _one_push_in_flight():
    rig = Rig(("s0",), partitions=16)
    rig.hold = True
    frames, layout = init_msg(1, "w", np.zeros(8, np.float32))
    rig.client(b"c", frames)
    (batch,) = rig.held
    rig.held = []
    s = rig.broker.shards["s0"]
    assert s.inflight == 1
    return rig, batch, s


BAD_APPLIED = {
    "errors": ({"errors": "none"}, "applied: part errors"),
    "vers": ({"vers": [1]}, "applied: part vers"),
    "n without frames": ({"n": 2}, "update frames"),
    "p": ({"p": -1}, "applied: part p"),
}


@pytest.mark.parametrize("name", sorted(BAD_APPLIED))
def test_a_malformed_applied_is_refused_counted_and_its_credit_returned(name):
    rig, batch, s = _one_push_in_flight()
    out = rig.shards["s0"].handle([bytes(f) for f in batch.frames])
    h = unpack(out[0][0])
    change, words = BAD_APPLIED[name]
    h["parts"][0].update(change)
    acts = rig.broker.on_backend(b"s0", [msgpack.packb(h, use_bin_type=True), *out[0][1:]],
                                 rig.now)
    (err,) = [unpack(a.frames[0]) for a in acts]
    assert err["kind"] == "error" and err["code"] == "BAD_FIELD" and words in err["message"]
    assert rig.broker.errors["bad_applied"] == 1 and s.inflight == 0
    rig.broker.validate_state()
    # the good APPLIED still settles the init
    rig.deliver(rig.broker.on_backend(b"s0", [bytes(f) for f in out[0]], rig.now))
    assert rig.replies(b"c")[0]["kind"] == "init_ok"


def test_a_register_with_bad_holds_is_refused_and_changes_nothing():
    rig = Rig(("s0",), partitions=16)
    for holds in ([[0, 1]], [[16, 1, 1]], [["0", 1, 1]], "all"):
        acts = rig.broker.on_backend(b"s9", [wire.pack(wire.REGISTER, shard="s9", holds=holds)],
                                     rig.now)
        (err,) = [unpack(a.frames[0]) for a in acts]
        assert err["code"] == "BAD_FIELD" and "register: holds" in err["message"]
    assert "s9" not in rig.broker.shards


def test_register_entries_that_cannot_be_used_are_skipped_and_counted():
    rig = Rig(("s0",), partitions=16)
    before = rig.broker.errors[Code.BAD_FIELD.value]
    rig.broker.on_backend(b"s1", [wire.pack(wire.REGISTER, shard="s1", holds=[], tensors=[
        {**LAYOUT, "opt": SGD}, {"name": "bad", "dtype": "int8", "shape": [1], "block": 1,
                                 "opt": SGD}, 7], blocks=[["w/0", 1], ["w/1"], 5])], rig.now)
    assert "w" in rig.broker.catalog.tensors and "bad" not in rig.broker.catalog.tensors
    assert rig.broker.errors[Code.BAD_FIELD.value] - before == 4


# -- through the shard's core: what the applier's catch-all used to answer ------------------
def _shard():
    sc = ShardCore("s0")
    layout = TensorLayout("w", "float32", (8,), 4)
    sc.handle([wire.pack(wire.BATCH, parts=[{"p": partition_of("w/0", 16), "seq": 1, "epoch": 1,
                                             "e": [{"op": "init", "key": k,
                                                    "layout": layout.to_wire(),
                                                    "rule": {"name": "zeros"}, "opt": SGD}
                                                   for k in layout.block_keys()]}])])
    return sc


BAD_ENTRIES = {
    "not a map": (5, "batch entry must be a map"),
    "unknown op": ({"op": "pull"}, "unknown entry op"),
    "push i missing": ({"op": "push"}, "push entry: i"),
    "push i type": ({"op": "push", "i": "0"}, "push entry: i"),
    "push i range": ({"op": "push", "i": 1}, "push entry: i"),
    "init key": ({"op": "init", "key": 3, "layout": LAYOUT, "rule": {"name": "zeros"},
                  "opt": SGD}, "init entry: key"),
    "init key of another tensor": ({"op": "init", "key": "v/0", "layout": LAYOUT,
                                    "rule": {"name": "zeros"}, "opt": SGD}, "not a block key"),
    "init block past the end": ({"op": "init", "key": "w/2", "layout": LAYOUT,
                                 "rule": {"name": "zeros"}, "opt": SGD}, "not a block key"),
    "init layout": ({"op": "init", "key": "w/0", "layout": {**LAYOUT, "block": "4"},
                     "rule": {"name": "zeros"}, "opt": SGD}, "init entry: layout"),
    "init layout missing": ({"op": "init", "key": "w/0", "rule": {"name": "zeros"}, "opt": SGD},
                            "init entry: layout"),
    "init rule": ({"op": "init", "key": "w/0", "layout": LAYOUT, "rule": {"name": "ones"},
                   "opt": SGD}, "unknown initializer"),
    "init opt": ({"op": "init", "key": "w/0", "layout": LAYOUT, "rule": {"name": "zeros"},
                  "opt": {"name": "sgd", "lr": 0}}, "lr"),
    "init i": ({"op": "init", "key": "w/0", "layout": LAYOUT, "rule": {"name": "given"},
                "opt": SGD, "i": "0"}, "init entry w/0: i"),
    "table key": ({"op": "init", "key": "emb", "table": TABLE}, "not a row key"),
    "table settings": ({"op": "init", "key": "emb#0", "table": {**TABLE, "dim": -1}},
                       "table dim"),
}


@pytest.mark.parametrize("name", sorted(BAD_ENTRIES))
def test_a_malformed_batch_entry_is_an_error_for_its_index_only(name):
    ent, words = BAD_ENTRIES[name]
    sc = _shard()
    p = partition_of("w/0", 16)
    g, buf = wire.encode_tensor("w/0", np.ones(4, np.float32))
    out = sc.handle([wire.pack(wire.BATCH, [g], parts=[{"p": p, "seq": 2, "epoch": 1, "e": [
        {"op": "push", "i": 0, "c": b"c", "m": 1}, ent]}]), bytes(buf)])
    res = unpack(out[0][0])["parts"][0]
    assert [(e[0], e[1]) for e in res["errors"]] == [(1, "BAD_FIELD")], res
    assert words in res["errors"][0][2]
    assert res["vers"] == {"w/0": 1}           # the good entry beside it was applied
    sc.validate_state()


BAD_PARTS = {
    "p": (_part(p=None), "batch: part p"),
    "seq": (_part(seq="1"), "batch: part seq"),
    "e": (_part(e={"op": "push"}), "batch: part e"),
    "part": ("part", "batch: parts"),
}


@pytest.mark.parametrize("name", sorted(BAD_PARTS))
def test_a_malformed_batch_part_is_an_error_and_nothing_is_applied(name):
    part, words = BAD_PARTS[name]
    sc = _shard()
    before = sc.partition_digest(partition_of("w/0", 16))
    (out,) = sc.handle([wire.pack(wire.BATCH, parts=[part])])
    err = unpack(out[0])
    assert err["kind"] == "error" and err["code"] == "BAD_FIELD" and words in err["message"]
    assert sc.partition_digest(partition_of("w/0", 16)) == before and sc.stats["errors"] == 1


def test_a_shard_skips_malformed_rows_pairs_and_refuses_a_malformed_state():
    sc = ShardCore("s0")
    p = 0
    sc.handle([wire.pack(wire.BATCH, parts=[{"p": p, "seq": 1, "epoch": 1, "e": [
        {"op": "init", "key": row_key("emb", p), "table": TABLE}]}])])
    (out,) = sc.handle([wire.pack(wire.ROWS, req=1, table="emb", q=[[p, IDS], [p, b"x"], 3])])
    h = unpack(out[0])
    assert h["kind"] == "rows_reply" and len(h["t"]) == 1 and h["missing"] == []
    sc.handle([wire.pack(wire.ADOPT, p=1)])
    (out,) = sc.handle([wire.pack(wire.STATE, p=1, to="s0", seq=1, epoch=1, blocks=[{"key": 1}])])
    assert unpack(out[0])["code"] == "BAD_FIELD" and sc.installing == {1: []}


# -- at the client: a malformed reply is counted and dropped, never fatal --------------------
def test_the_agent_counts_and_drops_malformed_replies_and_events():
    state, _ = make_agent_state()
    frames = [
        [wire.pack(wire.SNAPSHOT_REPLY, req=1, parts=[[0]])],
        [wire.pack(wire.ROWS_REPLY, req=1, missing="x")],
        [wire.pack(wire.INIT_OK, msg=1, created=[None], existing=[])],
    ]
    for f in frames:
        state.reply(f)
    for f in ([wire.TOPIC_TABLE], [wire.topic_partition(0), wire.pack(wire.UPDATE, p=0, seq=-1,
                                                                      epoch=1)]):
        state.event([zmq.Frame(x) for x in f])
    assert state.stats["bad_messages"] == 5
    state.validate_state()


# -- a real cluster: the frontend's answers over the wire -----------------------------------
def _ask(url: str, header: bytes) -> dict:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(url)
    try:
        s.send(header)
        assert s.poll(10_000), "no reply"
        return msgpack.unpackb(s.recv())
    finally:
        s.close()


@pytest.fixture(scope="module")
def cluster():
    from gradbus.cluster import LocalCluster
    c = LocalCluster(1, port=0).start()
    r = _ask(c.url, wire.pack(wire.INIT, msg=1, opt=SGD, tensors=[],
                              tables=[{"name": "emb", **TABLE}]))
    assert r["kind"] == "init_ok", r
    yield c
    c.stop()


@pytest.mark.parametrize("name", ["rows q pair", "rows q ids", "admin op", "checkpoint ps",
                                  "init table settings", "push acks", "snapshot keys"])
def test_a_real_broker_answers_malformed_nested_fields_with_bad_field(cluster, name):
    fields, code, words = FRONTEND[name]
    r = _ask(cluster.url, msgpack.packb({"v": 1, **fields}, use_bin_type=True))
    assert r["kind"] == "error" and r["code"] == code and words in r["message"], r
    assert r.get("msg", r.get("req")) == 5


def test_a_push_through_the_rig_still_applies():
    rig = Rig(("s0",), partitions=16)
    frames, layout = init_msg(1, "w", np.zeros(8, np.float32))
    rig.client(b"c", frames)
    rig.client(b"c", push_msg(2, layout, np.ones(8, np.float32)))
    assert [r["kind"] for r in rig.replies(b"c")] == ["init_ok", "ack"]


# -- fuzz: whatever the fields hold, typing a header raises WireError or returns a message ----
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=6) | st.binary(max_size=17))


def _nested(c):     # a named function: hypothesis reads its source to see that it recurses
    return st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3)


values = st.recursive(scalars, _nested, max_leaves=8)


def _mutate(v, draw, depth: int = 0):
    """``v`` with one value somewhere inside replaced (or a map key dropped); mostly deep
    inside, where the header schema does not look."""
    deeper = depth == 0 or draw(st.integers(0, 3)) > 0
    if isinstance(v, dict) and v and deeper:
        k = draw(st.sampled_from(sorted(v)))
        choice = draw(st.integers(0, 5))
        if choice == 0:
            return {x: y for x, y in v.items() if x != k}
        return {**v, k: _mutate(v[k], draw, depth + 1)}
    if isinstance(v, list) and v and deeper:
        i = draw(st.integers(0, len(v) - 1))
        return [*v[:i], _mutate(v[i], draw, depth + 1), *v[i + 1:]]
    return draw(values)


@settings(max_examples=600, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_fuzz_typing_a_header_raises_only_wire_errors(data):
    kind = data.draw(st.sampled_from(sorted(SAMPLES)))
    _, fields, _ = SAMPLES[kind]
    fields = _mutate(fields, data.draw) if fields else {}
    try:
        h = wire.unpack_header(wire.pack(kind, **fields), ALL)
    except WireError:
        return
    try:
        m = messages.from_header(h, partitions=data.draw(st.sampled_from([None, 1, 16])))
    except WireError as e:
        assert isinstance(e.code, Code) and str(e.args[0]).startswith(kind), e
    else:
        assert m.kind == kind
