"""A broker pair, with real processes (protocol section 23): the standby takes over when the
active broker is killed or frozen, nothing acknowledged is lost, nothing is applied twice,
and a broker that comes back, or wakes, is the standby. Counts and order only; how fast a
take-over is, is bench/broker_pair.py's to measure."""
from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.codecs.errors import Code, GradbusError

from .rigs import replicas_agree, wait_for

LR = 2.0 ** -4
N = 1 << 12
pytestmark = pytest.mark.timeout(240)


def roles(cluster) -> dict:
    """Each broker's role and epoch, as it says (None: it does not answer)."""
    out = {}
    for name in cluster.broker_names:
        try:
            p = admin.status(cluster.broker_url(name), timeout=1.0,
                             curve=cluster.curve)["pair"]
            out[name] = (p["role"], p["epoch"])
        except GradbusError:
            out[name] = None
    return out


def active(cluster) -> str:
    got: list = []

    def one():
        got[:] = [n for n, r in roles(cluster).items() if r and r[0] == "active"]
        return len(got) == 1
    wait_for(one, 30, "one active broker")
    return got[0]


class Workers:
    """``n`` clients of the pair pushing ``pushes`` ones each with acks="all", in threads;
    ``reached`` is set once ``at`` pushes were acknowledged in all."""

    def __init__(self, url: str, n: int, pushes: int, at: int):
        self.url, self.pushes, self.at = url, pushes, at
        self.acked = 0
        self.lock = threading.Lock()
        self.reached = threading.Event()
        self.errors: list = []
        self.stats: list = []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def run(self):
        try:
            with gradbus.connect(self.url, timeout=60) as c:
                g = np.ones(N, np.float32)
                for _ in range(self.pushes):
                    c.push({"w": g}, acks="all").result(60)
                    with self.lock:
                        self.acked += 1
                        if self.acked >= self.at:
                            self.reached.set()
                self.stats.append(dict(c.stats))
        except BaseException as e:      # reported by the test's thread
            self.errors.append(e)
            self.reached.set()

    def join(self):
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), "workers still pushing"
        assert not self.errors, self.errors


def known_answer(cluster, total: int) -> None:
    with gradbus.connect(cluster.url, timeout=60) as c:
        w = c.pull(["w"], min_version=total, timeout=60)["w"]
        assert c.version("w") == total
    assert np.array_equal(w, np.full(N, -LR * total, np.float32))


def start(make_cluster):
    cluster = make_cluster(2, brokers=2, replicas=2)
    first = active(cluster)
    with gradbus.connect(cluster.url, timeout=60) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
    return cluster, first


def test_a_killed_active_broker_hands_over_and_nothing_is_lost_or_applied_twice(make_cluster):
    cluster, first = start(make_cluster)
    other = next(n for n in cluster.broker_names if n != first)
    assert roles(cluster)[other][0] == "standby"
    work = Workers(cluster.url, 2, 40, at=20)
    assert work.reached.wait(120)
    cluster.broker_procs[first].kill()
    work.join()
    assert sum(s["pushes_acked"] for s in work.stats) == 80
    assert all(s["broker_switches"] >= 1 for s in work.stats), work.stats
    known_answer(cluster, 80)
    assert roles(cluster)[other] == ("active", 2)
    st = admin.status(cluster.url)
    assert st["pair"]["takeovers"] == 1
    assert [b["role"] for b in st["brokers"]].count("active") == 1
    replicas_agree(cluster.url)

    # the killed broker comes back as the standby; killing the active hands back to it
    cluster.broker_procs[first].wait(10)
    cluster.start_broker(first)
    wait_for(lambda: roles(cluster)[first] == ("standby", 2), 30, "the standby back")
    work = Workers(cluster.url, 2, 20, at=10)
    assert work.reached.wait(120)
    cluster.broker_procs[other].kill()
    work.join()
    known_answer(cluster, 120)
    assert roles(cluster)[first] == ("active", 3)
    replicas_agree(cluster.url)


