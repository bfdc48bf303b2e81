"""Sequencing, batching and credit: the entries queued per partition, the next seq of each
partition, the batches in flight to their replicas, and the credit each shard has left.

A flush turns queued entries into one BATCH per replica group whose every in-sync replica has
credit: the same header and tensor frames to each replica (and to the update log first).

Tensors whose bytes are in a client's shared-memory ring (a descriptor's ``r``) travel as
references to replicas that read shared memory and are inlined by the loop for the others
(:attr:`~.actions.ToShard.inline`). The sequencer counts, per push and per ring segment, its
entries that still reference the ring (queued, or in a batch some replica has not applied), in
:class:`~.ring_refs.RingRefs`: when a push's count reaches 0 it is in :attr:`Sequencer.freed`,
and the core tells the client its slots are free; a dead client's segment goes once its count
is 0.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gradbus.codecs import hops, wire

from .actions import INLINE_COPY, INLINE_VIEW, RELAY, ToShard
from .ring_refs import RingRefs

ALL = wire.ACKS_ALL
RELAY_MIN = 256 << 10      # tensor bytes from which a batch of frames is relayed through the
                           # broker's ring to shards that read shared memory


@dataclass(slots=True)
class Batch:
    """One partition's sequenced batch on its way to the replicas."""
    refs: list                     # the Pending ref of each entry, in order
    waiting: set                   # in-sync replicas (at send time) that have not applied it
    errors: dict | None = None     # entry index -> (code, message), from the first APPLIED
    primary_done: bool = False
    epoch: int = 0                 # the partition's epoch when it was sent
    nbytes: int = 0                # its tensor frames' bytes (counted in held_bytes)
    shm: list | None = None        # (push ref, ring segment) of its entries in shared memory
    relay: int = 0                 # the broker's ring holds its message's bytes under this id


