"""Shards' replies through shared memory: the reply area on its own (exact bytes, a slot
written over reads as torn, growth up to its cap, reads against a writer in another process),
the broker's copy of a reply for a client that does not read shared memory, and real broker
and shard processes where snapshots, table rows reads and a standby's catch-up go through the
primary's reply area, a client without shared memory gets the same values as frames, replies
torn by a process that keeps wiping the area's stamps are asked again and come out exact, and
nothing is left behind after a SIGKILLed shard and a stop.

Every test has a shared-memory directory of its own (``$GRADBUS_SHM_DIR``, inherited by the
processes it starts) and leaves it without a gradbus segment."""
from __future__ import annotations

import json
import os
import signal
import time

import msgpack
import numpy as np
import pytest
import zmq

import gradbus
from gradbus import admin
from gradbus.broker.core import BrokerCore
from gradbus.broker.shm_io import ShmIO
from gradbus.codecs import shm, wire
from gradbus.codecs.errors import WireError

from .rigs import end_code, gradbus_segments, replicas_agree, spawn_code, wait_for

pytestmark = pytest.mark.usefixtures("shm_dir")

CLUSTER = "0badc0de"
LR = 0.25      # powers of two: every intermediate result is exact
G = 0.5
FAST_HB = ["--heartbeat-interval", "0.25", "--liveness", "8"]

# ----------------------------------------------------------------------------- the reply area
def test_a_reply_area_holds_exact_bytes_a_reader_copies_out():
    area = shm.ReplyArea(CLUSTER, cap=1 << 20, first=64 << 10)
    reader = shm.Mapper()
    try:
        a = np.arange(1000, dtype=np.float32)
        b = np.arange(77, dtype=np.int64).reshape(7, 11)
        refs = area.place([a, b, b""])
        assert [len(r) for r in refs] == [3, 3, 3] and len({r[2] for r in refs}) == 1
        name = refs[0][0]
        assert shm.owned(name)[1] == "s" and shm.owned(name)[2] == os.getpid()
        assert all(r[1] % shm.ALIGN == 0 for r in refs)
        assert bytes(reader.copy(refs[0], a.nbytes)) == a.tobytes()
        assert bytes(reader.copy(refs[1], b.nbytes)) == b.tobytes()
        assert reader.copy(refs[2], 0) == bytearray()
        # another reply after it: both readable, each under its own stamp
        c = np.full(3000, 7, np.uint16)
        rc = area.place([c])[0]
        assert rc[2] == refs[0][2] + 1 and rc[1] > refs[1][1]
        assert bytes(reader.copy(rc, c.nbytes)) == c.tobytes()
        assert bytes(reader.copy(refs[0], a.nbytes)) == a.tobytes()
        assert reader.copy([name, refs[0][1], refs[0][2] + 5], a.nbytes) is None   # no such
        assert area.stats["shm_replies"] == 2
    finally:
        reader.close()
        area.close()


