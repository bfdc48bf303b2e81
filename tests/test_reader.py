"""A caller waiting for its push reads the local link itself (workers/reader.py): the turn around
the agent's state, the link lent and taken back, timeouts, and through a real cluster every push
answered and applied once, with one thread or several waiting on one client."""
from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.workers import reader as reader_mod
from gradbus.workers.reader import LEND, LinkReader, ReadingFuture

from .rigs import run_in_threads, wait_for

N = 1024


class FakeState:
    def __init__(self):
        self.stopped = False
        self.msg_futures: dict = {}
        self.req_futures: dict = {}


class FakeLink:
    """A socket pair's end; each byte that arrives answers the Future in ``answers``."""

    def __init__(self):
        self.sock, self.peer = socket.socketpair()
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.buffered = False

    def close(self):
        self.sock.close()
        self.peer.close()


class FakeAgent:
    """What :class:`LinkReader` needs of the agent: its link, its state, a caller's turn and a
    wake-up, with the turns and wake-ups counted."""

    def __init__(self, spin: float = 0.0):
        self.link = FakeLink()
        self.state = FakeState()
        self.reader = LinkReader(self, spin)
        self.answers: dict[int, Future] = {}
        self.turns = []          # (thread id, whether it held the turn) per caller's turn
        self.wakes = 0
        self.closed = False

    def read_for_caller(self, lnk) -> bool:
        self.turns.append((threading.get_ident(), self.reader.owner == threading.get_ident()))
        if self.closed:
            return False
        try:
            got = lnk.sock.recv(64)
        except BlockingIOError:
            return True
        for b in got:
            fut = self.answers.pop(b, None)
            if fut is not None:
                self.state.msg_futures.pop(b, None)
                fut.set_result({"msg": b})
        return True

    def wake(self):
        self.wakes += 1

    def push(self, msg: int) -> ReadingFuture:
        fut = ReadingFuture(self.reader)
        self.answers[msg] = fut
        self.state.msg_futures[msg] = fut
        return fut

    def close(self):
        self.reader.close()
        self.link.close()


@pytest.fixture
def agent():
    a = FakeAgent()
    yield a
    a.close()


def test_the_waiting_caller_reads_its_answer_holding_the_turn(agent):
    fut = agent.push(7)
    threading.Timer(0.05, agent.link.peer.send, args=(bytes([7]),)).start()
    assert fut.result(10) == {"msg": 7}
    assert agent.turns and all(held for _, held in agent.turns)
    assert {t for t, _ in agent.turns} == {threading.get_ident()}
    assert agent.reader.readers == 0 and agent.reader.owner is None
    # nothing else was due: the link stays lent a while for the next caller, not for ever
    assert agent.wakes == 0 and 0 < agent.reader.lent_for() <= LEND
    wait_for(lambda: not agent.reader.lent, 5, "the link to be taken back")


def test_a_caller_leaving_while_other_answers_are_due_gives_the_link_back_at_once(agent):
    first, second = agent.push(1), agent.push(2)
    agent.link.peer.send(bytes([1]))
    assert first.result(10) == {"msg": 1}
    assert not second.done()
    assert agent.wakes == 1 and not agent.reader.lent    # the agent reads for the second


def test_a_callback_on_a_future_nobody_reads_for_takes_the_link_back(agent):
    first = agent.push(1)
    agent.link.peer.send(bytes([1]))
    assert first.result(10) == {"msg": 1}
    assert agent.reader.lent and agent.wakes == 0       # lent a while for the next caller
    second = agent.push(2)
    second.add_done_callback(lambda f: None)
    assert not agent.reader.lent and agent.wakes == 1   # the agent reads for the callback
    # a callback on a Future already resolved, or added while a caller reads, wakes nothing
    first.add_done_callback(lambda f: None)
    assert agent.wakes == 1


def test_an_unanswered_wait_times_out(agent):
    fut = agent.push(3)
    with pytest.raises(FutureTimeout):
        fut.result(0.05)
    with pytest.raises(FutureTimeout):
        fut.exception(0.05)
    assert agent.reader.readers == 0


def test_an_answer_read_by_the_agent_in_its_turn_ends_the_callers_wait(agent):
    fut = agent.push(4)
    agent.reader.take()          # the agent's turn: the caller waits for it, and finds the
    try:                         # answer there
        done = threading.Event()
        t = threading.Thread(target=lambda: (fut.result(10), done.set()))
        t.start()
        wait_for(lambda: agent.reader.readers == 1, 5, "the caller to wait")
        fut.set_result({"msg": 4})
    finally:
        agent.reader.give()
    t.join(10)
    assert done.is_set() and agent.turns == []     # it never read


