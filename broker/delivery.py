"""Conflated delivery: each client that reads weights as frames gets the newest value of a
block when it can use it, not every update of it (protocol section 22).

The state, without sockets or a clock:

* per partition that some client follows, a last-value cache (:class:`Last`): the newest
  published value of every block changed after ``floor``, the seq from which the cache holds
  every change, with the seq and epoch it was published at, as the UPDATE carried it (its
  descriptor and frame; a shard's shared-memory references were copied into the frame by the
  loop first, so the cache never depends on a board that may be rewritten);
* per client, the partitions it follows (:class:`Follow`): ``sent``, the seq of the partition
  it holds as far as the broker knows (the last UPDATE sent to it, or what its CREDIT said),
  and whether it holds a credit.

A published UPDATE of partition p is sent to a follower when (a) the batch applied one of its
own pushes (the weights its push produced, as a parameter server returns them to the caller),
(b) it holds a credit (granted when its application read the weights), or (c) the UPDATE
carries deltas (``base``): a delta applies only on its base, so no follower skips one. Every
other follower skips it: the value stays in the cache and reaches that follower with its next
delivery, whatever came in between. A CREDIT is answered at once from the cache when the cache
is newer than what the client holds, else by the next UPDATE.

What a follower is sent is composed from the cache: every block changed after what it holds,
one UPDATE per seq those blocks were published at (so each block arrives with the seq its
next delta will name as ``base``), each naming ``since``, the seq it follows on from. A client
holding seq ``h`` applies an UPDATE with ``since <= h < seq``; one with ``since > h`` tells it
that something it was sent was lost, or that it is older than the cache (``floor``), and it
snapshots the partition again. Skipped versions are never a gap.

Bounded: the cache holds at most one value per block of the followed partitions (a copy of the
followed weights); a client's state is one :class:`Follow` per partition it follows, forgotten
with the client (BYE, or silence past its liveness).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from gradbus.codecs import messages, wire
from gradbus.codecs.errors import Code, WireError

from .actions import ToClient

_UPDATE = frozenset({wire.UPDATE})


@dataclass(slots=True)
class Entry:
    """A block's newest published value."""
    seq: int
    epoch: int
    desc: dict                # its descriptor as published (no shared-memory reference)
    frame: object             # its tensor frame
    nbytes: int


@dataclass(slots=True)
class Last:
    """A followed partition's last-value cache."""
    floor: int                # every block change after this seq is held (or a delta all got)
    seq: int                  # the newest seq published (or known published without an UPDATE)
    epoch: int = 0
    blocks: dict = field(default_factory=dict)        # key -> Entry, each seq in (floor, seq]
    followers: dict = field(default_factory=dict)     # client identity -> None, in order
    nbytes: int = 0


@dataclass(slots=True)
class Follow:
    """One client's following of one partition."""
    sent: int                 # the seq it holds, as far as the broker knows
    credit: bool = False      # it read what it holds: the next UPDATE (or a newer cache) goes


@dataclass(slots=True)
class _Current:
    """The UPDATE being published, as every follower that gets it now gets it."""
    seq: int
    epoch: int
    descs: list
    frames: list
    whole: frozenset          # keys it carries as whole values (not deltas)


