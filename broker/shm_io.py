"""The broker loop's side of shared memory: its offer, reading peers' segments, and the events
fan-out.

* The offer: a small probe segment whose name and nonce WELCOME carries (with the cluster tag
  and host identity); a client or shard that opens it and finds the nonce shares this
  broker's shared-memory directory, and says so (REGISTER ``shm``, client HEARTBEAT ``shm``).
* Inlining: a BATCH for a shard that does not read shared memory, and the update log, get a
  client's ring bytes as frames (:func:`gradbus.codecs.wire.inline_refs`); so does a shard's
  reply (SNAPSHOT_REPLY, ROWS_REPLY, STATE) that references its reply area, for a receiver
  that does not read shared memory (shards reference it only for receivers that do, so this
  is the exception), or it gets a retryable ``SHM_TORN`` when the bytes were rewritten first.
* Relaying, the other way: a BATCH of frames (pushes from clients without shared memory, on
  other hosts say) goes to a shard that reads it as references into this broker's own ring,
  one copy here in place of a second TCP hop; the slots are freed when every replica applied
  the batches (:class:`~.actions.FreeRelays`). A ring with no room sends the frames.
* Events: a partition's UPDATE goes out on two topics, ``r`` + p for subscribers that read
  shared memory (as the shard sent it: references into its board, or frames) and ``p`` + p for
  the others (board blocks copied out first). Which topics have subscribers is learnt from the
  XPUB's subscription notices, so nothing is copied for nobody.
* Sweeping: the segments of this cluster's dead processes are found every
  :data:`SWEEP_EVERY` seconds and at exit, and removed unless something may still read them:
  a dead client's ring segment stays while an entry that references it is queued or in a batch
  a replica has not applied (or a push held for a bsp step names it), and goes at the first
  tick after that (:class:`~.ring_refs.RingRefs`), whatever other clients have in flight.
  Rings (a dead broker's relay ring, dead clients') stay until the broker recovered (every
  shard registered again, or the recovery grace ended): a shard may still hold a batch that a
  broker which died sent it, naming them. Segments removed are unmapped here too (the memory
  of a mapped segment is not freed until the last mapping goes).
"""
from __future__ import annotations

import logging

import zmq

from gradbus.codecs import shm, wire
from gradbus.codecs.errors import WireError

from .actions import INLINE_REPLY, RELAY

log = logging.getLogger("gradbus.broker")

SWEEP_EVERY = 5.0          # seconds between sweeps of dead processes' segments
MATCHES_KEPT = 4096         # topics whose "followed?" answer is kept (a partition has two)


