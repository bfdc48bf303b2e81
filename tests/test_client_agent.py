"""The client's agent: its socket-free state driven by a fake clock, and the few behaviours that
need a real broker (shutdown, the broker's heartbeat interval, answers to resends)."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import zmq

import gradbus
from gradbus.codecs import timing, wire
from gradbus.codecs.errors import Code, GradbusError
from gradbus.workers.actions import Send, Subscribe
from gradbus.workers.commands import ReadRows, Request, SendMessage, Stop, Track
from gradbus.workers.resend import ResendTimer

from .rigs import agent_feed as feed
from .rigs import agent_push as push
from .rigs import agent_resent as resent
from .rigs import make_agent_state as make_state
from .rigs import wait_for


# -- settling ----------------------------------------------------------------------------
def test_an_answer_to_a_resent_push_is_counted_once():
    state, _ = make_state(resend=ResendTimer(1.0, 8.0))
    _, fut = push(state, 7)
    _, _ = push(state, 8, acks=0)
    feed(state, wire.pack(wire.ACK, msg=7))
    feed(state, wire.pack(wire.ACK, msg=7))                   # the resend's answer
    feed(state, wire.pack(wire.ACK, msg=0, msgs=[8, 8, 7]))   # and a batch repeating both
    assert fut.done() and fut.result()["msg"] == 7
    assert state.stats["pushes_acked"] == 2
    assert state.stats["duplicate_answers"] == 2
    assert not state.credit.held and state.credit.bytes == 0 and not state.resend.unsettled


def test_an_error_for_a_push_already_settled_is_not_raised_again():
    state, _ = make_state()
    push(state, 3, acks=0)
    err = wire.pack(wire.ERROR, msg=3, code=Code.NOT_FINITE.value, message="nan")
    feed(state, err)
    feed(state, err)
    assert len(state.async_errors) == 1 and state.stats["push_errors"] == 1


# -- resending ---------------------------------------------------------------------------
def test_resends_back_off_exponentially_up_to_a_cap_and_reset_on_an_answer():
    state, clock = make_state(resend=ResendTimer(1.0, 8.0))
    t0 = clock.t
    frames, _ = push(state, 1)
    when = []
    for step in range(400):                  # 40 s in steps of 0.1 s
        clock.t = t0 + step / 10
        state.tick()
        state.validate_state()
        if resent(state.take(), frames):
            when.append(round(clock.t - t0, 1))
    assert when == [1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]   # +1, +2, +4, then +8 (the cap)
    assert state.stats["resends"] == 7
    # an answer (to another push) shows the broker answering: back to the first delay
    push(state, 2)
    feed(state, wire.pack(wire.ACK, msg=2))
    assert state.resend.delay == 1.0
    clock.t = t0 + 39.9
    state.tick()
    assert not resent(state.take(), frames)
    clock.t = t0 + 40.0
    state.tick()
    assert resent(state.take(), frames) == 1


def test_a_round_resends_only_what_waited_its_delay():
    state, clock = make_state(resend=ResendTimer(1.0, 8.0))
    t0 = clock.t
    old, _ = push(state, 1)
    clock.t = t0 + 0.6
    new, _ = push(state, 2)
    clock.t = t0 + 1.0
    state.tick()
    out = state.take()
    assert resent(out, old) == 1 and resent(out, new) == 0
    clock.t = t0 + 1.6                       # the delay doubled with the first round
    state.tick()
    assert resent(state.take(), new) == 0
    clock.t = t0 + 2.6
    state.tick()
    assert resent(state.take(), new) == 1


def test_recovering_is_retried_soon_whatever_the_backoff():
    state, clock = make_state(resend=ResendTimer(1.0, 8.0))
    t0 = clock.t
    frames, fut = push(state, 4)
    feed(state, wire.pack(wire.ERROR, msg=4, code=Code.RECOVERING.value, message="wait"))
    assert not fut.done() and state.stats["recovering_retries"] == 1
    clock.t = t0 + 0.2
    state.tick()
    assert resent(state.take(), frames) == 1
    state.validate_state()
    assert state.resend.delay == 1.0         # not a backoff round


def _event(state, topic: bytes, kind: str, **fields) -> list:
    state.heard()
    state.event([zmq.Frame(topic), zmq.Frame(wire.pack(kind, **fields))])
    state.validate_state()
    return state.take()


def _table(state) -> list:
    return _event(state, wire.TOPIC_TABLE, wire.TABLE, version=1, owners=["s0"] * 4,
                  down=[])


def test_a_restarted_broker_gets_every_unsettled_push_request_and_read_again_at_once():
    """The events name another run id than WELCOME did: what the old broker held is gone.
    Every unsettled push, the unanswered request and the read in flight (under a new id, for
    the same waiter) go again at once, once; no resend round is spent on them."""
    from gradbus.codecs.partition import TensorLayout
    state, clock = make_state(welcome={"partitions": 4, "run": 11},
                              resend=ResendTimer(5.0, 60.0))
    a, _ = push(state, 1)
    b, _ = push(state, 2)
    feed(state, wire.pack(wire.ACK, msg=2))
    cat = [wire.pack(wire.CATALOG, req=90)]
    state.command(Request(90, cat, Future()))
    read = Future()
    state.command(Track([TensorLayout("w", "float32", (6,), 2)], read))
    kinds = frozenset({wire.SNAPSHOT, wire.CATALOG, wire.FOLLOW})
    asked = [wire.unpack_header(x.frames[0], kinds) for x in state.take() if isinstance(x, Send)]
    assert [h["kind"] for h in asked] == [wire.CATALOG, wire.FOLLOW, wire.SNAPSHOT]
    clock.t += 1.0
    assert _event(state, wire.TOPIC_HEARTBEAT, wire.HEARTBEAT, run=11) == []   # the same one
    out = _event(state, wire.TOPIC_HEARTBEAT, wire.HEARTBEAT, run=12)
    assert resent(out, a) == 1 and resent(out, b) == 0 and resent(out, cat) == 1
    again = [wire.unpack_header(x.frames[0], kinds) for x in out
             if isinstance(x, Send) and x.frames is not a and x.frames is not cat]
    # the new broker is told first what this client follows (conflated delivery), then the
    # read in flight goes again
    assert [h["kind"] for h in again] == [wire.FOLLOW, wire.SNAPSHOT]
    assert again[0]["ps"] == sorted(asked[1]["ps"])
    snaps = again[1:]
    assert snaps[0]["keys"] == asked[2]["keys"]
    assert snaps[0]["req"] != asked[2]["req"] and state.req_futures[snaps[0]["req"]] is read
    assert state.stats["broker_restarts"] == 1 and state.stats["restart_resends"] == 1
    assert _event(state, wire.TOPIC_HEARTBEAT, wire.HEARTBEAT, run=12) == []
    clock.t += 4.9                         # the resend timer counts from the restart's send
    state.tick()
    assert not resent(state.take(), a) and state.stats["resends"] == 0


def test_a_broker_named_first_by_its_events_is_no_restart():
    state, _ = make_state(resend=ResendTimer(5.0, 60.0))        # a WELCOME without run
    a, _ = push(state, 1)
    assert _table(state) == [] and _event(state, wire.TOPIC_HEARTBEAT, wire.HEARTBEAT,
                                          run=5) == []
    assert state.broker_run == 5 and state.stats["broker_restarts"] == 0
    out = _event(state, wire.TOPIC_TABLE, wire.TABLE, version=1, owners=["s0"] * 4, down=[],
                 run=6)
    assert resent(out, a) == 1 and state.stats["broker_restarts"] == 1


def test_recovering_refusals_go_again_when_the_partition_table_changes():
    """A shard registering with a restarted broker (a TABLE event) is when what it refused
    RECOVERING may be served: sent again then, not after the fixed pause."""
    state, clock = make_state(resend=ResendTimer(5.0, 60.0))
    t0 = clock.t
    a, _ = push(state, 1)
    b, _ = push(state, 2)
    feed(state, wire.pack(wire.ERROR, msg=1, code=Code.RECOVERING.value, message="wait"))
    state.tick()
    assert state.take() == []
    clock.t = t0 + 0.05
    out = _table(state)
    assert resent(out, a) == 1 and resent(out, b) == 0
    assert state.stats["table_retries"] == 1
    clock.t = t0 + 0.3                       # past RECOVERING_RETRY: nothing left to retry
    state.tick()
    assert not resent(state.take(), a)
    assert _table(state) == []


class _Ring:
    """Stands in for the client's shared memory: which pushes' slots were freed."""

    def __init__(self):
        self.freed: list = []

    def free(self, msgs) -> int:
        self.freed += list(msgs)
        return len(msgs)


def test_a_push_refused_recovering_keeps_its_ring_slots_until_its_final_answer():
    """The broker frees a refused push's slots (FREE), but the client sends the push again,
    naming the same slots: they must still hold its bytes, so they are freed only once the
    push is answered for good."""
    state, _ = make_state(resend=ResendTimer(5.0, 60.0))
    state.shm = _Ring()
    push(state, 1)
    push(state, 2)
    feed(state, wire.pack(wire.ERROR, msg=1, code=Code.RECOVERING.value, message="wait"))
    feed(state, wire.pack(wire.FREE, msgs=[1]))
    feed(state, wire.pack(wire.ACK, msg=2))
    feed(state, wire.pack(wire.FREE, msgs=[2]))
    assert state.shm.freed == [2] and state.free_later == {1}
    out = _table(state)                                  # sent again, the slots untouched
    assert len(out) == 1 and state.shm.freed == [2]
    feed(state, wire.pack(wire.ACK, msg=1))
    assert state.shm.freed == [2, 1] and not state.free_later
    assert state.stats["shm_freed"] == 2


def test_no_resends_when_resending_is_off():
    state, clock = make_state(resend=None)
    frames, fut = push(state, 1)
    clock.t += 1000
    state.tick()
    assert not resent(state.take(), frames)
    feed(state, wire.pack(wire.ACK, msg=1))
    assert fut.done() and state.stats["pushes_acked"] == 1


# -- broker silence ----------------------------------------------------------------------
def test_silence_is_judged_by_the_interval_welcome_names():
    state, clock = make_state({"partitions": 4, "hb": 2.0})
    t0 = clock.t
    assert state.hb_interval == 2.0 and state.silence_after == 2.0 * timing.LIVENESS
    clock.t = t0 + 2.0 * timing.LIVENESS      # an idle client between slow heartbeats
    state.tick()
    assert not state.broker_silent and state.stats["broker_silences"] == 0
    clock.t += 0.01
    state.tick()
    assert state.broker_silent and state.stats["broker_silences"] == 1
    state.heard()
    state.tick()
    assert not state.broker_silent


@pytest.mark.parametrize("hb", [None, 0, -1.0, float("nan"), float("inf"), "2", True])
def test_a_welcome_without_a_usable_interval_means_the_default(hb):
    welcome = {"partitions": 4} if hb is None else {"partitions": 4, "hb": hb}
    state, clock = make_state(welcome)
    assert state.hb_interval == timing.HEARTBEAT_INTERVAL
    clock.t += timing.HEARTBEAT_INTERVAL * timing.LIVENESS + 0.01
    state.tick()
    assert state.broker_silent


def test_a_broker_beating_faster_is_not_held_to_a_tighter_window():
    state, clock = make_state({"partitions": 4, "hb": 0.1})
    assert state.hb_interval == 0.1
    clock.t += timing.HEARTBEAT_INTERVAL * timing.LIVENESS
    state.tick()
    assert not state.broker_silent


def test_the_clients_heartbeats_follow_the_clock():
    state, clock = make_state()
    hb = wire.pack(wire.HEARTBEAT)
    beats = 0
    for _ in range(10):
        clock.t += timing.HEARTBEAT_INTERVAL / 2
        state.tick()
        beats += sum(1 for a in state.take() if a.frames == [hb])
    assert beats == 5     # every HEARTBEAT_INTERVAL of the injected clock


# -- commands and shutdown ---------------------------------------------------------------
def test_track_follows_then_snapshots():
    """A client that reads weights as frames follows the partitions by conflated delivery:
    FOLLOW on its DEALER (no topic on the events socket), then the snapshot."""
    from gradbus.codecs.partition import TensorLayout, partition_of
    state, _ = make_state()
    fut = Future()
    state.command(Track([TensorLayout("w", "float32", (6,), 2)], fut))
    out = state.take()
    assert not [a for a in out if isinstance(a, Subscribe)]
    sent = [wire.unpack_header(a.frames[0], frozenset({wire.SNAPSHOT, wire.FOLLOW}))
            for a in out if isinstance(a, Send)]
    assert [h["kind"] for h in sent] == [wire.FOLLOW, wire.SNAPSHOT]
    assert sorted(sent[0]["ps"]) == sorted({partition_of(f"w/{i}", 4) for i in range(3)})
    assert sorted(sent[1]["keys"]) == ["w/0", "w/1", "w/2"]
    assert not fut.done() and sent[1]["req"] in state.req_futures
    state.validate_state()


def test_shutdown_fails_every_queued_and_waiting_future():
    state, _ = make_state()
    waiting = Future()
    state.command(ReadRows(1, [b""], waiting))       # sent, its replies not in yet
    queued = [SendMessage(2, [b""], Future()), Request(3, [b""], Future()),
              ReadRows(4, [b""], Future()), Track([], Future()), SendMessage(5, [b""], None),
              Stop()]
    err = GradbusError("the agent failed")
    state.fail_all(err, queued)
    futs = [waiting] + [c.future for c in queued if c.future is not None]
    assert len(futs) == 5 and all(f.exception(0) is err for f in futs)
    assert not state.req_futures and not state.msg_futures and not state.reads.row_parts
    state.validate_state()


# -- through a real broker ---------------------------------------------------------------
class Boom:
    """Not a command: the patched agent state fails on it."""
    future = None


def test_a_queued_rows_read_fails_with_the_agents_error_at_once(make_cluster):
    cluster = make_cluster(1)
    c = gradbus.connect(cluster.url)
    boom = RuntimeError("injected agent failure")
    real = c.state.command

    def command(cmd):
        if isinstance(cmd, Boom):
            raise boom
        real(cmd)
    c.state.command = command
    rows = ReadRows(1, [wire.pack(wire.ROWS, req=1, table="t", q=[])], Future())
    try:
        with c._lock:                # both queued before the agent drains either
            c.agent.submit(Boom())
            c.agent.submit(rows)
        assert rows.future.exception(timeout=10) is boom   # not its own 30 s timeout
        c.agent.join(10)
        assert not c.agent.is_alive() and c.agent.error is boom
    finally:
        c.close()


def test_an_idle_client_of_a_slow_heartbeat_broker_never_calls_it_silent(make_cluster):
    cluster = make_cluster(1, broker_args=["--heartbeat-interval", "2"],
                           shard_args=["--heartbeat-interval", "2"])
    with gradbus.connect(cluster.url) as c:
        assert c.state.hb_interval == 2.0
        # three heartbeats heard: two whole 2 s gaps, each past the default 1 s of liveness
        wait_for(lambda: c.stats["broker_heartbeats"] >= 3, 30, "three broker heartbeats")
        assert c.stats["broker_silences"] == 0 and c.broker_alive


def test_answers_to_resent_pushes_are_counted_once(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(4, np.float32)})
        sent = []
        real, noted = c.agent.submit, c.agent.note     # through the agent, or on the link
        c.agent.submit = lambda cmd: (sent.append(cmd), real(cmd))
        c.agent.note = lambda cmd: (sent.append(cmd), noted(cmd))
        for _ in range(5):
            c.push({"w": np.ones(4, np.float32)})
        c.flush()
        pushes = [cmd for cmd in sent if isinstance(cmd, SendMessage)]
        assert len(pushes) == 5 and c.stats["pushes_acked"] == 5
        with c._lock:    # each sent again, as the resend timer does: the broker answers again
            for cmd in pushes:
                real(SendMessage(cmd.msg, cmd.frames, None))
        wait_for(lambda: c.stats["duplicate_answers"] == 5, 10, "the resends' answers")
        assert c.stats["pushes_acked"] == c.stats["pushes"] == 5
        assert not c._credit_held



# -- pushes written on the local link by the user's thread ---------------------------------
def _drain_once(state, make_link) -> tuple:
    """An agent over ``state`` reads ``make_link(agent)`` once, as its loop does; the agent
    and the frames it sent on its DEALER."""
    import threading

    from gradbus.workers.agent import Agent

    ctx = zmq.Context()
    agent = Agent(ctx, b"c" * 16, state, threading.Lock())
    sent: list = []
    agent._send = sent.append
    try:
        agent._drain_link(make_link(agent), zmq.Poller())
    finally:
        agent.pipe_in.close(linger=0)
        agent.pipe_out.close(linger=0)
        ctx.term()
    return agent, sent


def test_an_answer_read_before_its_push_was_noted_still_finds_its_future():
    """A user's thread notes a push for the agent (without waking it), then writes it on the
    link itself; the answer can come back while the agent is still reading the link in the
    same pass, before it took the note from its queue. The agent takes queued notes before
    each answer it reads, so the Future is there to resolve."""


    from gradbus.workers.commands import SendMessage as Note

    state, _ = make_state()
    fut: Future = Future()

    class RacingLink:
        """Its first read is the moment the user's thread notes push 5 and writes it; the
        answer is then already there."""
        fd, closed, buffered, pending = -1, False, False, 0

        def __init__(self, agent):
            self.agent, self.reads = agent, 0

        def recv(self):
            self.reads += 1
            if self.reads == 1:
                state.credit.take(10, 1.0, lambda: 5, lambda: None, state.stats)
                self.agent.note(Note(5, [wire.pack(wire.PUSH, [], msg=5, acks=1)], fut,
                                     sent=True))
                return [wire.pack(wire.ACK, msg=5, ver=3)]
            return None

    _drain_once(state, RacingLink)
    assert fut.done() and fut.result() == {"kind": wire.ACK, "msg": 5, "ver": 3}
    assert not state.take()                      # noted as written: the agent sends nothing
    assert state.stats["duplicate_answers"] == 0 and not state.credit.held


def test_a_push_noted_just_before_the_link_closed_goes_again_on_the_dealer():
    """A user's thread notes a push and writes it on the link; the link closes (the broker
    died) before the agent took the note from its queue. The agent takes every queued note
    before it sends what the link carried unanswered again, so that push goes again at once,
    not only when a resend timer or a new broker's run id comes."""


    from gradbus.codecs import link
    from gradbus.workers.commands import SendMessage as Note

    state, _ = make_state(resend=ResendTimer(3600.0, 3600.0))
    fut: Future = Future()
    frames = [wire.pack(wire.PUSH, [], msg=5, acks=1)]

    class ClosingLink:
        """The user's thread notes push 5 and writes it; the broker's end then closes."""
        fd, closed, buffered, pending = -1, False, False, 0

        def __init__(self, agent):
            self.agent = agent

        def recv(self):
            state.credit.take(10, 1.0, lambda: 5, lambda: None, state.stats)
            self.agent.note(Note(5, frames, fut, sent=True))
            raise link.LinkClosed("the broker's end closed")

        def close(self):
            self.closed = True

    agent, sent = _drain_once(state, ClosingLink)
    assert state.stats["link_resends"] == 1
    assert sent == [frames]                      # again, on the DEALER, at once
    assert not agent.cmds and not fut.done()     # its answer is still awaited


