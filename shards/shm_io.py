"""The shard loop's side of shared memory: taking up the broker's offer, reading clients' push
rings, and the weights board its publisher writes into.

The shard says in REGISTER whether it can read the broker's shared memory (it opened the probe
the WELCOME named); the broker's REGISTERED says whether it will send it references and take
references to weights from it. Only then does the publisher write blocks into a board (and
only then does the shard sweep the boards of dead shards of its cluster; when it stops, dead
brokers' segments too: a broker that was SIGKILLed leaves its probe and relay ring, which
nobody else would remove).
"""
from __future__ import annotations

import logging

from gradbus.codecs import shm, wire
from gradbus.codecs.errors import WireError

log = logging.getLogger("gradbus.shard")


class ShardShm:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.cluster: str | None = None     # the broker's offer this shard can take up
        self.mapper = shm.Mapper()
        self.board: shm.Board | None = None
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
            publisher.board = self.board if self.board.failed is None else None
        else:
            publisher.board = None

    def resolve(self, t: list, frames: list) -> None:
        """The bytes a message from the broker references in clients' rings, in its frames (in
        place). A ring that cannot be read leaves zeros there: the checksum refuses the entry,
        on every replica alike."""
        tensors = frames[1:]
        wire.resolve_refs(t, tensors, self.mapper, self._unreadable)
        frames[1:] = tensors

    def _unreadable(self, err: WireError, n: int) -> bytes:
        self.stats["shm_unreadable"] += 1
        log.warning("shared memory: %s", err)
        return bytes(n)

    def close(self) -> None:
        self.mapper.close()
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.cluster is not None:     # a dead broker's probe, dead shards' boards
            shm.sweep(self.cluster, roles="sb")