class Sequencer:
    def __init__(self, partitions: int, settings, meters, table, members):
        self.P = partitions
        self.settings = settings
        self.meters = meters
        self.table = table
        self.members = members
        self.log_policy = None            # set by recovery when there is an update log
        self.seq = [0] * partitions
        self.published_seq: dict[int, int] = {}   # p -> last seq whose UPDATE went out on events
        self.pending_entries: dict[int, list] = defaultdict(list)   # p -> [(entry, desc, frame, ref)]
        self.pending_bytes = 0
        self.inflight_bytes = 0             # tensor bytes of the batches in self.inflight
        self.inflight: dict[tuple[int, int], Batch] = {}             # (p, seq) -> batch
        self.pcount = [0] * partitions      # gradients batched into p since the last rate fold
        self.rings = RingRefs()                  # what entries reference in clients' rings
        self.shm_live = self.rings.live          # push ref -> its entries still reading the ring
        self.freed = self.rings.freed            # pushes whose ring slots nobody needs any more
        self.relaying = False                    # the loop has a ring to relay frames through
        self.relay_ids = 0
        self.relay_live: dict[int, int] = {}     # relay id -> its batches still in flight
        self.relays_done: list[int] = []         # relay ids every batch of which is done

    def accepting(self) -> bool:
        return self.pending_bytes < self.settings.max_pending_bytes

    @property
    def held_bytes(self) -> int:
        """Tensor bytes the broker holds: queued, and in batches not yet applied (their frames
        may still sit in a send queue to a shard that does not read)."""
        return self.pending_bytes + self.inflight_bytes

    def done(self, key: tuple) -> Batch:
        """A batch leaves the in-flight set (applied by all it waited for, or failed)."""
        b = self.inflight.pop(key)
        self.inflight_bytes -= b.nbytes
        if b.shm:
            self.rings.release(b.shm)
        if b.relay:
            n = self.relay_live[b.relay] - 1
            if n:
                self.relay_live[b.relay] = n
            else:
                del self.relay_live[b.relay]
                self.relays_done.append(b.relay)
        return b

    # ------------------------------------------------------------------ queueing
    def enqueue(self, p: int, entry: dict, raw_desc, frame, ref) -> None:
        self.pending_entries[p].append((entry, raw_desc, frame, ref))
        if frame is not None:
            self.pending_bytes += wire.frame_len(frame)
            if "r" in raw_desc:
                self.rings.hold(ref, raw_desc["r"][0])

    def enqueue_push(self, ref: tuple, h, routed: list, weights: dict, wall) -> None:
        """A push's entries, one per tensor, queued for their partitions."""
        client, msg = ref
        ts = None
        for (p, d, fr, name), raw in zip(routed, h.t):
            entry = {"op": "push", "c": client, "m": msg}
            if d.ids is not None:     # rows: the time that row expiry counts from, the same
                if ts is None:        # on every replica
                    ts = round(wall(), 3)
                entry["ts"] = ts
            w = weights.get(name)
            if w is not None:
                entry["w"] = w
            self.enqueue(p, entry, raw, fr, ref)

    def fail_partition(self, p: int) -> list:
        """Forget what is in flight or queued for p; returns their refs, in order."""
        refs = []
        for key in [k for k in self.inflight if k[0] == p]:
            refs += self.done(key).refs
        for _entry, raw, fr, ref in self.pending_entries.pop(p, []):
            if fr is not None:
                self.pending_bytes -= wire.frame_len(fr)
                if "r" in raw:
                    self.rings.release(((ref, raw["r"][0]),))
            refs.append(ref)
        return refs

    # ------------------------------------------------------------------ credit
    def can_send(self, group: tuple) -> bool:
        """Every in-sync replica is alive and has credit (the slowest one paces the partition;
        a standby catching up only buffers and does not)."""
        primary, standbys, _ = group
        credit = self.settings.shard_credit
        shards = self.members.shards
        for sid in (primary, *standbys):
            sh = shards.get(sid)
            if sh is None or not sh.alive or sh.inflight >= credit:
                return False
        return True

    def send_group(self, group: tuple, msg: list, actions: list, refs: bool = False,
                   relay: int = 0) -> None:
        """One BATCH to every live receiver of a replica group; each uses a credit. With
        ``refs`` (tensors in shared memory), a receiver that does not read it gets them inlined:
        as views for an in-sync replica (the batch holds the slots until it applied it), as
        copies for one catching up (nothing waits for it). With ``relay``, an in-sync replica
        that reads shared memory gets the frames as references into the broker's ring."""
        shards = self.members.shards
        syncing = group[2]
        for sid in (group[0], *group[1], *syncing):
            sh = shards.get(sid)
            if sh is not None and sh.alive:
                sh.inflight += 1
                if refs:
                    inline = INLINE_COPY if sid in syncing else 0 if sh.shm else INLINE_VIEW
                else:
                    inline = RELAY if relay and sh.shm and sid not in syncing else 0
                actions.append(ToShard(sh.identity, msg, inline, relay if inline else 0))

    def has_flushable(self, replaying) -> bool:
        if not self.pending_entries:        # the loop asks every turn: mostly nothing waits
            return False
        group = self.table.group
        return any(p not in replaying and self.can_send(group(p)) for p in self.pending_entries)

    # ------------------------------------------------------------------ batching
    def flush(self, now: float, replaying, wall, actions: list) -> None:
        """Turn pending entries into sequenced batches (partitions replaying wait: logged
        batches go first)."""
        if not self.pending_entries:
            return
        groups: dict[tuple, list[int]] = defaultdict(list)
        for p in self.pending_entries:
            if p not in replaying:
                groups[self.table.group(p)].append(p)
        max_bytes = self.settings.max_batch_bytes
        max_entries = self.settings.max_batch_entries
        epochs = self.table.epochs
        for group, parts in groups.items():
            if not self.can_send(group):
                continue
            primary, standbys, _ = group
            header_parts, t_list, frames, nbytes, any_refs = [], [], [], 0, False
            batches, count = [], 0
            for p in parts:
                if nbytes >= max_bytes or count >= max_entries:
                    break
                entries = self.pending_entries[p]
                take = 0
                for _entry, _raw, fr, _ref in entries:
                    size = wire.frame_len(fr) if fr is not None else 0
                    if take and (nbytes + size > max_bytes or count + take >= max_entries):
                        break
                    nbytes += size
                    take += 1
                count += take
                batch, rest = entries[:take], entries[take:]
                if rest:
                    self.pending_entries[p] = rest
                else:
                    del self.pending_entries[p]
                self.seq[p] += 1
                ents, refs, held, shm = [], [], 0, None
                for entry, raw, fr, ref in batch:
                    if fr is not None:
                        entry["i"] = len(frames)   # the entry dict is this batch's alone
                        t_list.append(raw)
                        frames.append(fr)
                        held += wire.frame_len(fr)
                        if "r" in raw:
                            shm = [] if shm is None else shm
                            shm.append((ref, raw["r"][0]))
                    ents.append(entry)
                    refs.append(ref)
                any_refs = any_refs or shm is not None
                self.pending_bytes -= held
                self.inflight_bytes += held
                header_parts.append({"p": p, "seq": self.seq[p], "epoch": epochs[p],
                                     "o": primary, "e": ents})
                self.pcount[p] += len(ents)
                self.meters.h_batch.observe(len(ents))
                batch = Batch(refs, {primary, *standbys}, epoch=epochs[p], nbytes=held, shm=shm)
                self.inflight[(p, self.seq[p])] = batch
                batches.append(batch)
            hdr = wire.pack(wire.BATCH, t_list, parts=header_parts)
            if hops.ON:
                hops.stamp("batch_out", [r[1] for b in batches for r in b.refs])
            if self.log_policy is not None:
                self.log_policy.append(actions, header_parts, t_list, frames, wall(), now)
            self.meters.counters["batches"] += 1
            self.meters.counters["batched_entries"] += sum(len(x["e"]) for x in header_parts)
            relay = 0
            if (self.relaying and not any_refs and nbytes >= RELAY_MIN
                    and any(getattr(self.members.shards.get(s), "shm", False)
                            for s in (primary, *standbys))):
                self.relay_ids += 1
                relay = self.relay_ids
                self.relay_live[relay] = len(batches)
                for batch in batches:
                    batch.relay = relay
            self.send_group(group, [hdr, *frames], actions, any_refs, relay)

    def validate_state(self) -> list[str]:
        problems = []
        if self.pending_bytes < 0:
            problems.append(f"pending_bytes {self.pending_bytes} < 0")
        queued = sum(wire.frame_len(fr) for es in self.pending_entries.values()
                     for _, _, fr, _ in es if fr is not None)
        if queued != self.pending_bytes:
            problems.append(f"pending_bytes {self.pending_bytes}, queued frames hold {queued}")
        if self.inflight_bytes != sum(b.nbytes for b in self.inflight.values()):
            problems.append(f"inflight_bytes {self.inflight_bytes}, in-flight batches hold "
                            f"{sum(b.nbytes for b in self.inflight.values())}")
        pairs = [(ref, raw["r"][0]) for es in self.pending_entries.values()
                 for _, raw, fr, ref in es if fr is not None and "r" in raw]
        pairs += [pair for b in self.inflight.values() for pair in b.shm or ()]
        problems += self.rings.validate_state(pairs)
        relays: dict = {}
        for b in self.inflight.values():
            if b.relay:
                relays[b.relay] = relays.get(b.relay, 0) + 1
        if relays != self.relay_live:
            problems.append(f"relays in flight {self.relay_live}, batches hold {relays}")
        for (p, seq), b in self.inflight.items():
            if not b.waiting:
                problems.append(f"in-flight batch {p}/{seq} waits for nobody")
            if seq > self.seq[p]:
                problems.append(f"in-flight batch {p}/{seq} beyond the last seq {self.seq[p]}")
        return problems
