"""The shard loop's side of shared memory: taking up the broker's offer, reading clients' push
rings, and the weights board its publisher writes into.

The shard says in REGISTER whether it can read the broker's shared memory (it opened the probe
the WELCOME named); the broker's REGISTERED says whether it will send it references and take
references to weights from it. Only then does the publisher write blocks into a board (and
only then does the shard sweep the boards of dead shards of its cluster; when it stops, dead
brokers' segments too: a broker that was SIGKILLed leaves its probe and relay ring, which
nobody else would remove).

Replies: a SNAPSHOT, ROWS or STATE_REQ the broker marks ``shm`` (the one who gets the reply
reads shared memory) is answered with its tensors in the shard's reply area
(:class:`~gradbus.codecs.shm.ReplyArea`, at most ``$GRADBUS_SHM_REPLY_MB`` MiB, made at the
first such reply) and refs in place of frames (:func:`place_reply`); a reply that does not fit
goes as frames. A STATE whose refs were rewritten before this shard read them whole is not
installed: the server answers ``SHM_TORN`` and the broker asks the primary again.
"""
from __future__ import annotations

import logging
import os

from gradbus.codecs import shm, wire
from gradbus.codecs.errors import WireError

log = logging.getLogger("gradbus.shard")

PRUNE_EVERY = 5.0     # seconds between looks for peers' segments that are gone
PRUNE_IDLE = 30.0     # ... and not read for this long: unmapped


def reply_cap(value: int | None = None) -> int:
    """The reply area's cap in bytes: ``value``, else ``$GRADBUS_SHM_REPLY_MB`` MiB, else
    :data:`~gradbus.codecs.shm.REPLY_CAP` (0: replies always go as frames)."""
    if value is not None:
        return max(0, int(value))
    env = os.environ.get("GRADBUS_SHM_REPLY_MB")
    if env:
        try:
            return max(0, int(float(env) * (1 << 20)))
        except ValueError:
            raise ValueError(f"GRADBUS_SHM_REPLY_MB must be a number, not {env!r}") from None
    return shm.REPLY_CAP


def place_reply(area, descs: list, bufs: list, stats: dict, fresh: bool = False) -> list:
    """A reply's tensor frames: empty, their bytes in ``area`` and each descriptor's ``r`` set,
    or, with no area or no room in it, the buffers as frames (copies unless ``fresh``: they
    may alias the shard's live values, and frames go out later) with their checksums (an
    area's readers do not need them)."""
    if area is None or not bufs:
        return bufs
    refs = area.place(bufs)
    if refs is not None:
        for d, ref in zip(descs, refs):
            d["r"] = ref
        stats["shm_replies"] = stats.get("shm_replies", 0) + 1
        return [b""] * len(bufs)
    stats["shm_replies_full"] = stats.get("shm_replies_full", 0) + 1
    out = []
    for d, buf in zip(descs, bufs):
        if not fresh:
            buf = bytes(memoryview(buf).cast("B"))
        d["x"] = wire.checksum(buf)
        out.append(buf)
    return out


class ShardShm:
    def __init__(self, enabled: bool, reply_bytes: int | None = None, pins=None):
        """``pins``: a GPU backend's :class:`~.transfers.HostPins`: the clients' rings this
        shard maps are pinned while mapped (its board is pinned as it publishes)."""
        self.enabled = enabled
        self.cluster: str | None = None     # the broker's offer this shard can take up
        self.pins = pins
        self.mapper = shm.Mapper() if pins is None else shm.Mapper(
            on_open=lambda seg: pins.pin(seg.view, read_only=True),
            on_close=lambda seg: pins.unpin(seg.view))
        self.board: shm.Board | None = None
        self.replies: shm.ReplyArea | None = None
        self.reply_cap = reply_cap(reply_bytes) if enabled else 0
        self.stats = {"shm_unreadable": 0}

    def welcome(self, welcome: dict) -> None:
        self.cluster = shm.accept(welcome.get("shm")) if self.enabled else None

    def register_fields(self) -> dict:
        return {"shm": True} if self.cluster is not None else {}

    def registered(self, head, publisher) -> None:
        """REGISTERED (typed): the broker's answer to this shard's offer to read shared
        memory."""
        if head.shm and self.cluster is not None:
            if self.board is None:
                # dead shards' boards (a reader finds one gone and reads again), never rings:
                # another shard may still hold a batch naming a dead broker's ring
                shm.sweep(self.cluster, roles="s")
                self.board = shm.Board(self.cluster)
            if self.replies is None and self.reply_cap:
                self.replies = shm.ReplyArea(self.cluster, self.reply_cap,
                                             min(shm.MIN_REPLY_SEGMENT, self.reply_cap))
            publisher.board = self.board if self.board.failed is None else None
            publisher.replies = self.replies
        else:
            publisher.board = publisher.replies = None

    def prune(self) -> None:
        """Unmap peers' segments that are gone and unused for ``PRUNE_IDLE`` seconds (the rings
        of clients that closed or died): no batch in flight can still name one."""
        n = self.mapper.prune(PRUNE_IDLE)
        if n:
            self.stats["shm_unmapped"] = self.stats.get("shm_unmapped", 0) + n

    def resolve(self, t: list, frames: list) -> bool:
        """The bytes a message from the broker references in clients' rings (or in a shard's
        reply area: a STATE), in its frames (in place). A ring that cannot be read leaves
        zeros there: the checksum refuses the entry, on every replica alike. False when a reply
        area's block was rewritten (or is gone) before it was read whole."""
        tensors = frames[1:]
        ok = wire.resolve_refs(t, tensors, self.mapper, self._unreadable)
        frames[1:] = tensors
        return ok

    def _unreadable(self, err: WireError, n: int) -> bytes:
        self.stats["shm_unreadable"] += 1
        log.warning("shared memory: %s", err)
        return bytes(n)

    def close(self) -> None:
        self.mapper.close()
        if self.board is not None:
            for arena in self.board.arenas if self.pins is not None else ():
                self.pins.unpin(arena.seg.view)
            self.board.close()
            self.board = None
        if self.replies is not None:
            self.replies.close()
            self.replies = None
        if self.cluster is not None:     # a dead broker's probe, dead shards' boards
            shm.sweep(self.cluster, roles="sb")