class Delivery:
    def __init__(self, partitions: int, meters, members, sequencer):
        self.P = partitions
        self.counters = meters.counters
        self.errors = meters.errors
        self.members = members
        self.published = sequencer.published_seq     # p -> last seq published (read only)
        self.lasts: dict[int, Last] = {}
        self.follows: dict[bytes, dict[int, Follow]] = {}

    # ------------------------------------------------------------------ queries
    def followed(self, p: int) -> bool:
        return p in self.lasts

    def owners(self, p: int, refs) -> tuple:
        """The followers of p among the clients of a batch's entry refs ``(client, msg)``."""
        last = self.lasts.get(p)
        if last is None:
            return ()
        return tuple(dict.fromkeys(r[0] for r in refs if r[0] in last.followers))

    def cache_bytes(self) -> int:
        return sum(last.nbytes for last in self.lasts.values())

    # ------------------------------------------------------------------ clients
    def _last(self, p: int) -> Last:
        last = self.lasts.get(p)
        if last is None:      # the cache vouches for what is published from now on
            s = self.published.get(p, 0)
            last = self.lasts[p] = Last(s, s)
        return last

    def follow(self, identity: bytes, ps) -> None:
        """FOLLOW: from now on ``identity`` follows ``ps`` (it snapshots them next, so it
        holds at least what is published now)."""
        mine = self.follows.setdefault(identity, {})
        for p in ps:
            if p in mine:
                continue
            last = self._last(p)
            mine[p] = Follow(max(last.seq, self.published.get(p, 0)))
            last.followers[identity] = None
            self.counters["follows"] += 1

    def credit(self, identity: bytes, ps, seqs, again: bool) -> list:
        """CREDIT: ``identity`` read what it holds of ``ps`` (at ``seqs``); each gets the
        newest at once when the cache is newer, else the next UPDATE."""
        mine = self.follows.setdefault(identity, {})
        out = []
        for p, have in zip(ps, seqs):
            f = mine.get(p)
            last = self._last(p)
            if f is None:      # a broker that does not know it follows p (restarted, forgot)
                f = mine[p] = Follow(have)
                last.followers[identity] = None
            elif have < f.sent and not again:
                # what went to it since its read answers the read (its own push's weights)
                self.counters["credits_in_flight"] += 1
                continue
            else:
                f.sent = have if again else max(f.sent, have)
            self.counters["credits"] += 1
            if last.seq > f.sent:
                out += self._send(identity, p, last, f)
            else:
                f.credit = True
        return out

    def forget(self, identity: bytes) -> None:
        """A client that left (BYE) or was forgotten (silent): its state goes, and a cache
        nobody follows any more goes with it."""
        for p in self.follows.pop(identity, {}):
            last = self.lasts[p]
            last.followers.pop(identity, None)
            if not last.followers:
                del self.lasts[p]

    def forget_gone(self, clients) -> None:
        """Forget the followers that are no longer among ``clients`` (expired)."""
        for identity in [i for i in self.follows if i not in clients]:
            self.forget(identity)

    # ------------------------------------------------------------------ publishes
    def published_update(self, p: int, frames: list | None, owners=(), torn_seq=None) -> list:
        """A partition's UPDATE was published: ``frames`` is ``[topic, header, tensors...]``
        with the bytes in the frames; None when the loop could not read a block the shard
        referenced whole (``torn_seq``: its seq), and the cache cannot vouch for that seq.
        ``owners``: the followers whose pushes the batch applied."""
        last = self.lasts.get(p)
        if last is None:
            return []
        if frames is None:
            self.counters["delivery_torn"] += 1
            return self.unpublished(p, torn_seq) if torn_seq is not None else []
        try:
            h = messages.unpack(frames[1], _UPDATE, self.P)
            t, tensors = h.t, frames[2:]
            if len(t) != len(tensors) or not all(type(d) is dict and type(d.get("k")) is str
                                                 for d in t):
                raise WireError(Code.BAD_FIELD, "update: descriptors and frames")
        except WireError:
            self.errors["bad_update"] += 1       # a shard's bug: subscribers refuse it too
            return []
        seq = h.seq
        if seq <= last.seq:         # published late (a moved primary's): held if newer
            self._capture(last, h, tensors, False)
            return []
        delta = any("base" in d for d in t)
        cur = _Current(seq, h.epoch, t, list(tensors),
                       frozenset(d["k"] for d in t if "base" not in d))
        mine, out, sent = self.follows, [], 0
        for c in last.followers:
            f = mine[c][p]
            if f.sent >= seq or not (delta or f.credit or c in owners):
                continue
            out += self._send(c, p, last, f, cur)
            sent += 1
        self.counters["updates_skipped"] += len(last.followers) - sent
        self._capture(last, h, tensors, True)
        if delta:
            self._raise_floor(last, seq)      # every follower got it: none needs what was before
        return out

    def unpublished(self, p: int, seq: int) -> list:
        """Seq ``seq`` of p counts as published though no UPDATE of it came (a standby promoted
        after applying it, a moved primary that never reported it, a newer copy taken over at
        registration): the cache cannot vouch for it, so a follower older than it snapshots
        again when it is next sent something; one holding a credit is told at once."""
        last = self.lasts.get(p)
        if last is None or seq <= last.floor:
            return []
        last.seq = max(last.seq, seq)
        self._raise_floor(last, seq)
        out = []
        for c in last.followers:
            f = self.follows[c][p]
            if f.credit and f.sent < last.seq:
                out += self._send(c, p, last, f)
        return out

    def _capture(self, last: Last, h, tensors, newest: bool) -> None:
        seq = h.seq
        for d, fr in zip(h.t, tensors):
            k = d["k"]
            old = last.blocks.get(k)
            if old is not None and old.seq >= seq:
                continue
            if old is not None:
                del last.blocks[k]
                last.nbytes -= old.nbytes
            if "base" not in d and seq > last.floor:
                e = Entry(seq, h.epoch, d, fr, wire.frame_len(fr))
                last.blocks[k] = e
                last.nbytes += e.nbytes
        if newest:
            last.seq, last.epoch = seq, h.epoch

    def _raise_floor(self, last: Last, seq: int) -> None:
        last.floor = max(last.floor, seq)
        for k in [k for k, e in last.blocks.items() if e.seq <= last.floor]:
            last.nbytes -= last.blocks.pop(k).nbytes

    def _send(self, identity: bytes, p: int, last: Last, f: Follow,
              cur: _Current | None = None) -> list:
        """What ``identity`` lacks of p, one UPDATE per seq, chained by ``since``: the cache's
        blocks changed after what it holds (not those ``cur`` carries whole), then ``cur``;
        or, with nothing newer in the cache, an UPDATE without blocks that moves it to the
        cache's seq (or, below ``floor``, tells it to snapshot)."""
        base = max(f.sent, last.floor)
        skip = cur.whole if cur is not None else ()
        old = sorted((e for k, e in last.blocks.items() if e.seq > base and k not in skip),
                     key=lambda e: e.seq)
        msgs, prev = [], base
        for seq, group in itertools.groupby(old, key=lambda e: e.seq):
            group = list(group)
            msgs.append([wire.pack(wire.UPDATE, [e.desc for e in group], p=p, seq=seq,
                                   epoch=group[0].epoch, since=prev),
                         *(e.frame for e in group)])
            prev = seq
        if cur is not None:
            msgs.append([wire.pack(wire.UPDATE, cur.descs, p=p, seq=cur.seq, epoch=cur.epoch,
                                   since=prev), *cur.frames])
            prev = cur.seq
        elif not msgs:
            msgs.append([wire.pack(wire.UPDATE, p=p, seq=last.seq, epoch=last.epoch,
                                   since=base)])
            prev = last.seq
        f.sent, f.credit = prev, False
        c = self.counters
        c["deliveries"] += len(msgs)
        c["delivered_bytes"] += sum(wire.frame_len(x) for m in msgs for x in m[1:])
        return [ToClient(identity, m) for m in msgs]

    # ------------------------------------------------------------------ invariants
    def validate_state(self) -> list[str]:
        problems = []
        clients = self.members.clients
        for ident, mine in self.follows.items():
            if ident not in clients:
                problems.append(f"delivery: follower {ident!r} is no known client")
            if len(mine) > self.P:
                problems.append(f"delivery: {ident!r} follows {len(mine)} partitions")
            for p, f in mine.items():
                last = self.lasts.get(p)
                if last is None or ident not in last.followers:
                    problems.append(f"delivery: {ident!r} follows {p} without its cache")
                if f.sent < 0:
                    problems.append(f"delivery: {ident!r} holds seq {f.sent} of {p}")
        for p, last in self.lasts.items():
            if not last.followers:
                problems.append(f"delivery: partition {p} cached for nobody")
            if any(p not in self.follows.get(c, {}) for c in last.followers):
                problems.append(f"delivery: partition {p} names a follower that is not")
            if last.floor > last.seq:
                problems.append(f"delivery: partition {p} floor {last.floor} > {last.seq}")
            if any(not last.floor < e.seq <= last.seq for e in last.blocks.values()):
                problems.append(f"delivery: partition {p} holds a block outside "
                                f"({last.floor}, {last.seq}]")
            if last.nbytes != sum(e.nbytes for e in last.blocks.values()):
                problems.append(f"delivery: partition {p} counts {last.nbytes} bytes")
        return problems
