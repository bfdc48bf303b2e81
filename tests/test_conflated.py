"""Conflated delivery end to end (protocol section 22): clients that read weights as frames
receive about the bytes they push, not every update of every worker, and still read exact,
fresh weights."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gradbus

from .rigs import run_in_threads

LR = 2.0 ** -4
N = 1 << 14          # 64 KiB of float32: one block


@pytest.mark.parametrize("block_bytes", [N * 4, N])
def test_workers_get_their_own_pushs_weights_not_every_update(make_cluster, block_bytes):
    """Three frames clients push 30 times each, acks=1, and pull the weights that include each
    push. Each receives about one update per own push (events would send it every worker's);
    the known answer is exact. With four blocks, in several partitions, a pull that finds some
    blocks new enough (their UPDATE came first) asks newer weights of the others only."""
    cluster = make_cluster(1, processes=False)
    W, pushes = 3, 30
    with gradbus.connect(cluster.url, shm=False, block_bytes=block_bytes) as c0:
        c0.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
    barrier = threading.Barrier(W)
    stats = [None] * W

    def worker(i):
        with gradbus.connect(cluster.url, shm=False) as c:
            c.pull(["w"], timeout=30)
            barrier.wait(30)
            g = np.ones(N, np.float32)
            for _ in range(pushes):
                ack = c.push({"w": g}).result(30)
                w = c.pull(["w"], min_version=ack["ver"], timeout=30)["w"]
                assert np.all(w <= -LR * ack["ver"] + 1e-6)
            stats[i] = dict(c.stats)

    errors = run_in_threads(worker, W)
    assert not errors, errors
    for s in stats:
        assert s["pushes_acked"] == pushes
        # about its own pushes' updates: 1.0 per push, plus the snapshot's and a few credited
        assert s["recv_bytes"] <= 1.2 * s["push_bytes"], s
    with gradbus.connect(cluster.url, shm=False) as c:
        w = c.pull(["w"], min_version=W * pushes, timeout=30)["w"]
        assert np.array_equal(w, np.full(N, -LR * W * pushes, np.float32))
    st = cluster.broker.core.delivery.counters
    assert st["updates_skipped"] > 0


def test_a_reader_that_never_pushes_gets_the_newest_weights_when_it_reads(make_cluster):
    """A frames client that only reads: each pull of weights it already holds grants a
    credit, and the newest value arrives; a wait for a version is answered."""
    cluster = make_cluster(1, processes=False)
    with gradbus.connect(cluster.url, shm=False) as pusher, \
            gradbus.connect(cluster.url, shm=False) as reader:
        pusher.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
        reader.pull(["w"], timeout=30)
        g = np.ones(N, np.float32)
        for _ in range(20):
            pusher.push({"w": g}).result(30)
        w = reader.pull(["w"], min_version=20, timeout=30)["w"]
        assert np.array_equal(w, np.full(N, -LR * 20, np.float32))
        got = reader.stats["updates_received"]
        assert got < 20, reader.stats          # skipped what it did not read
        pusher.push({"w": g}).result(30)
        w = reader.pull(["w"], min_version=21, timeout=30)["w"]
        assert np.array_equal(w, np.full(N, -LR * 21, np.float32))
