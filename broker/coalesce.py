"""The one step after every event of the broker's core: the pushes acknowledged in it become
one ACK message per client, and the shared-memory slots freed in it are named there (or in a
FREE)."""
from __future__ import annotations

from gradbus.codecs import hops, wire

from .actions import AckClient, Acked, FreeRelays, ToClient


class Coalesce:
    def __init__(self, sequencer, meters):
        self.sequencer, self.meters = sequencer, meters

    def __call__(self, actions: list) -> list:
        """The one step after every event: the pushes acknowledged in it become one ACK
        message per client, ``{"msg": first, "msgs": [all]}`` (a send per client, not per
        push), which also names the pushes whose shared-memory slots were freed in the step
        (``free``; a client with none acknowledged gets a FREE). ACKs go first: a producer
        waits for them, subscribers for the rest."""
        freed = self._freed() if self.sequencer.freed else None
        if self.sequencer.relays_done:
            actions = [*actions, FreeRelays(tuple(self.sequencer.relays_done))]
            self.sequencer.relays_done.clear()
        if not actions and not freed:
            return actions
        acks: dict[bytes, list[Acked]] | None = None
        out = []
        for a in actions:
            if type(a) is Acked:
                if acks is None:
                    acks = {}
                acks.setdefault(a.client, []).append(a)
            else:
                out.append(a)
        if acks is None and not freed:
            return actions
        front = []
        for client, acked in (acks or {}).items():
            msgs = [a.msg for a in acked]
            if hops.ON:
                hops.stamp("ack_out", msgs)
            fields = {"msg": msgs[0]}
            if acked[0].ver is not None:
                fields["ver"] = acked[0].ver
            if len(msgs) > 1:
                fields["msgs"] = msgs
                fields["vers"] = [a.ver for a in acked]
            free = freed.pop(client, None) if freed else None
            if free:
                fields["free"] = free
            front.append(AckClient(client, [wire.pack(wire.ACK, **fields)], tuple(msgs)))
        if freed:
            out += [ToClient(c, [wire.pack(wire.FREE, msgs=m)]) for c, m in freed.items()]
        return front + out

    def _freed(self) -> dict[bytes, list[int]]:
        """The pushes whose shared-memory slots nothing needs any more, by client."""
        by_client: dict[bytes, list[int]] = {}
        for client, msg in self.sequencer.freed:
            by_client.setdefault(client, []).append(msg)
        self.sequencer.freed.clear()
        self.meters.counters["shm_freed"] += sum(map(len, by_client.values()))
        return by_client

