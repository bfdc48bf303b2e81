"""The client's side of shared memory: its push ring and its reads of shards' weights boards.

A client takes up the broker's offer (WELCOME ``shm``) when it can open the broker's probe
segment (:func:`gradbus.codecs.shm.accept`); then a push's encoded tensors are copied into
slots of its ring and the PUSH carries references, each slot held until the broker's FREE for
that push; the partitions it follows are read on the ``r`` topics, whose UPDATEs may reference
shards' boards. A ring with no room for a push sends that push as frames, as a client without
shared memory does.
"""
from __future__ import annotations

import numpy as np

from gradbus.codecs import shm, wire

RING_SLACK = 1.5     # ring bytes per byte of credit window: slots wait for FREE after the ACK


class ClientShm:
    def __init__(self, cluster: str, window_bytes: int):
        self.cluster = cluster
        self.ring = shm.Ring(cluster, int(window_bytes * RING_SLACK) + shm.MIN_RING_SEGMENT)
        self.mapper = shm.Mapper()

    @classmethod
    def offered(cls, welcome: dict, wanted: bool, window_bytes: int) -> ClientShm | None:
        """``welcome``: the WELCOME header (a dict, as ``net.hello`` returns it)."""
        if not wanted:
            return None
        cluster = shm.accept(welcome.get("shm"))
        if cluster is None:
            return None
        try:
            return cls(cluster, window_bytes)
        except OSError:      # no room even for the first segment: logged, frames then
            return None

    def place(self, msg: int, descs: list, bufs: list) -> list:
        """The frames of push ``msg``: empty where its bytes went into the ring (its
        descriptors then carry the refs), the buffers themselves when the ring is full."""
        refs = self.ring.place(msg, bufs)
        if refs is None:     # frames after all: never the caller's own memory (not detached)
            return [b.copy() if isinstance(b, np.ndarray) and not b.flags.owndata else b
                    for b in bufs]
        for d, ref in zip(descs, refs):
            d["r"] = ref
        return [b""] * len(bufs)

    def free(self, msgs) -> int:
        return self.ring.free(msgs)

    def resolve(self, h, frames: list) -> bool:
        """An UPDATE's board blocks copied into its frames; False when one was rewritten
        before it was read (a later update, or a snapshot, brings it)."""
        return wire.resolve_refs(h.t, frames, self.mapper)

    def close(self) -> None:
        self.mapper.close()
        self.ring.close()
