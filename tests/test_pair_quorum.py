"""The voters' rule of a broker pair without sockets (broker/quorum.py, protocol section 23):
a partition's copies and, when they are even, the peer broker; a broker acts only while every
partition it holds a counted copy of has a majority. Each case is a network cut, a dead shard
or a dead broker, judged from both sides."""
from __future__ import annotations

from gradbus.broker import quorum
from gradbus.broker.pair import ACTIVE, STANDBY, Pair

LEASE = quorum.lease(0.25, 4)


def lacking(replicas, shards, peer=False, now=10.0):
    """``shards``: (seconds since heard, partitions) of each shard registered here."""
    return quorum.lacking(now, replicas, LEASE, [(now - ago, True, ps) for ago, ps in shards],
                          peer)


def test_the_lease_ends_before_a_shard_can_leave_and_the_votes_needed_are_a_majority():
    assert LEASE == 0.5 and LEASE + 0.25 < 0.25 * 4          # heard skew of one interval
    assert quorum.lease(0.25, 1) == 0.25
    assert [quorum.needed(r) for r in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_two_copies_one_each_side_of_a_cut_neither_side_acts():
    a = lacking(2, [(0.0, {0, 1}), (0.6, {0, 1})], peer=False)   # shard-1 past its lease
    b = lacking(2, [(0.0, {0, 1})], peer=False)                  # b sees shard-1 only
    assert a == [0, 1] and b == [0, 1]


def test_two_copies_a_dead_shard_fails_over_while_the_peer_votes():
    assert lacking(2, [(0.0, {0, 1}), (0.9, {0, 1})], peer=True) == []
    assert lacking(2, [(0.0, {0, 1})], peer=True) == []


def test_two_copies_a_dead_active_broker_hands_over_once_both_shards_come():
    assert lacking(2, [(0.0, {0, 1})]) == [0, 1]          # the first shard alone: not yet
    assert lacking(2, [(0.0, {0, 1}), (0.0, {0, 1})]) == []


def test_three_copies_the_side_with_two_acts_the_other_does_not():
    assert lacking(3, [(0.0, {7}), (0.6, {7}), (0.6, {7})]) == [7]
    assert lacking(3, [(0.0, {7}), (0.0, {7})]) == []
    assert lacking(3, [(0.0, {7})], peer=True) == [7]     # odd copies: the peer has no vote


def test_a_partition_without_a_counted_copy_is_down_not_a_reason_to_stop():
    # one copy (replicas 1): its shard dead, the others' partitions go on
    assert lacking(1, [(0.0, {1}), (0.9, {2})]) == []
    assert quorum.lacking(10.0, 2, LEASE, [(10.0, False, {3}), (10.0, True, {4})], True) == []


def test_the_peer_votes_only_as_the_standby_naming_this_brokers_epoch():
    p = Pair(1, heartbeat_interval=0.25, liveness=4)
    assert not p.peer_votes(0.0)                          # a standby has no votes
    p.link(True)
    assert p.claim(0.0) == 1                              # active at epoch 1
    assert not p.peer_votes(0.0)                          # not heard yet
    p.peer(0.1, STANDBY, 0, 2)
    assert not p.peer_votes(0.1)                          # it has not heard epoch 1 yet
    p.peer(0.2, STANDBY, 1, 2)
    assert p.peer_votes(0.3) and not p.peer_votes(0.2 + 1.01)     # silent past liveness
    p.peer(1.5, STANDBY, 1, 2)
    p.link(False)
    assert not p.peer_votes(1.5)                          # its process went away
    q = Pair(1, heartbeat_interval=0.25, liveness=4)
    q.link(True)
    q.claim(0.0)
    q.peer(0.1, ACTIVE, 1, 0)                             # an active peer votes for nobody
    assert not q.peer_votes(0.1)


def test_the_peers_vote_counts_after_standing_unbroken_and_lapses_within_the_lease():
    """After a take-over or a healed cut the peer's vote waits ``vote_after`` (the shards that
    were away register meanwhile: one copy and the peer are not enough at once), and a beat
    missed past the lease (0.5 s, shorter than a shard's deadline) breaks it."""
    p = Pair(1, heartbeat_interval=0.25, liveness=4)
    p.vote_after = 6.0
    p.link(True)
    p.claim(0.0)
    beats = [1.0 + 0.25 * i for i in range(30)]          # 1.0 .. 8.25, unbroken
    for t in beats:
        p.peer(t, STANDBY, 1, 2)
        assert p.peer_votes(t) == (t >= 7.0), t
    assert p.peer_votes(8.25 + 0.5) and not p.peer_votes(8.25 + 0.51)
    p.peer(9.0, STANDBY, 1, 2)                           # heard again: standing from 9.0
    assert not p.peer_votes(9.0) and not p.peer_votes(14.9 - 5.9)
    p.peer(9.2, ACTIVE, 1, 0)                            # it claims: no vote
    p.peer(9.4, STANDBY, 1, 2)
    assert p.voting_since == 9.4