def test_a_closed_link_sends_the_caller_back_to_the_future(agent):
    fut = agent.push(5)
    agent.closed = True
    threading.Timer(0.05, fut.set_result, args=({"msg": 5},)).start()
    assert fut.result(10) == {"msg": 5}
    assert len(agent.turns) == 1


def test_a_wait_from_inside_the_turn_does_not_read(agent):
    fut = agent.push(6)
    agent.reader.take()
    try:
        with pytest.raises(FutureTimeout):
            fut.result(0.02)           # a done-callback in a turn: no second turn inside it
    finally:
        agent.reader.give()
    assert agent.turns == [] and agent.reader.readers == 0


def test_a_spinning_caller_reads_without_sleeping():
    agent = FakeAgent(spin=10.0)
    try:
        fut = agent.push(9)
        threading.Timer(0.05, agent.link.peer.send, args=(bytes([9]),)).start()
        assert fut.result(10) == {"msg": 9}
        assert len(agent.turns) > 5       # polled again and again, not once per 5 ms
    finally:
        agent.close()


def test_bad_spins_are_refused():
    with pytest.raises(ValueError):
        LinkReader(None, -1.0)
    for bad in (-1, 1.5, 10**6, "5"):
        with pytest.raises(ValueError, match="spin_us"):
            gradbus.Client("tcp://127.0.0.1:1", spin_us=bad, timeout=0.1)


# -- through a cluster -----------------------------------------------------------------------
def _expect(c, n, ver):
    w = c.pull(["w"], min_version=ver, timeout=30)["w"]
    assert np.array_equal(w, np.full(N, -float(n), np.float32))


@pytest.mark.parametrize("spin_us", [0, 200])
def test_pushes_waited_on_one_at_a_time_are_read_by_their_callers(make_cluster, spin_us):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, spin_us=spin_us) as c:
        assert c.agent.link is not None
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        msgs = set()
        for _ in range(300):
            ack = c.push({"w": np.ones(N, np.float32)}).result(30)
            msgs.add(ack["msg"])
        _expect(c, 300, ack["ver"])
        assert len(msgs) == 300
        assert c.stats["link_reads_by_callers"] >= 150     # most answers: the caller's
        assert c.stats["resends"] == 0
    assert admin.status(cluster.url)["counters"]["pushes_applied"] == 300


def test_answers_nobody_waits_on_still_settle(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.ones(N, np.float32)}).result(30)     # the link lent to a caller
        called = []
        futs = [c.push({"w": np.ones(N, np.float32)}) for _ in range(20)]
        for f in futs:
            f.add_done_callback(lambda f: called.append(f.result()["msg"]))
        wait_for(lambda: len(called) == 20, 30, "every callback")   # no result() called
        assert sorted(called) == sorted(f.result(0)["msg"] for f in futs)
        _expect(c, 21, max(f.result(0)["ver"] for f in futs))


def test_a_callback_after_a_waited_push_runs_when_its_answer_comes(make_cluster, monkeypatch):
    """The link lent for a minute after a caller leaves, and the agent looking only every
    minute meanwhile: a Future with only a callback, pushed right after a waited one, is
    still resolved at once (its callback takes the link back to the agent)."""
    monkeypatch.setattr(reader_mod, "LEND", 60.0)
    monkeypatch.setattr(reader_mod, "AGENT_TICK", 60.0)
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        for n in range(1, 6):
            c.push({"w": np.ones(N, np.float32)}).result(30)      # the link lent to a caller
            called = threading.Event()
            c.push({"w": np.ones(N, np.float32)}).add_done_callback(lambda f, e=called: e.set())
            assert called.wait(20), f"the callback of push {2 * n} did not run"
        _expect(c, 10, c.push({"w": np.zeros(N, np.float32)}).result(30)["ver"])


def test_threads_waiting_on_one_client_each_get_their_own_answers(make_cluster):
    cluster = make_cluster(1)
    threads, per = 4, 60
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        got: list = [[] for _ in range(threads)]

        def run(i):
            for _ in range(per):
                ack = c.push({"w": np.ones(N, np.float32)}).result(30)
                got[i].append((ack["msg"], ack["ver"]))

        errors = run_in_threads(run, threads)
        assert not errors, errors
        assert all(len(g) == per for g in got)
        msgs = [m for g in got for m, _ in g]
        assert len(set(msgs)) == threads * per
        _expect(c, threads * per, max(v for g in got for _, v in g))
    assert admin.status(cluster.url)["counters"]["pushes_applied"] == threads * per