class ShmIO:
    def __init__(self, core, cluster_url: str, enabled: bool):
        self.core = core
        self.cluster = shm.cluster_tag(cluster_url)
        self.mapper = shm.Mapper()
        self.probe: shm.Segment | None = None
        self.ring: shm.Ring | None = None
        self.relayed: dict[int, list] = {}      # relay id -> the message as shards get it
        self.subscribed: set[bytes] = set()     # topics some subscriber follows
        self._matches: dict[bytes, bool] = {}   # _followed's answers since they last changed
        self.next_sweep = 0.0
        self.doomed: set[str] = set()          # dead owners' segments kept while referenced
        self.stats = core.meters.counters
        if enabled and shm.usable():
            try:
                self.probe = shm.Segment.create(self.cluster, "b", 4096)
            except OSError as e:
                log.warning("shared memory is off: %s", e)
                self.stats["shm_exhausted"] = 1
        self.rings_swept = False           # dead processes' rings: only once recovered
        if self.probe is not None:
            shm.sweep(self.cluster, roles="s")   # boards: a reader finds one gone, reads again
            core.sequencer.relaying = True     # the ring is made at the first relay
            core.shm = {"cluster": self.cluster, "seg": self.probe.name,
                        "nonce": self.probe.nonce, "host": shm.host_identity()}

    # -- sends ---------------------------------------------------------------------------------
    def to_shard(self, frames: list, inline: int, relay: int = 0) -> list | None:
        """The message for a shard as ``inline`` says (see :mod:`.actions`); None for a reply
        whose refs were torn (INLINE_REPLY)."""
        if inline == RELAY:
            return self._relay(frames, relay)
        if inline == INLINE_REPLY:
            return self.inline_reply(frames)
        out = wire.inline_refs(frames, 0, self.mapper, inline == 2)
        self.stats["shm_inlined"] += 1
        return out

    def _relay(self, frames: list, relay: int) -> list:
        """The message with its tensor frames copied into the ring (once, for every receiver
        of it), their descriptors referencing the copies; the frames when there is no room."""
        out = self.relayed.get(relay)
        if out is not None:
            return out
        if self.ring is None:    # at most what the byte cap lets the broker hold anyway
            self.ring = shm.Ring(self.cluster, self.core.settings.max_pending_bytes, role="b")
        refs = self.ring.place(relay, frames[1:])
        if refs is None:
            out = frames
            self.stats["shm_relay_full"] += 1
            if self.ring.failed is not None:     # /dev/shm refused a segment
                self.stats["shm_exhausted"] = 1
        else:
            out = wire.with_refs(frames, refs)
            self.stats["shm_relayed"] += 1
        self.relayed[relay] = out
        return out

    def inline_reply(self, frames: list) -> list | None:
        """A shard's reply (header first) with the blocks it references in the shard's reply
        area copied into its frames, for a receiver that does not read shared memory; None
        when one was rewritten, or its segment is gone, before it was read whole (the receiver
        gets a retryable answer instead, never other bytes)."""
        try:
            out = wire.inline_refs(frames, 0, self.mapper, True)
        except WireError as e:
            log.warning("shared memory: a reply's %s", e)
            out = None
        self.stats["shm_torn_inline" if out is None else "shm_replies_inlined"] += 1
        return out

    def free_relays(self, relays) -> None:
        for r in relays:
            self.relayed.pop(r, None)
        if self.ring is not None:
            self.ring.free(relays)

    def to_log(self, t_list: list, frames: list) -> tuple[list, list]:
        return wire.inline_descs(t_list, frames, self.mapper)

    def publish(self, sock: zmq.Socket, frames: list, refs: bool = False,
                keep: bool = False) -> list | None:
        """One event. A partition's UPDATE goes to each of its two topics that has
        subscribers, its board blocks (``refs``: it came from a shard that may reference its
        board) copied into frames for the ``p`` one; every other event as it is. ``keep``:
        the UPDATE is also cached for conflated delivery: returns it with its board blocks
        copied into frames (copied once for both), or None when the shard rewrote one
        before it was read whole."""
        topic = frames[0]
        if topic[:1] != b"p":
            sock.send_multipart(frames, copy=False)
            return frames
        shm_topic = b"r" + topic[1:]
        if self._followed(shm_topic):
            sock.send_multipart([shm_topic, *frames[1:]], copy=False)
        if not (keep or self._followed(topic)):
            return frames
        try:
            out = wire.inline_refs(frames, 1, self.mapper, True) if refs else frames
        except WireError as e:     # its board is gone (the shard died): as if rewritten
            log.warning("shared memory: an update's %s", e)
            out = None
        if out is None:      # the shard rewrote a block first: those subscribers re-snapshot
            self.stats["shm_torn_inline"] += 1
            return None
        if self._followed(topic):
            sock.send_multipart(out, copy=False)
        return out

    def _followed(self, topic: bytes) -> bool:
        """Some subscription matches ``topic`` (ZeroMQ matches by prefix: ``b""`` follows
        everything)."""
        hit = self._matches.get(topic)
        if hit is None:
            if len(self._matches) >= MATCHES_KEPT:
                self._matches.clear()
            subs = self.subscribed
            hit = self._matches[topic] = any(topic[:n] in subs for n in range(len(topic) + 1))
        return hit

    def subscription(self, notice: bytes) -> None:
        """An XPUB notice: ``\\x01`` + topic (a first subscriber) or ``\\x00`` + topic (the
        last one left)."""
        if notice[:1] == b"\x01":
            self.subscribed.add(notice[1:])
        elif notice[:1] == b"\x00":
            self.subscribed.discard(notice[1:])
        self._matches.clear()

    # -- housekeeping --------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.probe is None:
            return
        if self.doomed:
            self._remove(self._unneeded(self.doomed))
        if now < self.next_sweep:
            return
        self.next_sweep = now + SWEEP_EVERY
        self._sweep()

    def _unneeded(self, names) -> list[str]:
        """Of dead owners' segments, those nothing queued or in flight references; the others
        are kept (and looked at again every tick)."""
        rings = self.core.sequencer.rings
        held = self.core.consistency.ring_segments() if self.core.consistency.barriers else ()
        out = []
        for name in names:
            if rings.referenced(name) or name in held:
                if name not in self.doomed:
                    self.doomed.add(name)
                    self.stats["shm_sweep_kept"] += 1
            else:
                out.append(name)
        return out

    def _remove(self, names) -> None:
        removed = shm.remove(names)
        self.doomed.difference_update(names)
        self.core.sequencer.rings.removed(removed)
        self.stats["shm_swept"] += len(removed)
        if removed:
            self.mapper.prune(0.0)

    def _sweep(self) -> None:
        if not self.core.recovery.recovered():
            # a shard may still hold batches a dead broker sent, naming that broker's ring or
            # clients' rings: they stay until every shard registered again (it drained them)
            roles = "s"
        else:
            roles = "wsb"
        dead = [n for n in shm.dead_segments(self.cluster, roles) if n != self.probe.name]
        self._remove(self._unneeded(dead))
        if "b" in roles and not self.rings_swept:
            self.rings_swept = True
            # other clusters with no live process left (a broker restarted on another port)
            self.stats["shm_swept"] += len(shm.sweep_abandoned(keep={self.probe.name}))

    def close(self) -> None:
        self.mapper.close()
        self.relayed.clear()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.probe is not None:
            self.probe.close()
            self.probe = None
            shm.sweep(self.cluster)
