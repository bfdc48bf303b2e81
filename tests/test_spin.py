"""The broker's spin (``gradbus broker --spin-us``): after a turn with messages its loop polls
without sleeping for a while before it blocks. The poll helper's calls, the loop spinning only
after turns that had messages (an idle broker sleeps), every push applied once with it on, and
the operator's bad values refused."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from click.testing import CliRunner

import gradbus
from gradbus.broker import server as server_mod
from gradbus.broker.server import BrokerServer
from gradbus.cli import main
from gradbus.codecs import net
from gradbus.shards.server import ShardServer


class FakePoller:
    """Answers ``answers`` in turn (then nothing), recording each timeout asked for."""

    def __init__(self, answers=()):
        self.answers = list(answers)
        self.asked: list[float] = []

    def poll(self, timeout=None):
        self.asked.append(timeout)
        return self.answers.pop(0) if self.answers else []


def test_no_spin_is_one_blocking_poll():
    p = FakePoller()
    assert net.poll_spinning(p, 0.01, 0.0) == {}
    assert p.asked == [10.0]


def test_a_spin_polls_without_blocking_then_blocks_for_the_rest():
    p = FakePoller()
    assert net.poll_spinning(p, 0.05, 0.001) == {}
    *spun, last = p.asked
    assert spun and all(t == 0 for t in spun)
    assert last == pytest.approx(49.0)         # the timeout less the spin, in milliseconds


def test_the_spin_gives_the_core_away_between_two_empty_polls(monkeypatch):
    yields = []
    monkeypatch.setattr(net.os, "sched_yield", lambda: yields.append(1))
    p = FakePoller([[], [], [("sock", 1)]])
    assert net.poll_spinning(p, 0.05, 10.0) == {"sock": 1}
    assert len(yields) == 2                     # after each poll that found nothing
    yields.clear()
    assert net.poll_spinning(FakePoller(), 0.01, 0.0) == {}
    assert yields == []                         # no spin, no yield


def test_a_message_within_the_spin_is_returned_without_blocking():
    p = FakePoller([[], [], [("sock", 1)]])
    assert net.poll_spinning(p, 0.05, 10.0) == {"sock": 1}
    assert p.asked == [0, 0, 0]


def test_the_spin_never_outlasts_the_timeout():
    p = FakePoller()
    assert net.poll_spinning(p, 0.001, 10.0) == {}
    assert p.asked[-1] == 0                     # all of the timeout spent spinning
    p = FakePoller()
    net.poll_spinning(p, 0.0, 10.0)             # nothing to wait for: one poll, no spin
    assert p.asked == [0.0]


def test_pushes_through_a_spinning_broker_are_applied_once_and_it_sleeps_when_idle(
        monkeypatch):
    calls: list[tuple[float, bool]] = []        # (spin asked, whether messages came)
    real = net.poll_spinning

    def recording(poller, timeout, spin):
        got = real(poller, timeout, spin)
        calls.append((spin, bool(got)))
        return got
    monkeypatch.setattr(server_mod.net, "poll_spinning", recording)
    srv = BrokerServer("127.0.0.1", 0, spin=0.002)
    srv.add_shard(lambda connect: ShardServer(srv.url, "s0", ctx=srv.ctx, connect=connect))
    thread = srv.start_thread()
    try:
        with gradbus.connect(srv.url, timeout=30) as a, gradbus.connect(srv.url, timeout=30) as b:
            a.init({"w": np.zeros(64, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            b.pull(["w"])
            errors = []

            def work(c):
                try:
                    for _ in range(100):
                        ack = c.push({"w": np.ones(64, np.float32)}).result(30)
                        c.pull(["w"], min_version=ack["ver"], timeout=30)
                except Exception as e:      # noqa: BLE001 - reported below
                    errors.append(e)
            ts = [threading.Thread(target=work, args=(c,)) for c in (a, b)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            assert not errors and not any(t.is_alive() for t in ts)
            assert a.pull(["w"], min_version=200, timeout=30)["w"].tolist() == [-200.0] * 64
    finally:
        srv.stop()
        thread.join(30)
    assert not thread.is_alive()
    seen = list(calls)
    assert any(spin > 0 for spin, _ in seen)    # it spun while pushes came
    # a poll after one that brought nothing never spins: an idle broker sleeps
    assert all(spin == 0 for (_, got), (spin, _) in zip(seen, seen[1:]) if not got)
    assert all(spin == 0.002 for (_, got), (spin, _) in zip(seen, seen[1:]) if got)


def test_bad_spins_are_refused():
    with pytest.raises(ValueError, match="spin"):
        BrokerServer("127.0.0.1", 0, spin=-0.001)
    r = CliRunner().invoke(main, ["broker", "--spin-us", "-5"])
    assert r.exit_code == 2 and "--spin-us" in r.output
    r = CliRunner().invoke(main, ["broker", "--spin-us", "200000"])
    assert r.exit_code == 2 and "--spin-us" in r.output
