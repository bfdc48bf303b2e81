"""Per-hop stamps (codecs/hops.py): every process of a cluster stamps each push at each hop of
its round trip, in order, when ``$GRADBUS_HOPS`` names a directory."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gradbus
from gradbus.codecs import hops

PUSHES = 6
ROUND_TRIP = hops.HOPS[:hops.HOPS.index("resolved") + 1]   # the bench stamps pull_returned
IN_ORDER = [h for h in ROUND_TRIP if h not in hops.WAKES]


@pytest.fixture(autouse=True)
def own_file():
    hops.close()
    yield
    hops.close()


def test_stamps_round_trip_through_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADBUS_HOPS", str(tmp_path))
    hops.stamp("push", 7, t=100)
    hops.stamp("applied", [7, 8, "x"], t=200)
    hops.stamp("push", 7, t=300)                   # a later stamp of a hop does not count
    with open(tmp_path / "hops-1.bin", "wb") as f:  # another process's, with a torn record
        f.write(hops.RECORD.pack(8, 150, hops.HOPS.index("push")) + b"\x01\x02")
    assert hops.read(str(tmp_path)) == {7: {"push": 100, "applied": 200},
                                         8: {"push": 150, "applied": 200}}


def test_every_process_stamps_every_hop_in_order(make_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADBUS_HOPS", str(tmp_path))      # the cluster's processes inherit it
    monkeypatch.setattr(hops, "ON", True)                  # this process imported it unset
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(1000, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        msgs = [c.push({"w": np.ones(1000, np.float32)}).result(30)["msg"]
                for _ in range(PUSHES)]
    stamps = hops.read(str(tmp_path))
    for m in msgs:
        got = stamps[m]
        assert set(ROUND_TRIP) <= set(got), (m, sorted(got))
        times = [got[h] for h in IN_ORDER]
        assert times == sorted(times), (m, got)
        for wake in hops.WAKES:     # the receiver woke before it took the message in
            after = ROUND_TRIP[ROUND_TRIP.index(wake) + 1]
            assert got[wake] <= got[after], (m, wake, got)


def test_a_wake_stamps_the_time_its_thread_woke(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADBUS_HOPS", str(tmp_path))
    # a thread whose loop never woke stamps nothing (a fresh one: a client's caller waiting in
    # result() notes its wakes on the thread it runs on, this one in an earlier test)
    fresh = threading.Thread(target=hops.stamp_woke, args=("shard_wake", 5))
    fresh.start()
    fresh.join()
    assert hops.read(str(tmp_path)) == {}
    hops.woke()
    seen = {}

    def other():
        hops.woke()
        seen["other"] = hops._loop.woke

    t = threading.Thread(target=other)
    t.start()
    t.join()
    mine = hops._loop.woke
    hops.stamp_woke("shard_wake", [5, 6])
    assert hops.read(str(tmp_path)) == {5: {"shard_wake": mine}, 6: {"shard_wake": mine}}
    assert seen["other"] >= mine