def test_the_first_resend_delay_is_never_shorter_than_the_answers_take():
    """On a link slower than the window's bytes take at the base delay, answers come every
    7-9 s after their sends: the delay a settlement resets to follows them (smoothed plus 4 x
    variation), so a push queued behind the others is not sent again while on its way. A
    message sent again is timed from its first send (an estimate only ever too long); quick
    answers bring the delay back to the base."""
    t = ResendTimer(5.0, 60.0)
    frames = [b"x"]
    rounds = [(0.0, 8.0), (1.0, 8.0), (2.0, 11.0), (3.0, 11.0)]   # (sent, answered)
    for msg, (sent, _) in enumerate(rounds):
        t.sent(msg, frames, sent)
    for msg, (_, answered) in enumerate(rounds):
        t.settled(msg, answered)
    assert 8.0 < t.delay <= 60.0 and t.srtt is not None
    t.sent(10, frames, 20.0)
    assert t.due(20.0 + 7.5) == []              # the base 5 s would have sent it again
    assert t.due(20.0 + t.delay) == [frames]    # past the estimate it is
    before = t.srtt
    t.settled(10, 40.0)             # sent twice: timed from its first send, never shorter
    assert t.srtt > before
    for msg in range(20, 60):                   # answers in 10 ms bring it back down
        t.sent(msg, frames, float(msg))
        t.settled(msg, msg + 0.01)
    assert t.delay == 5.0
    t.validate_state()
