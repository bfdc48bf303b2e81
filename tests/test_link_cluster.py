"""Local links through a real cluster: the shards and a client on the broker's host talk to it
over links (codecs/link.py), pushes written on the link by the user's thread are answered, and a
link that dies mid-stream loses nothing and applies nothing twice."""
from __future__ import annotations

import collections
import socket

import numpy as np

import gradbus
from gradbus import admin

from .rigs import wait_for

N = 4096


def test_shards_and_clients_use_links_and_every_push_is_answered(make_cluster):
    cluster = make_cluster(2)
    with gradbus.connect(cluster.url, resend_after=60) as c:
        assert c.agent.link is not None
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        for _ in range(800):       # one at a time: each answer read right after the write
            ack = c.push({"w": np.ones(N, np.float32)}).result(30)
        w = c.pull(["w"], min_version=ack["ver"], timeout=30)["w"]
        assert np.array_equal(w, np.full(N, -800.0, np.float32))
        assert c.stats["resends"] == 0          # no answer was missed
    st = admin.status(cluster.url)
    assert st["counters"]["links_opened"] >= 3          # two shards and the client
    assert st["counters"]["pushes_applied"] == 800


def test_a_link_that_dies_loses_nothing_and_applies_nothing_twice(make_cluster):
    cluster = make_cluster(1)
    total = 400
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        lnk = c.agent.link
        assert lnk is not None
        futs = collections.deque()
        for k in range(total):
            futs.append(c.push({"w": np.ones(N, np.float32)}))
            if k == total // 2:
                lnk.sock.shutdown(socket.SHUT_RDWR)      # the link dies with pushes in flight
            if len(futs) >= 8:
                futs.popleft().result(30)
        for f in futs:
            f.result(30)
        wait_for(lambda: c.agent.link is None, 30, "the client to see its link closed")
        w = c.pull(["w"], min_version=total, timeout=30)["w"]
        assert np.array_equal(w, np.full(N, -float(total), np.float32))
    st = admin.status(cluster.url)
    assert st["counters"]["pushes_applied"] == total
