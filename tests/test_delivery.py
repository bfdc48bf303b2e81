"""Conflated delivery's state (broker/delivery.py, protocol section 22) without sockets: what
each follower is sent, what it skips, and that a follower applying what it is sent by the
section's rule always ends up holding the newest value of every block."""
from __future__ import annotations

import collections
import random
from types import SimpleNamespace

import pytest

from gradbus.broker.delivery import Delivery
from gradbus.codecs import messages, wire
from gradbus.workers.cache import WeightCache

P = 4
A, B, C = b"client-a", b"client-b", b"client-c"
_UPDATE = frozenset({wire.UPDATE})


def make():
    meters = SimpleNamespace(counters=collections.Counter(), errors=collections.Counter())
    members = SimpleNamespace(clients={A: None, B: None, C: None})
    seq = SimpleNamespace(published_seq={})
    return Delivery(P, meters, members, seq), seq.published_seq, meters.counters


def desc(key: str, n: int = 4, base: int | None = None) -> dict:
    d = {"k": key, "d": "uint8", "s": [n], "c": "raw", "n": n, "x": 0}
    if base is not None:
        d["base"] = base
    return d


def update(p: int, seq: int, blocks: dict, epoch: int = 1, base=None) -> list:
    """A published UPDATE's frames: topic, header, one frame per block (its bytes say what)."""
    descs = [desc(k, len(v), base) for k, v in blocks.items()]
    return [wire.topic_partition(p), wire.pack(wire.UPDATE, descs, p=p, seq=seq, epoch=epoch),
            *blocks.values()]


def publish(d: Delivery, published: dict, p: int, seq: int, blocks: dict, owners=(), base=None):
    published[p] = seq
    return d.published_update(p, update(p, seq, blocks, base=base), owners)


def sent(actions) -> list:
    """(identity, seq, since, {key: frame}) of each UPDATE sent."""
    out = []
    for a in actions:
        h = messages.unpack(a.frames[0], _UPDATE, P)
        out.append((a.identity, h.seq, h.since, {t["k"]: bytes(f)
                                                  for t, f in zip(h.t, a.frames[1:])}))
    return out


def test_a_follower_gets_its_own_pushs_update_and_the_others_skip_it():
    d, published, counters = make()
    d.follow(A, [0])
    d.follow(B, [0])
    out = sent(publish(d, published, 0, 1, {"w/0": b"v1.."}, owners=(A,)))
    assert out == [(A, 1, 0, {"w/0": b"v1.."})]
    assert counters["updates_skipped"] == 1
    assert d.validate_state() == []


def test_a_credit_is_answered_at_once_with_every_block_changed_since_chained_by_since():
    d, published, _ = make()
    d.follow(A, [0])
    d.follow(B, [0])
    publish(d, published, 0, 1, {"w/0": b"a1..", "w/4": b"b1.."}, owners=(A,))
    publish(d, published, 0, 2, {"w/0": b"a2.."}, owners=(A,))
    publish(d, published, 0, 3, {"w/8": b"c3.."}, owners=(A,))
    # B holds seq 0 and read: what it lacks is composed from the cache, newest value of each
    out = sent(d.credit(B, [0], [0], False))
    assert out == [(B, 1, 0, {"w/4": b"b1.."}), (B, 2, 1, {"w/0": b"a2.."}),
                   (B, 3, 2, {"w/8": b"c3.."})]
    assert d.validate_state() == []


def test_a_credit_with_nothing_newer_waits_for_the_next_update():
    d, published, _ = make()
    d.follow(A, [1])
    publish(d, published, 1, 1, {"w/1": b"x1"}, owners=(A,))
    assert d.credit(A, [1], [1], False) == []
    out = sent(publish(d, published, 1, 2, {"w/1": b"x2"}))     # not A's push: its credit
    assert out == [(A, 2, 1, {"w/1": b"x2"})]
    assert sent(publish(d, published, 1, 3, {"w/1": b"x3"})) == []    # credit spent: skipped


def test_a_credit_below_what_was_sent_since_answers_nothing_unless_again():
    d, published, counters = make()
    d.follow(A, [0])
    publish(d, published, 0, 1, {"w/0": b"v1"}, owners=(A,))
    publish(d, published, 0, 2, {"w/0": b"v2"}, owners=(A,))
    assert d.credit(A, [0], [1], False) == []            # seq 2 went to it since
    assert counters["credits_in_flight"] == 1
    publish(d, published, 0, 3, {"w/0": b"v3"})
    out = sent(d.credit(A, [0], [1], True))               # that answer was lost: from seq 1
    assert out == [(A, 3, 1, {"w/0": b"v3"})]


