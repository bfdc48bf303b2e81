"""Flow control at the frontend: the byte cap on the tensor data the broker holds, checked per
message before the core sees it.

The loop reads the frontend all the time, also at the cap, so ops requests (STATUS, HELLO,
CATALOG, ...) and small control messages are answered while producers are held back, and
nothing piles up in libzmq's receive queues. A PUSH or INIT whose tensor frames would take the
bytes held (queued for shards, plus batches not yet applied: ``Sequencer.held_bytes``) past
``max_pending_bytes`` is answered at once with ``ERROR BUSY`` carrying its ``msg`` and its
frames are let go: nothing of it is kept or remembered, and the producer sends it again after a
back-off. A message alone above the cap goes when nothing else is held. A resend of a ``msg``
the broker already holds or answered goes to the core, whose duplicate window drops it or
answers it again without holding its frames.

This keeps the bound ``held_bytes <= max(max_pending_bytes, one message)``, whatever the
producers do (a raw DEALER ignoring its window included).
"""
from __future__ import annotations

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError

from .actions import ToClient

HELD_BACK = frozenset({wire.PUSH, wire.INIT})     # the kinds whose frames the broker keeps


class ByteCap:
    """Wraps the core's ``on_frontend`` (same signature): a refusal, or the core's answer."""

    def __init__(self, core, on_frontend):
        self.core = core
        self.on_frontend = on_frontend
        self.cap = core.settings.max_pending_bytes
        self.sequencer = core.sequencer
        self.counters = core.meters.counters

    def __call__(self, identity: bytes, frames: list, now: float, *args, **kw) -> list:
        refused = self.refuse(identity, frames) if len(frames) > 1 else None
        if refused is not None:
            return refused
        return self.on_frontend(identity, frames, now, *args, **kw)

    def refuse(self, identity: bytes, frames: list) -> list | None:
        """ERROR BUSY for a push or init the cap has no room for, else None (the core's)."""
        held = self.sequencer.held_bytes
        if not held:
            return None
        size = sum(wire.frame_len(f) for f in frames[1:])
        if held + size <= self.cap:
            return None
        try:
            h = wire.unpack_header(frames[0], wire.FRONTEND_KINDS)
        except WireError:
            return None                     # the core refuses it, with the right code
        msg = h.get("msg")
        if h["kind"] not in HELD_BACK or type(msg) is not int:
            return None
        client = self.core.members.clients.get(identity)
        if client is not None and msg in client.seen:
            return None                     # a resend: dropped or answered again, not held
        self.counters["busy"] += 1
        return [ToClient(identity, [wire.error(
            Code.BUSY, f"the broker holds {held} B of tensor data (cap {self.cap} B): "
                       f"send again later", msg=msg)])]