def test_a_frozen_active_broker_is_deposed_when_it_wakes(make_cluster):
    """A broker that stops answering without dying (SIGSTOP: a hung process, a cut-off host)
    is left by the shards and the clients; the standby takes over, and when the old one wakes
    it learns the newer epoch and serves nobody."""
    cluster, first = start(make_cluster)
    other = next(n for n in cluster.broker_names if n != first)
    proc = cluster.broker_procs[first]
    work = Workers(cluster.url, 2, 30, at=10)
    try:
        assert work.reached.wait(120)
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: roles(cluster)[other] == ("active", 2), 60, "a take-over")
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_for(lambda: roles(cluster)[first] == ("standby", 2), 30, "the old active deposed")
    work.join()
    known_answer(cluster, 60)
    # the woken broker accepts nothing: a client naming it alone is told so
    with pytest.raises(GradbusError) as e:
        gradbus.connect(cluster.broker_url(first), timeout=10)
    assert e.value.code == Code.NOT_ACTIVE
    assert admin.status(cluster.url)["pair"]["takeovers"] == 1
    replicas_agree(cluster.url)


def test_a_pair_with_curve_on_hands_over_too(make_cluster, tmp_path):
    """Both brokers hold one key pair; the pair link admits that key alone. A CURVE client
    (whose socket's one monitor is its handshake watch) still moves at once."""
    cluster = make_cluster(1, brokers=2, curve_dir=str(tmp_path / "keys"))
    first = active(cluster)
    with gradbus.connect(cluster.url, curve=cluster.curve, timeout=60) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
        g = np.ones(N, np.float32)
        for _ in range(10):
            c.push({"w": g}).result(30)
        cluster.broker_procs[first].kill()
        for _ in range(10):
            c.push({"w": g}).result(30)
        w = c.pull(["w"], min_version=20, timeout=30)["w"]
        assert c.url == cluster.broker_url(next(n for n in cluster.broker_names
                                                if n != first))
        assert c.stats["broker_switches"] == 1
    assert np.array_equal(w, np.full(N, -LR * 20, np.float32))


def test_a_take_over_whose_second_copy_came_back_stale_rebuilds_it_and_acts(make_cluster):
    """Two copies of every partition. One copy's shard is stopped, called dead and left
    behind while the pair's active broker goes on with the other copy and its peer's vote;
    then the active broker is killed and the stopped shard resumes. The new broker gets the
    current copy from one shard and a stale one from the other, which it drops: the
    partitions have one copy and no peer, short of their votes. It catches the stale shard
    up (no write is taken meanwhile), then has both copies' votes and serves: every push
    acknowledged before and after is applied once."""
    import os

    beat = ["--heartbeat-interval", "0.1", "--liveness", "5"]
    cluster = make_cluster(2, brokers=2, replicas=2, broker_args=beat, shard_args=beat)
    first = active(cluster)
    other = next(n for n in cluster.broker_names if n != first)
    with gradbus.connect(cluster.url, timeout=60) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
        c.push({"w": np.ones(N, np.float32)}, acks="all").result(60)
        lagging = cluster.shard_procs["shard-1"]
        os.kill(lagging.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: not next(s for s in admin.status(cluster.url)["shards"]
                                      if s["id"] == "shard-1")["alive"], 30,
                     "shard-1 called dead")
            for _ in range(5):       # applied on shard-0 alone (its vote and the peer's)
                c.push({"w": np.ones(N, np.float32)}, acks="all").result(60)
            cluster.broker_procs[first].kill()
        finally:
            os.kill(lagging.pid, signal.SIGCONT)
        try:
            c.push({"w": np.ones(N, np.float32)}, acks="all").result(90)   # served again
        except BaseException:
            st = admin.status(cluster.broker_url(other), timeout=5)
            print("STATUS", st["pair"], [(x["id"], x["alive"], x["partitions"], x.get("standby"))
                                         for x in st["shards"]], st["partitions_down"],
                  st["under_replicated"], st["counters"])
            for name, p in [*cluster.broker_procs.items(), *cluster.shard_procs.items()]:
                if p.stderr_tail is not None:
                    print(f"--- {name}:\n{p.stderr_tail.text(1.0)[-3000:]}")
            raise
    known_answer(cluster, 7)
    assert roles(cluster)[other][0] == "active"
    assert admin.status(cluster.url)["counters"]["voters_rebuilt"] >= 1
    replicas_agree(cluster.url)