def test_deltas_go_to_every_follower_and_raise_the_floor():
    d, published, _ = make()
    d.follow(A, [2])
    d.follow(B, [2])
    publish(d, published, 2, 1, {"w/2": b"full"}, owners=(A,))
    out = sent(publish(d, published, 2, 2, {"w/2": b"dlt2"}, base=1))
    # A holds seq 1 and gets the delta; B skipped seq 1, so it gets the full value the delta
    # is based on first, then the delta
    assert out == [(A, 2, 1, {"w/2": b"dlt2"}), (B, 1, 0, {"w/2": b"full"}),
                   (B, 2, 1, {"w/2": b"dlt2"})]
    assert d.lasts[2].floor == 2 and d.lasts[2].blocks == {}


def test_a_seq_published_without_an_update_makes_an_older_follower_snapshot():
    d, published, _ = make()
    d.follow(A, [3])
    publish(d, published, 3, 1, {"w/3": b"v1"}, owners=(A,))
    assert d.credit(A, [3], [1], False) == []
    out = sent(d.unpublished(3, 4))           # a standby promoted after applying up to 4
    assert out == [(A, 4, 4, {})]          # since 4: above what it holds
    cache = WeightCache(P, conflated=True)
    cache.parts[3] = _part(cache, 3, last_seq=1)
    assert cache.on_update(3, 4, [], 4) is True   # since 4 above what it holds: a gap


def _part(cache, p, last_seq):
    from gradbus.workers.cache import Part
    part = Part(p)
    part.resync, part.last_seq = False, last_seq
    return part


def test_a_follower_that_leaves_takes_its_state_and_an_unfollowed_cache_with_it():
    d, published, _ = make()
    d.follow(A, [0, 1])
    d.follow(B, [1])
    publish(d, published, 0, 1, {"w/0": b"v1"})
    d.forget(A)
    assert set(d.lasts) == {1} and A not in d.follows
    d.members.clients.pop(B)
    d.forget_gone(d.members.clients)
    assert d.lasts == {} and d.follows == {}
    assert d.validate_state() == []


def test_the_cache_holds_one_value_per_block_whatever_was_published():
    d, published, _ = make()
    d.follow(A, [0])
    for s in range(1, 200):
        publish(d, published, 0, s, {f"w/{4 * (s % 3)}": bytes(64)})
    last = d.lasts[0]
    assert len(last.blocks) == 3 and last.nbytes == 3 * 64
    assert d.validate_state() == []


@pytest.mark.parametrize("seed", range(8))
def test_followers_applying_what_they_are_sent_hold_the_newest_value_after_every_read(seed):
    """Random publishes (own pushes, others', some blocks unpublished), reads and losses of
    nothing: each follower applies what it is sent by the section's rule (``since <= last <
    seq``; a gap snapshots). After each of its reads is answered it holds, per block, the
    newest value published; it never sees a gap it did not cause, and it receives at most one
    value per block per delivery."""
    rng = random.Random(seed)
    d, published, counters = make()
    keys = [f"w/{4 * i}" for i in range(5)]
    truth: dict[str, bytes] = {}
    held = {c: {"seq": 0, "v": {}} for c in (A, B, C)}
    for c in held:
        d.follow(c, [0])

    def apply(actions):
        for ident, seq, since, blocks in sent(actions):
            h = held[ident]
            assert seq > h["seq"], "stale update sent"
            assert since <= h["seq"], f"a gap: since {since} above held {h['seq']}"
            h["v"].update(blocks)
            h["seq"] = seq

    seq = 0
    for _ in range(400):
        r = rng.random()
        if r < 0.6:
            seq += 1
            blocks = {k: f"{k}@{seq}".encode() for k in rng.sample(keys, rng.randint(1, 3))}
            truth.update(blocks)
            owners = tuple(c for c in held if rng.random() < 0.3)
            apply(publish(d, published, 0, seq, blocks, owners=owners))
        else:
            c = rng.choice(list(held))
            h = held[c]
            apply(d.credit(c, [0], [h["seq"]], False))
            if h["seq"] == seq:     # answered at once: it holds the newest of every block
                assert h["v"] == truth
        assert d.validate_state() == []
    # fewer UPDATEs than every update to every follower, as events would have sent
    assert counters["updates_skipped"] > 0 and counters["deliveries"] < len(held) * seq