def test_a_reply_written_over_reads_as_torn_even_when_new_bytes_look_like_its_stamp():
    """The area holds 64 KiB: later replies take the first one's granules. Their bytes are
    the first one's stamp word, over and over: stamps live apart from the data, so nothing a
    reply holds passes for a stamp."""
    area = shm.ReplyArea(CLUSTER, cap=64 << 10, first=64 << 10)
    reader = shm.Mapper()
    try:
        first = np.arange(4096, dtype=np.uint8)
        r1 = area.place([first])[0]
        fake = np.full((60 << 10) // 8, r1[2], np.uint64)     # all 8-byte words == its stamp
        area.place([fake])
        assert bytes(reader.copy(r1, first.nbytes)) == first.tobytes()    # not reached yet
        r3 = area.place([np.full(8192, r1[2], np.uint64)])[0]   # no room at the end: wraps
        assert r3[1] == r1[1]
        assert reader.copy(r1, first.nbytes) is None
        assert np.array_equal(np.frombuffer(reader.copy(r3, 8192 * 8), np.uint64),
                              np.full(8192, r1[2], np.uint64))
    finally:
        reader.close()
        area.close()


def test_a_reply_area_grows_up_to_its_cap_then_sends_frames(shm_dir):
    area = shm.ReplyArea(CLUSTER, cap=1 << 20, first=64 << 10)
    reader = shm.Mapper()
    try:
        small = area.place([np.ones(1000, np.float32)])[0]
        assert shm.segments(CLUSTER) == [small[0]]
        big = np.arange(100_000, dtype=np.float32)        # 400 KB: past the first 64 KiB
        rb = area.place([big])[0]
        assert rb[0] != small[0] and shm.segments(CLUSTER) == [rb[0]]   # the old one removed
        assert bytes(reader.copy(rb, big.nbytes)) == big.tobytes()
        with pytest.raises(WireError):       # never mapped here, and gone: unreadable
            reader.copy(small, 4000)
        assert not wire.resolve_refs([{"n": 4000, "r": small}], [b""], reader, bytes)  # torn
        assert area.place([np.zeros(2 << 20, np.uint8)]) is None          # above the cap
        assert area.stats["shm_replies_full"] == 1
        assert area.place([big])[0][0] == rb[0]                  # still the same segment
        assert area.size <= (1 << 20) + (64 << 10)
    finally:
        reader.close()
        area.close()
    assert gradbus_segments(shm_dir) == []


AREA_WRITER = """
import json, select, sys
import numpy as np
from gradbus.codecs import shm
n = int(sys.argv[2])
area = shm.ReplyArea(sys.argv[1], cap=1 << 20, first=1 << 20)
def reply():       # every byte of a reply is its stamp mod 251
    return area.place([np.full(n, (area.stamp + 1) % 251, np.uint8)])[0]
print(json.dumps([reply() for _ in range(3)]), flush=True)
i = 0
while True:
    i += 1
    if i % 8 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
    reply()
area.close()
"""


def test_reply_area_reads_against_a_writer_process_are_never_torn():
    """A writer process places replies of a third of its area as fast as it can, each
    constant-valued (its stamp mod 251), over the oldest; the reader copies the three slots
    under whatever stamp each holds now. A copy returned is always the whole reply its stamp
    names; raw reads without the checks do see mixed replies, so the race is real."""
    n = 300 << 10
    proc = spawn_code(AREA_WRITER, CLUSTER, n)
    reader = shm.Mapper()
    try:
        refs = json.loads(proc.stdout.readline())
        seg = reader.segment(refs[0][0])
        whole = torn = raw_mixed = 0
        deadline = time.monotonic() + 30
        while (whole < 200 or torn < 1 or raw_mixed < 1) and time.monotonic() < deadline:
            for name, off, _ in refs:
                g = (off - seg.data) >> seg.shift
                stamp = int(seg.stamps[g])
                if stamp in (0, (1 << 64) - 1):
                    continue
                got = reader.copy([name, off, stamp], n)
                if got is None:
                    torn += 1
                else:
                    v = np.frombuffer(got, np.uint8)
                    assert v.min() == v.max() == stamp % 251, (stamp, v.min(), v.max())
                    whole += 1
                raw = np.frombuffer(bytes(seg.view[off:off + n]), np.uint8)
                raw_mixed += int(raw.min() != raw.max())
        assert whole >= 200 and torn >= 1, (whole, torn)
        assert raw_mixed >= 1, "the writer never overlapped a read: the test proved nothing"
    finally:
        reader.close()
        assert end_code(proc) == 0


# ----------------------------------------------------------------------------- the broker's copy
def test_the_broker_copies_a_reply_out_for_a_receiver_without_shm_or_answers_torn():
    core = BrokerCore(4)
    io = ShmIO(core, "127.0.0.1:1", True)
    area = shm.ReplyArea(io.cluster, cap=64 << 10, first=64 << 10)
    try:
        assert io.probe is not None
        a = np.arange(2048, dtype=np.float32)
        d, buf = wire.encode_tensor("w/0", a, "raw", 3, hashed=False)
        d["r"] = area.place([buf])[0]
        reply = [wire.pack(wire.SNAPSHOT_REPLY, [d], req=9, parts=[[0, 4]], missing=[]), b""]
        out = io.inline_reply(reply)
        h = msgpack.unpackb(out[0])
        assert "r" not in h["t"][0] and h["t"][0]["x"] == wire.checksum(a.tobytes())
        desc = wire.parse_desc(h["t"][0])
        assert np.array_equal(wire.decode_tensor(desc, out[1]), a)   # checksum verified
        area.place([np.zeros(60 << 10, np.uint8)])     # two replies later the slot is
        area.place([np.zeros(60 << 10, np.uint8)])     # someone else's
        assert io.inline_reply(reply) is None
        assert core.meters.counters["shm_replies_inlined"] == 1
        assert core.meters.counters["shm_torn_inline"] == 1
    finally:
        area.close()
        io.close()


# ----------------------------------------------------------------------------- through processes
def _w0(n: int, dtype="float32") -> np.ndarray:
    return (np.arange(n) % 97).astype(dtype)


def _counters(url: str) -> dict:
    return admin.status(url)["counters"]


def _shard_info(url: str, sid: str) -> dict:
    return next(s["info"] or {} for s in admin.status(url)["shards"] if s["id"] == sid)


def _reply_segments(pid: int) -> list[str]:
    """The reply areas' segments of shard process ``pid``."""
    out = []
    for name in shm.segments():
        o = shm.owned(name)
        if o[1] == "s" and o[2] == pid:
            with open(os.path.join(shm.directory(), name), "rb") as f:
                if f.read(40)[32:40] == shm.REPLY_MARK:
                    out.append(name)
    return out


W_N, ROWS = 20_000, np.array([3, 17, 17, 123_456, 9], np.int64)


def _model(c, n: int) -> tuple[dict, np.ndarray]:
    """Init a tensor pair and a table, push ``n`` times; the exact values expected."""
    w0 = {"w": _w0(W_N), "v": _w0(3000, "float64").reshape(60, 50)}
    c.init(w0, optimizer=gradbus.SGD(lr=LR))
    c.init_table("emb", 8, gradbus.Zeros(), gradbus.SGD(lr=LR))
    grads = {k: np.full(v.shape, G, v.dtype) for k, v in w0.items()}
    rg = np.full((len(ROWS), 8), G, np.float32)
    for _ in range(n):
        assert c.push(grads).result(30)["kind"] == "ack"
        c.push_rows("emb", ROWS, rg).result(30)
    counts = {int(i): int((ROWS == i).sum()) for i in ROWS}
    rows = np.array([np.full(8, -LR * G * n * counts[int(i)], np.float32) for i in ROWS])
    return {k: v - n * LR * G for k, v in w0.items()}, rows


def _reads_exact(url: str, expect: dict, rows: np.ndarray, shm_on: bool) -> dict:
    """A fresh client's snapshot and rows read, bit-exact; its counters."""
    with gradbus.connect(url, block_bytes=4096, shm=shm_on) as d:
        assert (d.shm is not None) == shm_on
        got = d.pull(list(expect), timeout=30)
        for k, v in expect.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
        r = d.pull_rows("emb", ROWS, timeout=30)
        assert r.dtype == np.float32 and np.array_equal(r, rows)
        return dict(d.stats)


def test_reads_and_a_catch_up_go_through_the_primarys_reply_area(make_cluster, shm_dir):
    cluster = make_cluster(1, replicas=2, broker_args=FAST_HB, shard_args=FAST_HB)
    n = 6
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        assert c.shm is not None
        tag = c.shm.cluster
        expect, rows = _model(c, n)
    pid0 = cluster.shard_procs["shard-0"].pid
    stats = _reads_exact(cluster.url, expect, rows, True)
    # snapshots and rows came as refs into shard-0's reply area, copied out by the client
    assert stats["shm_replies"] >= 2 and stats.get("shm_torn_replies", 0) == 0
    assert len(_reply_segments(pid0)) == 1
    wait_for(lambda: _shard_info(cluster.url, "shard-0").get("shm_replies", 0) >= 2, 10,
             "shard-0 to count its replies")
    # a client without shared memory: the same values, as frames from the shard (the broker
    # copies nothing: the shard was not asked for refs)
    before = _shard_info(cluster.url, "shard-0")["shm_replies"]
    stats = _reads_exact(cluster.url, expect, rows, False)
    assert stats.get("shm_replies", 0) == 0
    assert _counters(cluster.url).get("shm_replies_inlined", 0) == 0
    # a second shard catches up on every partition through shard-0's reply area
    cluster.add_shard("shard-1")
    cluster.wait_ready(2)
    assert replicas_agree(cluster.url) > 0
    cnt = _counters(cluster.url)
    assert cnt["shm_states"] >= 1 and cnt.get("shm_states_torn", 0) == 0
    assert cnt["standbys_synced"] >= 1
    wait_for(lambda: _shard_info(cluster.url, "shard-0").get("shm_replies", 0) > before, 10,
             "shard-0 to count its states")
    # the standby installed them exactly: with shard-0 SIGKILLed it serves the same values
    cluster.kill_shard("shard-0", signal.SIGKILL)
    wait_for(lambda: "shard-0" not in admin.partitions(cluster.url, timeout=1.0)["owners"], 20,
             "shard-1 to take over")
    _reads_exact(cluster.url, expect, rows, True)
    # the broker's sweep removes the dead shard's board and reply area
    wait_for(lambda: not any(shm.owned(s)[2] == pid0 for s in shm.segments(tag)), 20,
             "the dead shard's segments swept")
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_reply_with_refs_for_a_client_without_shm_is_copied_out_by_the_broker(make_cluster,
                                                                                shm_dir):
    """A raw client asks for a snapshot saying it reads shared memory, then (before the slow
    shard answers) says it does not: the broker copies the reply's bytes out of the shard's
    reply area into frames."""
    cluster = make_cluster(1, shard_args=["--fault-apply-delay", "0.3"])
    w0 = _w0(3000)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(cluster.url)
        sock.send(wire.pack(wire.SNAPSHOT, req=1, keys=["w/0", "w/2"], shm=True))
        sock.send(wire.pack(wire.HEARTBEAT, shm=False))
        assert sock.poll(30_000)
        frames = sock.recv_multipart()
        h = msgpack.unpackb(frames[0])
        assert h["kind"] == wire.SNAPSHOT_REPLY and h["req"] == 1 and len(frames) == 3
        got = {}
        for d, fr in zip(h["t"], frames[1:]):
            assert "r" not in d and len(fr) == d["n"] > 0
            got[d["k"]] = wire.decode_tensor(wire.parse_desc(d), fr)     # checksums verified
        assert np.array_equal(got["w/0"], w0[:1024]) and np.array_equal(got["w/2"], w0[2048:])
        assert _counters(cluster.url)["shm_replies_inlined"] == 1
    finally:
        sock.close()
        ctx.term()
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


WIPER = """
import mmap, os, select, struct, sys
import numpy as np
from gradbus.codecs import shm
fd = os.open(os.path.join(shm.directory(), sys.argv[1]), os.O_RDWR)
mm = mmap.mmap(fd, os.fstat(fd).st_size)
os.close(fd)
shift, count, data = struct.unpack_from("<QQQ", mm, 40)
stamps = np.frombuffer(mm, np.uint64, count, shm.HEADER)
print("wiping", flush=True)
i = 0
while True:       # every stamp 0, which no reply has: every read of the area is torn
    stamps[:] = 0
    i += 1
    if i % 64 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
del stamps
mm.close()
"""


def test_torn_replies_are_asked_again_and_come_out_exact(make_cluster, shm_dir):
    """A process keeps wiping the stamps of shard-0's reply area: every snapshot and rows read
    that went through it reads as torn, is asked again with frames, and the values come out
    exact. Then the area's segment is removed under it (a reader that has not mapped it cannot
    read it whole, ever): the standby catching up installs nothing torn, and the state it is
    sent again as frames is exact."""
    cluster = make_cluster(1, replicas=2, broker_args=FAST_HB, shard_args=FAST_HB)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        expect, rows = _model(c, 4)
    stats = _reads_exact(cluster.url, expect, rows, True)     # makes the area
    assert stats["shm_replies"] >= 2
    pid0 = cluster.shard_procs["shard-0"].pid
    (seg,) = _reply_segments(pid0)
    wiper = spawn_code(WIPER, seg)
    try:
        assert wiper.stdout.readline().strip() == "wiping"
        torn = 0
        for _ in range(20):    # the wiper shares the cores: a read may slip between wipes
            torn += _reads_exact(cluster.url, expect, rows, True).get("shm_torn_replies", 0)
            if torn >= 2:
                break
        assert torn >= 2
    finally:
        assert end_code(wiper) == 0
    os.unlink(os.path.join(shm_dir, seg))     # shard-0 still writes there; nobody new can read
    cluster.add_shard("shard-1")
    cluster.wait_ready(2)
    assert replicas_agree(cluster.url) > 0
    st = admin.status(cluster.url)
    assert st["counters"]["shm_states_torn"] >= 1
    assert st["errors"]["shard_SHM_TORN"] == st["counters"]["shm_states_torn"]
    wait_for(lambda: _shard_info(cluster.url, "shard-1").get("shm_states_torn", 0) >= 1, 10,
             "the standby to count its torn states")
    # the standby's copy is exact: it serves the same values once shard-0 is gone
    cluster.kill_shard("shard-0", signal.SIGKILL)
    wait_for(lambda: "shard-0" not in admin.partitions(cluster.url, timeout=1.0)["owners"], 20,
             "shard-1 to take over")
    _reads_exact(cluster.url, expect, rows, True)
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_reply_area_capped_at_nothing_keeps_replies_as_frames(make_cluster, monkeypatch,
                                                                 shm_dir):
    monkeypatch.setenv("GRADBUS_SHM_REPLY_MB", "0")     # the area's cap: none at all
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        expect, rows = _model(c, 2)
    stats = _reads_exact(cluster.url, expect, rows, True)
    assert stats.get("shm_replies", 0) == 0
    assert _reply_segments(cluster.shard_procs["shard-0"].pid) == []
    cluster.stop()
    assert gradbus_segments(shm_dir) == []
