"""Settlement and the duplicate window: the pushes and inits waiting for their blocks to be
applied, when a batch's replies settle them (acks=1: the primary applied; acks=all: every
in-sync replica did), and the answer to a msg id seen before.

Settling a push returns :class:`~.actions.Acked`; the core folds those into one ACK message per
client per step. Errors and INIT_OK replies are :class:`~.actions.ToClient`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gradbus.codecs import wire

from .actions import Acked, ToClient

ALL = wire.ACKS_ALL
ACKED = "acked"     # duplicate-window marker: applied and acknowledged (with no version)


@dataclass(slots=True)
class Pending:
    """A push or init waiting for all its blocks to be applied."""
    client: bytes
    msg: int
    kind: str                      # "push" | "init"
    remaining: int
    error: tuple | None = None     # (code, message)
    reply: dict = field(default_factory=dict)
    acks: int = 1                  # 1: settled when the primary applied; ALL: every replica
    t0: float = 0.0                # when the broker received it
    tables: tuple = ()             # the tables a push carries rows of
    step: bool = False             # released by a bsp barrier
    names: tuple = ()              # the tensors a push carries gradients of


class Settlement:
    def __init__(self, settings, meters, members, catalog, table, sequencer, acked, wake_reads):
        self.settings = settings
        self.meters = meters
        self.members = members
        self.catalog = catalog
        self.table = table
        self.sequencer = sequencer
        self.acked = acked                  # the marks of what the broker answered for
        self.wake_reads = wake_reads        # () -> actions: reads a bsp step was holding
        self.pending: dict[tuple[bytes, int], Pending] = {}
        self.now = 0.0

    # ------------------------------------------------------------------ duplicates
    def replay(self, client, msg: int) -> list | None:
        """The answer to a msg id already seen (duplicate suppression), else None."""
        seen = client.seen.get(msg)
        if seen is None:
            return None
        self.meters.counters["duplicates"] += 1
        if seen == "pending":
            return []
        if seen == ACKED:
            return [ToClient(client.identity, [wire.pack(wire.ACK, msg=msg)])]
        if type(seen) is int:       # acknowledged at that version
            return [ToClient(client.identity, [wire.pack(wire.ACK, msg=msg, ver=seen)])]
        return [ToClient(client.identity, seen)]

    def remember(self, client, msg: int, value) -> None:
        client.seen[msg] = value
        if len(client.seen) > self.settings.dedupe_window:
            client.seen.popitem(last=False)

    def reply(self, client, msg: int, frames: list) -> list:
        """A reply settled at once (an INIT that creates nothing), remembered for resends."""
        self.remember(client, msg, frames)
        return [ToClient(client.identity, frames)]

    def expect(self, pend: Pending, client) -> None:
        self.pending[(pend.client, pend.msg)] = pend
        self.remember(client, pend.msg, "pending")

    def busy(self, ident: bytes) -> bool:
        """A client with something still to settle."""
        return any(ref[0] == ident for ref in self.pending)

    # ------------------------------------------------------------------ settling
    def progress(self, p: int, seq: int, b) -> list:
        """Settle what a batch's replies allow: acks=1 entries once the (current) primary
        applied it, acks=all entries once every in-sync replica did."""
        out = []
        errors = b.errors or {}
        if not b.primary_done and self.table.owners[p] not in b.waiting:
            b.primary_done = True
            self.acked.note(p, b.epoch, seq)
            for i, ref in enumerate(b.refs):
                pend = self.pending.get(ref)
                if pend is not None and pend.acks != ALL:
                    out += self.settle(ref, errors.get(i))
        if not b.waiting:
            self.sequencer.done((p, seq))
            for i, ref in enumerate(b.refs):
                pend = self.pending.get(ref)
                if pend is not None and pend.acks == ALL:
                    out += self.settle(ref, errors.get(i))
        return out

    def applied_by(self, sid: str, pred=None) -> list:
        """A replica that will not report (dead, or replaced) stops being waited for."""
        out = []
        for (p, seq), b in list(self.sequencer.inflight.items()):
            if sid in b.waiting and (pred is None or pred(p)):
                b.waiting.discard(sid)
                out += self.progress(p, seq, b)
        return out

    def fail(self, refs: list, error: tuple) -> list:
        out = []
        for ref in refs:
            out += self.settle(ref, error)
        return out

    def settle(self, ref, error) -> list:
        pend = self.pending.get(ref)
        if pend is None:
            return []
        if error and pend.error is None:
            pend.error = error
        pend.remaining -= 1
        if pend.remaining > 0:
            return []
        del self.pending[ref]
        client = self.members.clients.get(pend.client)
        for name in pend.tables:
            tbl = self.catalog.tables.get(name)
            if tbl is not None:
                tbl.applied += not pend.error
                tbl.stepping -= pend.step
        # a bsp table's step: reads waiting for it may go once it is applied
        woken = self.wake_reads() if pend.step else []
        if pend.error:
            code, message = pend.error
            self.meters.errors[str(code)] += 1
            if client is not None:
                client.errors[str(code)] += 1     # e.g. NOT_FINITE per client
            reply = [wire.error(code, message, msg=pend.msg)]
        elif pend.kind == "push":
            self.meters.counters["pushes_applied"] += 1
            self.meters.h_ack.observe(self.now - pend.t0)
            ver = self.catalog.least_version(pend.names) if pend.names else None
            if client is not None:
                self.remember(client, pend.msg, ACKED if ver is None else ver)
            return [Acked(pend.client, pend.msg, ver), *woken]
        else:
            reply = [wire.pack(wire.INIT_OK, msg=pend.msg, **pend.reply)]
        if client is not None:
            self.remember(client, pend.msg, reply)
        return [ToClient(pend.client, reply), *woken]

    def validate_state(self) -> list[str]:
        problems = []
        for ref, pend in self.pending.items():
            if pend.remaining <= 0:
                problems.append(f"{ref} settled but still pending")
            if pend.acks not in (1, ALL):
                problems.append(f"{ref} waits for acks={pend.acks}")
        return problems
