"""The partition table: per partition its primary, in-sync standbys, standbys catching up,
epoch and parameter bytes; per shard the partitions it holds and their bytes.

This module is the only writer of replica membership (``owners``, ``standbys``, ``syncing``,
``ShardInfo.partitions``) and of bytes (``pbytes``, ``ShardInfo.bytes``). A shard's bytes are
the bytes of the partitions it holds, except one it is moving away (``leaving``): that one
counts where it is going from the start of the move.
"""
from __future__ import annotations

from collections import defaultdict

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError


class PartitionTable:
    def __init__(self, partitions: int, replicas: int, shards: dict, lost_message=None):
        """``lost_message(p)``: why a lost partition p is refused and what would bring it
        back (the broker's acknowledged marks know)."""
        self.P = partitions
        self.run: int | None = None     # the broker's run id, named in TABLE
        self.tier = None                # a tier member's: TABLE's fields naming its map
        self.lost_message = lost_message or (lambda p: f"partition {p} is lost")
        self.replicas = replicas
        self.shards = shards                                      # id -> ShardInfo (membership's)
        self.owners: list[str | None] = [None] * partitions      # primaries
        self.standbys: list[list[str]] = [[] for _ in range(partitions)]  # in-sync standbys
        self.syncing: dict[int, dict[str, float]] = defaultdict(dict)  # p -> {shard: since}
        self.epochs = [0] * partitions
        self.pbytes = [0] * partitions                            # parameter bytes per p
        self.leaving: dict[int, str] = {}      # p -> the shard it is moving away from
        self.lost: set[int] = set()            # sole copies that did not come back
        self.version = 0

    # ------------------------------------------------------------------ reads
    def live(self, sid: str | None) -> bool:
        s = self.shards.get(sid) if sid else None
        return bool(s and s.alive)

    def members(self, p: int) -> list[str]:
        """The in-sync replicas of p: primary first."""
        return [self.owners[p], *self.standbys[p]] if self.owners[p] else []

    def holds(self, sid: str, p: int) -> bool:
        return sid == self.owners[p] or sid in self.standbys[p] or sid in self.syncing.get(p, ())

    def group(self, p: int) -> tuple:
        """Who receives p's batches: (primary, in-sync standbys, standbys catching up)."""
        return (self.owners[p], tuple(self.standbys[p]), tuple(self.syncing.get(p, ())))

    def down(self) -> list[int]:
        """Partitions that have an owner on record but no live one."""
        return sorted(p for p in range(self.P)
                      if p in self.lost or (self.owners[p] and not self.live(self.owners[p])))

    def available(self, p: int) -> bool:
        """A partition can take work: unplaced (placed on first use) or owned by a live shard."""
        return p not in self.lost and (self.owners[p] is None or self.live(self.owners[p]))

    def live_owner(self, key: str, p: int) -> str:
        """The live shard owning partition p, or SHARD_UNAVAILABLE."""
        owner = self.owners[p]
        if p in self.lost:
            raise WireError(Code.SHARD_UNAVAILABLE, f"{key}: {self.lost_message(p)}")
        if not self.live(owner):
            raise WireError(Code.SHARD_UNAVAILABLE,
                            f"{key}: partition {p} has no live shard (owner {owner or 'none'})")
        return owner

    def under_replicated(self) -> int:
        """Placed partitions with fewer in-sync copies than ``replicas``."""
        return sum(1 for p, o in enumerate(self.owners)
                   if o and 1 + len(self.standbys[p]) < self.replicas)

    def without_standby(self) -> int:
        """Partitions served by a live primary alone: no in-sync standby to fail over to."""
        return sum(1 for p, o in enumerate(self.owners)
                   if o and not self.standbys[p] and p not in self.lost and self.live(o))

    def message(self) -> list:
        """The TABLE message published on events."""
        run = {} if self.run is None else {"run": self.run}
        tier = self.tier() if self.tier is not None else {}
        return [wire.TOPIC_TABLE, wire.pack(wire.TABLE, version=self.version,
                                            owners=[o or "" for o in self.owners],
                                            standbys=self.standbys, epochs=self.epochs,
                                            down=self.down(), **run, **tier)]

    # ------------------------------------------------------------------ writes
    def bump(self) -> None:
        self.version += 1

    def _join(self, s, p: int) -> None:
        s.partitions.add(p)
        s.bytes += self.pbytes[p]

    def _leave(self, s, p: int) -> None:
        if p not in s.partitions:
            return
        s.partitions.discard(p)
        if self.leaving.get(p) == s.id:
            del self.leaving[p]          # its bytes already count where p went
        else:
            s.bytes -= self.pbytes[p]

    def place(self, p: int) -> str | None:
        """Owner of partition p, placing it on the live shard holding fewest bytes if new (its
        standbys on the next ones: a new partition is empty, so they are in sync)."""
        owner = self.owners[p]
        if owner is not None:
            return owner
        live = sorted((s for s in self.shards.values() if s.alive),
                      key=lambda s: (s.bytes, len(s.partitions), s.id))
        if not live:
            return None
        self.owners[p] = live[0].id
        self.epochs[p] = 1
        self._join(live[0], p)
        for sb in live[1:self.replicas]:
            self.standbys[p].append(sb.id)
            self._join(sb, p)
        self.bump()
        return live[0].id

    def account(self, p: int, nbytes: int) -> None:
        """Parameter bytes added to partition p, counted on every shard holding a copy."""
        self.pbytes[p] += nbytes
        src = self.leaving.get(p)
        for sid in (*self.members(p), *self.syncing.get(p, ())):
            if sid != src:
                self.shards[sid].bytes += nbytes

    def set_bytes(self, p: int, nbytes: int) -> None:
        """Partition p holds ``nbytes`` (learned from a registering shard)."""
        self.account(p, nbytes - self.pbytes[p])

    def adopt_primary(self, s, p: int, epoch: int) -> None:
        """A registering shard's copy of a partition nobody holds becomes its primary."""
        self.owners[p], self.epochs[p] = s.id, max(epoch, 1)
        self._join(s, p)

    def add_standby(self, s, p: int) -> None:
        self.standbys[p].append(s.id)
        self._join(s, p)

    def take_over(self, s, p: int, epoch: int) -> list[str]:
        """A newer copy replaces every replica of p; returns the replaced shards."""
        old = [self.owners[p], *self.standbys[p]]
        self.epochs[p] = max(epoch, 1)
        self.standbys[p] = []
        self.owners[p] = s.id
        self._join(s, p)
        for sid in old:
            self._leave(self.shards[sid], p)
        return old

    def revive(self, s, p: int, epoch: int, nbytes: int = 0) -> None:
        """Lost partition p comes back on ``s``, whose copy (sent in ``epoch``) becomes the
        primary: with the next epoch when it is not the old owner's (which lets it go), and
        ``nbytes`` (when known) as its bytes."""
        old = self.owners[p]
        if old != s.id:
            if old is not None and old in self.shards:
                self._leave(self.shards[old], p)
            self.owners[p] = s.id
            self.epochs[p] += 1          # a new primary
            if nbytes:
                self.pbytes[p] = nbytes
            self._join(s, p)
        self.epochs[p] = max(self.epochs[p], epoch, 1)
        self.lost.discard(p)

    def forget(self, s, p: int) -> None:
        """A shard no longer holds p (a stale entry of a returning shard)."""
        self._leave(s, p)

    def start_catch_up(self, p: int, t, now: float) -> None:
        self.syncing[p][t.id] = now
        self._join(t, p)

    def synced(self, p: int, sid: str) -> float | None:
        """A standby catching up is in sync: when it started, or None if it was not."""
        since = self.syncing.get(p, {}).pop(sid, None) if 0 <= p < self.P else None
        if since is None:
            return None
        if not self.syncing[p]:
            del self.syncing[p]
        self.standbys[p].append(sid)
        self.bump()
        return since

    def cancel_catch_up(self, p: int, sid: str) -> bool:
        if self.syncing.get(p, {}).pop(sid, None) is None:
            return False
        if not self.syncing[p]:
            del self.syncing[p]
        self._leave(self.shards[sid], p)
        return True

    def drop_standby(self, p: int, s) -> None:
        self.standbys[p].remove(s.id)
        self._leave(s, p)

    def fail_over(self, p: int, dead) -> str | None:
        """The dead primary's first live in-sync standby takes its place with the next epoch;
        None (and nothing changes) when there is none."""
        new = next((x for x in self.standbys[p] if self.live(x)), None)
        if new is None:
            return None
        self.standbys[p].remove(new)
        self.owners[p] = new
        self.epochs[p] += 1
        self._leave(dead, p)
        return new

    def start_leaving(self, p: int, src: str) -> None:
        """A move of p away from ``src`` started: its bytes count at the destination."""
        self.leaving[p] = src
        self.shards[src].bytes -= self.pbytes[p]

    def stop_leaving(self, p: int) -> None:
        """The move was cancelled: the source keeps its copy (if it still has it)."""
        src = self.leaving.pop(p, None)
        if src is not None and p in self.shards[src].partitions:
            self.shards[src].bytes += self.pbytes[p]

    def finish_move(self, p: int, src: str, dst: str) -> bool:
        """The copy on ``dst`` takes the place of the one on ``src`` (as primary with the next
        epoch when ``src`` led); False when ``src`` holds no copy any more."""
        if src == self.owners[p]:
            self.standbys[p].remove(dst)
            self.owners[p] = dst
            self.epochs[p] += 1
        elif src in self.standbys[p]:
            self.standbys[p].remove(src)
        else:
            return False
        self._leave(self.shards[src], p)
        self.bump()
        return True

    # ------------------------------------------------------------------ checks
    def validate_state(self) -> list[str]:
        problems = []
        for p, o in enumerate(self.owners):
            if o is not None and o not in self.shards:
                problems.append(f"partition {p} owned by unknown shard {o}")
            reps = [o, *self.standbys[p], *self.syncing.get(p, ())]
            if o is not None and len(set(reps)) != len(reps):
                problems.append(f"partition {p} has a shard twice among its replicas: {reps}")
            if o is None and (self.standbys[p] or self.syncing.get(p)):
                problems.append(f"partition {p} has standbys but no primary")
            for sid in reps[1:] if o is not None else ():
                if p not in self.shards[sid].partitions:
                    problems.append(f"shard {sid} is a replica of {p} but does not hold it")
        for s in self.shards.values():
            want = sum(self.pbytes[p] for p in s.partitions if self.leaving.get(p) != s.id)
            if s.bytes != want:
                problems.append(f"shard {s.id} counts {s.bytes} bytes, holds {want}")
        for p, src in self.leaving.items():
            if p not in self.shards[src].partitions:
                problems.append(f"partition {p} leaves {src}, which does not hold it")
        return problems
