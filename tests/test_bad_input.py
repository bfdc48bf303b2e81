"""Bad input sent raw to the broker's ports: an ERROR with a code, and the cluster keeps serving."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

import gradbus
from gradbus import admin
from gradbus.codecs import net, wire


def _raw_dealer(url: str):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(url)
    return s


def _reply(sock, timeout=5.0) -> dict:
    assert sock.poll(int(timeout * 1000)), "no reply"
    return msgpack.unpackb(sock.recv_multipart()[0])


def _hdr(**kw) -> bytes:
    return msgpack.packb({"v": wire.PROTOCOL, **kw})


def _known_answer(url: str, name: str) -> None:
    with gradbus.connect(url) as c:
        c.init({name: np.zeros(64, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
        for f in [c.push({name: np.full(64, 0.25, np.float32)}) for _ in range(8)]:
            f.result(10)
        assert np.array_equal(c.pull([name], min_version=8)[name], np.full(64, -1.0, np.float32))


@pytest.fixture(scope="module")
def cluster():
    from gradbus.cluster import LocalCluster
    c = LocalCluster(1, port=0).start()
    yield c
    c.stop()


def _desc(key, dtype="float32", shape=(64,), n=256, x=0, codec="raw"):
    return {"k": key, "d": dtype, "s": list(shape), "c": codec, "n": n, "x": x}


CASES = {
    "garbage": ([b"\xc1\xff garbage"], "BAD_FRAME"),
    "not a map": ([msgpack.packb([1, 2, 3])], "BAD_FRAME"),
    "old version": ([msgpack.packb({"v": 99, "kind": "push"})], "BAD_VERSION"),
    "unknown kind": ([_hdr(kind="explode", msg=1)], "UNKNOWN_KIND"),
    "missing field": ([_hdr(kind="push", acks=1)], "BAD_FIELD"),
    "truncated": ([_hdr(kind="push", msg=1, acks=1, t=[_desc("w/0")])], "BAD_FRAME"),
    "wrong dtype": ([_hdr(kind="push", msg=2, acks=1, t=[_desc("w/0", dtype="object")]),
                     b"\0" * 256], "BAD_DTYPE"),
    "shape vs bytes": ([_hdr(kind="push", msg=3, acks=1, t=[_desc("w/0", shape=(65,))]),
                        b"\0" * 256], "BAD_SHAPE"),
    "frame shorter than header says": ([_hdr(kind="push", msg=4, acks=1, t=[_desc("w/0")]),
                                        b"\0" * 200], "BAD_SHAPE"),
    "unknown key": ([_hdr(kind="push", msg=5, acks=1, t=[_desc("nosuch/0")]), b"\0" * 256],
                    "UNKNOWN_KEY"),
    "oversize": ([_hdr(kind="push", msg=6, acks=1,
                       t=[_desc("w/0", shape=(1 << 32,), n=4 << 32)]), b"\0" * 16], "TOO_LARGE"),
    "bad codec": ([_hdr(kind="push", msg=7, acks=1, t=[_desc("w/0", codec="lzma")]),
                   b"\0" * 256], "BAD_CODEC"),
    "bad optimizer": ([_hdr(kind="init", msg=8, opt={"name": "rmsprop", "lr": 1}, tensors=[])],
                      "BAD_FIELD"),
    "adam beta of 1": ([_hdr(kind="init", msg=9, opt={"name": "adam", "lr": 1, "betas": [1, 0.9]},
                             tensors=[])], "BAD_FIELD"),
    "unhashable kind": ([_hdr(kind=[], msg=10)], "UNKNOWN_KIND"),
    "tensors not maps": ([_hdr(kind="init", msg=11, opt={"name": "sgd", "lr": 1},
                               tensors=[1, 2])], "BAD_FIELD"),
    "huge init": ([_hdr(kind="init", msg=12, opt={"name": "sgd", "lr": 1},
                        tensors=[{"name": "h", "dtype": "float32", "shape": [2**39, 2**39],
                                  "block": 1, "init": {"name": "zeros"}}])], "TOO_LARGE"),
    "many blocks": ([_hdr(kind="init", msg=13, opt={"name": "sgd", "lr": 1},
                          tensors=[{"name": "h", "dtype": "float32", "shape": [2**30],
                                    "block": 1, "init": {"name": "zeros"}}])], "TOO_LARGE"),
    "snapshot keys not strings": ([_hdr(kind="snapshot", req=14, keys=[1])], "BAD_FIELD"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_frontend_bad_input_gets_error_code(cluster, case):
    frames, code = CASES[case]
    s = _raw_dealer(cluster.url)
    try:
        s.send_multipart(frames)
        r = _reply(s)
        assert r["kind"] == "error" and r["code"] == code, r
    finally:
        s.close()


def test_checksum_mismatch_refused_by_shard(cluster):
    with gradbus.connect(cluster.url) as c:
        c.init({"cs": np.zeros(64, np.float32)})
    s = _raw_dealer(cluster.url)
    try:
        d, buf = wire.encode_tensor("cs/0", np.ones(64, np.float32))
        d["x"] ^= 1
        s.send_multipart([wire.pack(wire.PUSH, [d], msg=1, acks=1), bytes(buf)])
        r = _reply(s)
        assert r["code"] == "BAD_CHECKSUM" and r["msg"] == 1
    finally:
        s.close()


def test_backend_garbage_and_unregistered(cluster):
    welcome = net.hello(zmq.Context.instance(), cluster.url, "shard", 5)
    host, _ = net.split_url(cluster.url)
    s = _raw_dealer(net.url(host, welcome["backend"]))
    try:
        s.send_multipart([b"\x00\x01garbage", b"x"])
        assert _reply(s)["code"] == "BAD_FRAME"
        s.send_multipart([wire.pack(wire.APPLIED, parts=[])])
        assert _reply(s)["code"] == "NOT_REGISTERED"
    finally:
        s.close()


def test_cluster_still_serves_after_bad_input(cluster):
    for case in sorted(CASES):
        s = _raw_dealer(cluster.url)
        s.send_multipart(CASES[case][0])
        _reply(s)
        s.close()
    _known_answer(cluster.url, "after_bad")
    st = admin.status(cluster.url)
    # the cluster is the module's: how many bad frames it saw depends on the tests selected
    assert st["errors"].get("BAD_FRAME", 0) >= 1 and all(s["alive"] for s in st["shards"])


def test_header_of_millions_of_containers_is_refused_cheaply():
    import time

    from gradbus.codecs.errors import WireError
    h = msgpack.packb({"v": 1, "kind": "heartbeat", "pad": [[]] * 4_000_000})
    t = time.perf_counter()
    with pytest.raises(WireError) as ei:
        wire.unpack_header(h, wire.FRONTEND_KINDS)
    assert ei.value.code.value == "BAD_FRAME" and time.perf_counter() - t < 0.5
