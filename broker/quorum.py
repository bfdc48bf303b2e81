"""Whether the active broker of a pair may act for its partitions: the voters' rule of
protocol section 23, as a function of what the broker knows, without sockets or a clock.

A partition's voters are its ``replicas`` copies (the shards holding it) and, when
``replicas`` is even, the peer broker too, so that they are always an odd number and two
majorities always share a voter. A shard votes for the broker it is registered with (it is
registered with one at a time); the broker counts that vote while the shard was heard within
the *lease*, which ends before the shard could have left it for the other broker. The peer
votes for this broker while it is heard, as the standby, naming this broker's epoch.

The broker acts (accepts pushes, reads and inits, sends batches, declares shards dead) only
while every partition that has a counted copy here has a majority of its voters: the
:func:`needed` votes. A partition with no counted copy is down, as without a pair: no other
copy of it can be written through this broker. Two brokers never both act for a partition:
each needs a majority of one odd set of voters, each voter votes for one broker at a time,
and the peer's vote goes only to an active broker from a standby.
"""
from __future__ import annotations

from collections.abc import Iterable


def needed(replicas: int) -> int:
    """Votes a partition needs: a majority of its ``replicas`` copies when they are odd, of
    the copies and the peer broker when even (with 2 copies, a copy and the peer: a dead
    shard still fails over)."""
    return replicas // 2 + 1


def lease(heartbeat_interval: float, liveness: int) -> float:
    """How long after a shard was last heard its vote counts. A shard leaves its broker after
    ``liveness`` intervals without hearing it; the broker heard the shard at most an interval
    after the shard last heard the broker (both beat every interval); one more interval is
    the margin for the loop's turns. At least one interval."""
    return heartbeat_interval * max(1, liveness - 2)


def lacking(now: float, replicas: int, lease_s: float,
            shards: Iterable[tuple[float, bool, Iterable[int]]], peer_votes: bool) -> list[int]:
    """The partitions without the votes they need, sorted (empty: this broker may act).

    ``shards``: ``(last heard, alive, partitions held)`` of each shard registered here;
    ``peer_votes``: the peer is heard as the standby naming this broker's epoch."""
    votes: dict[int, int] = {}
    for last, alive, parts in shards:
        if alive and now - last <= lease_s:
            for p in parts:
                votes[p] = votes.get(p, 0) + 1
    need = needed(replicas)
    extra = 1 if peer_votes and replicas % 2 == 0 else 0
    return sorted(p for p, n in votes.items() if n + extra < need)
