"""Conflated delivery's credits granted again (workers/follow_state.py): a credit unanswered
while heartbeats name newer seqs is granted again, after as many heartbeats as answers take
(RFC 6298's estimator in heartbeats, Karn's rule, doubling per grant again); driven without a
socket or a clock."""
from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest

from gradbus.codecs import wire
from gradbus.workers import follow_state
from gradbus.workers.actions import Send
from gradbus.workers.follow_state import AGAIN_BEATS, AGAIN_MAX_BEATS, FollowState


class Agent:
    """What FollowState reads of its agent: a conflated cache's partitions, the output and the
    counters."""

    def __init__(self, parts=(0, 1)):
        self.cache = SimpleNamespace(conflated=True, parts={
            p: SimpleNamespace(last_seq=10, resync=False, live=False) for p in parts},
            newly_live=[])
        self.out: list = []
        self.stats: collections.Counter = collections.Counter()
        self.shm = None

    def credits_sent(self) -> list[dict]:
        got = [wire.unpack_header(a.frames[0], frozenset({wire.CREDIT, wire.FOLLOW}))
               for a in self.out if isinstance(a, Send)]
        self.out.clear()
        return [h for h in got if h["kind"] == wire.CREDIT]


def _follows(parts=(0, 1)) -> tuple[FollowState, Agent]:
    a = Agent(parts)
    f = FollowState(a)
    f.track(list(parts))
    a.out.clear()
    return f, a


def _beats_until_again(f: FollowState, a: Agent, p: int = 0, limit: int = 1000) -> int:
    """Heartbeats naming a newer seq of ``p`` until its credit is granted again."""
    for n in range(1, limit + 1):
        f.heartbeat([p], [a.cache.parts[p].last_seq + 1])
        f.validate_state()
        sent = a.credits_sent()
        if sent:
            assert sent == [{**sent[0], "ps": [p], "again": True}]
            return n
    raise AssertionError(f"no credit granted again in {limit} heartbeats")


def _read(f: FollowState, a: Agent, p: int = 0) -> None:
    f.read([p], [a.cache.parts[p].last_seq], False)
    assert [h["ps"] for h in a.credits_sent()] == [[p]]


def test_an_answer_that_never_comes_is_asked_again_waiting_twice_as_long_each_time():
    f, a = _follows()
    _read(f, a)
    waits = [_beats_until_again(f, a) for _ in range(10)]
    assert waits[:4] == [AGAIN_BEATS, 2 * AGAIN_BEATS, 4 * AGAIN_BEATS, 8 * AGAIN_BEATS]
    assert max(waits) == AGAIN_MAX_BEATS == waits[-1]
    assert a.stats["credits_again"] == 10


def test_heartbeats_that_name_nothing_newer_do_not_count():
    f, a = _follows()
    _read(f, a)
    for _ in range(50):
        f.heartbeat([0], [a.cache.parts[0].last_seq])      # nothing newer published
        f.heartbeat([1], [99])                              # another partition's, no credit
    assert a.credits_sent() == []
    assert _beats_until_again(f, a) == AGAIN_BEATS


def test_answers_that_take_long_are_waited_for_once_sampled():
    """A slow link: every answer takes 20 heartbeats. The first credits back off (no sample
    while each is granted again), the next starts at the backed-off wait, and once one is
    answered without being granted again its time is the estimate: no more grants again."""
    f, a = _follows()
    agains = []
    for _ in range(6):
        _read(f, a)
        n = 0
        for _ in range(20):
            f.heartbeat([0], [a.cache.parts[0].last_seq + 1])
            n += len(a.credits_sent())
        f.validate_state()
        f.updated(0)                       # the answer comes, 20 heartbeats on
        agains.append(n)
    assert agains[0] >= 3 and sum(agains[2:]) == 0, agains
    assert f.rtt.srtt is not None and f.patience() > 20 and f.backed == 0
    f.validate_state()


def test_a_fast_answer_keeps_the_wait_short_and_a_restart_forgets_the_estimate():
    f, a = _follows()
    for _ in range(8):                       # answered at once: samples of 0 heartbeats
        _read(f, a)
        f.updated(0)
    assert f.patience() == AGAIN_BEATS
    _read(f, a)
    assert _beats_until_again(f, a) == AGAIN_BEATS     # a lost answer is asked again soon
    f.updated(0)                                          # answered after a grant again: no sample
    assert f.rtt.srtt == 0.0 and f.backed == 2 * AGAIN_BEATS
    f.broker_restarted()
    assert (f.rtt.srtt, f.backed, f.credits) == (None, 0, {})
    f.validate_state()


def test_a_broken_wait_is_named():
    f, a = _follows()
    _read(f, a)
    f.credits[0].beats = f.credits[0].wait     # a wait past its due, never granted again
    with pytest.raises(AssertionError):
        f.validate_state()


def test_a_partition_put_in_resync_drops_its_credit_the_snapshot_answers():
    f, a = _follows()
    _read(f, a)
    a.cache.parts[0].resync = True
    for _ in range(AGAIN_BEATS):
        f.heartbeat([0], [99])
    assert a.credits_sent() == [] and 0 not in f.credits


@pytest.mark.parametrize("beats", [0, 3, 40])
def test_the_estimate_follows_the_samples(beats):
    f, _ = _follows()
    for _ in range(30):
        f.credits[0] = follow_state._Credit(10, 1000)
        f.credits[0].beats = beats
        f.updated(0)
    assert f.rtt.srtt == pytest.approx(beats, abs=0.01)
    assert f.patience() == max(AGAIN_BEATS, min(follow_state.AGAIN_MAX_BEATS,
                                                beats + (1 if beats else 0)))
