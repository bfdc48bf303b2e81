"""A broker tier member's side of moving names between members (protocol section 24.4).

The mover (``gradbus tier``, :mod:`gradbus.tier_admin`) moves a set of home partitions H from
member A to member B in steps, each an ADMIN ``tier`` request (or an INIT carrying ``imp`` or
``drop``) this module answers:

1. ``map`` to B with the new map and ``incoming`` H: B takes the map; names of H get
   RECOVERING (clients send again) until step 5.
2. ``fence`` to A with the new map: A takes it (names of H get MOVED from now on, nothing of
   such a write kept) and answers once every push and init of those names it accepted before
   is settled, with the names and the partitions holding their keys.
3. ``export`` to A, per partition: A's primary for it exports the names' blocks and rows
   (values, optimizer state, versions), which A hands to the mover as the shard's STATE.
4. An INIT with ``imp`` to B: the exported state, sequenced into B's partitions as init
   entries carrying it (every replica applies them in order; acknowledged when all did).
5. ``commit`` to B: H is B's; then ``map`` to every other member.
6. An INIT with ``drop`` to A: the names' keys are forgotten, in order, on every replica.

A step repeated is harmless (a map of the same version, an export again, an import that
replaces the same blocks), so a mover that died is finished by running it again.
"""
from __future__ import annotations

import logging

from gradbus.codecs import specs, wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import (
    TensorLayout,
    partition_of,
    row_key,
    split_key,
    split_row_key,
    table_partitions,
)
from gradbus.codecs.tier import TierMap, name_of

from .actions import Publish, ToClient, ToShard
from .settlement import ALL, Pending

log = logging.getLogger("gradbus.broker")


def _bad(msg: str):
    return WireError(Code.BAD_REQUEST, f"tier: {msg}")


def _int_list(v, what: str) -> list[int]:
    if type(v) is not list or not all(type(x) is int for x in v):
        raise _bad(f"{what} must be a list of ints")
    return v


class TierMoves:
    def __init__(self, core):
        self.core = core
        self.fences: list[tuple[bytes, int, frozenset]] = []   # fenced, waiting to drain
        self.exports: dict[int, bytes] = {}    # STATE_REQ req -> the mover waiting for it

    # ------------------------------------------------------------------ ADMIN tier
    def admin(self, identity: bytes, m) -> list:
        gate, a, req = self.core.tier, m.args, m.req
        if gate.tier is None:
            raise _bad("this broker is not a tier member")
        step = a.get("step")
        if step in ("map", "fence"):
            try:
                tm = TierMap.from_wire(a.get("map"))
            except ValueError as e:
                raise _bad(str(e)) from None
            incoming = _int_list(a.get("incoming", []), "incoming")
            gate.adopt(tm, incoming)
            out = [Publish(self.core.table.message())]
            if step == "map":
                return out + [self._reply(identity, req, version=gate.tier.version)]
            self.fences.append((identity, req, frozenset(self._leaving())))
            return out + self.drained()
        if step == "export":
            return self._export(identity, req, a)
        if step == "commit":
            gate.commit(_int_list(a.get("homes"), "homes"))
            return [Publish(self.core.table.message()),
                    self._reply(identity, req, version=gate.tier.version)]
        raise _bad(f"unknown step {step!r}")

    def _reply(self, identity: bytes, req: int, **result) -> ToClient:
        return ToClient(identity, [wire.pack(wire.ADMIN_REPLY, req=req, result=result)])

    def _leaving(self) -> list[str]:
        """The names this member's catalog holds that its map gives another member."""
        cat, gate = self.core.catalog, self.core.tier
        return [n for n in (*cat.tensors, *cat.tables) if not gate.owns(n)]

    def drained(self) -> list:
        """The fences whose names nothing accepted is still settling for: answered now."""
        if not self.fences:
            return []
        pending = self.core.settlement.pending.values()
        busy = set()
        for pend in pending:
            busy.update(pend.names, pend.tables, pend.reply.get("created", ()))
        for b in self.core.consistency.barriers.values():    # held for a bsp step
            for _, _, routed, _ in b["held"]:
                busy.update(n for (_, _, _, n) in routed)
        out, left = [], []
        for identity, req, names in self.fences:
            if busy & names:
                left.append((identity, req, names))
                continue
            out.append(self._reply(identity, req, version=self.core.tier.tier.version,
                                   **self._holdings(names)))
        self.fences = left
        return out

    def _holdings(self, names) -> dict:
        """The fenced names as the mover needs them: each tensor's catalog entry and table's
        settings, and the partitions holding their keys."""
        cat, P = self.core.catalog, self.core.P
        tensors, tables, parts = [], [], set()
        for n in sorted(names):
            t = cat.tensors.get(n)
            if t is not None:
                tensors.append({**t.layout.to_wire(), "opt": t.opt, "cons": t.cons})
                parts.update(partition_of(k, P) for k in t.layout.block_keys())
            tb = cat.tables.get(n)
            if tb is not None:
                tables.append({"name": n, **tb.cfg, "version": tb.version})
                parts.update(table_partitions(n, P, tb.cfg["spread"]).tolist())
        return {"tensors": tensors, "tables": tables, "parts": sorted(parts)}

    def _export(self, identity: bytes, req: int, a: dict) -> list:
        p, names = a.get("p"), a.get("names")
        if type(p) is not int or not 0 <= p < self.core.P:
            raise _bad("export needs p, a partition")
        if type(names) is not list or not all(type(n) is str for n in names):
            raise _bad("export needs names, a list of strings")
        if any(self.core.tier.owns(n) for n in names):
            raise _bad("export of names this member still holds: fence them first")
        sid = self.core.table.live_owner(f"partition {p}", p)
        self.exports[req] = identity
        s = self.core.members.shards[sid]
        return [ToShard(s.identity, [wire.pack(wire.STATE_REQ, p=p, to="", names=names,
                                               req=req)])]

    def exported(self, m, frames: list) -> list | None:
        """A shard's STATE answering an export: to the mover that asked (None: not one)."""
        identity = self.exports.pop(m.req, None) if m.req is not None else None
        if identity is None:
            return None
        return [ToClient(identity, frames)]

    # ------------------------------------------------------------------ INIT imp / drop
    def init(self, client, h, frames: list) -> list:
        """An INIT carrying ``imp`` (exported state to take in) or ``drop`` (names to
        forget): sequenced; INIT_OK once every replica applied it."""
        core = self.core
        if core.tier.tier is None:
            raise _bad("this broker is not a tier member")
        ref = (client.identity, h.msg)
        n = self._import(h, frames, ref) if h.imp is not None else self._drop(h.drop, ref)
        done = sorted({name_of(k) for k in n})
        if not n:
            return core.settlement.reply(client, h.msg, [wire.pack(
                wire.INIT_OK, msg=h.msg, created=[], existing=done)])
        core.settlement.expect(Pending(client.identity, h.msg, "init", len(n), acks=ALL,
                                       reply={"created": done, "existing": []}), client)
        return [Publish(core.table.message())]

    def _import(self, h, frames: list, ref) -> list[str]:
        core, gate = self.core, self.core.tier
        imp, descs = h.imp, h.t
        if type(imp) is not list or len(imp) != len(descs) or len(frames) != len(descs):
            raise _bad("imp names one frame per entry")
        plan = []
        for ent, raw in zip(imp, descs):
            key = ent.get("key") if type(ent) is dict else None
            if type(key) is not str or not isinstance(ent.get("st"), dict):
                raise _bad("an imp entry is a map with key and st")
            name = name_of(key)
            if not gate.incoming_name(name):
                raise _bad(f"{name!r} is not moving to this member")
            plan.append((key, name, ent, raw))
        keys = []
        for (key, name, ent, raw), fr in zip(plan, frames):
            entry = {"op": "init", "key": key, "opt": ent.get("opt"), "st": ent["st"],
                     "rule": {"name": "given"}}
            rk = split_row_key(key)
            if rk is not None:
                p = rk[1]
                entry["table"] = ent.get("table")
                self._learn_table(name, ent)
            else:
                layout = TensorLayout.from_wire(ent.get("layout"))
                p = partition_of(key, core.P)
                entry["layout"] = ent["layout"]
                self._learn_block(key, layout, ent)
            core.table.place(p)
            if rk is None:
                core.table.account(p, layout.block_bytes(split_key(key)[1]))
            core.sequencer.enqueue(p, entry, raw, fr, ref)
            keys.append(key)
        return keys

    def _learn_block(self, key: str, layout, ent: dict) -> None:
        cat = self.core.catalog
        t = cat.tensors.get(layout.name)
        if t is None:
            try:
                cons = specs.consistency_from_wire(ent.get("cons"))
            except ValueError as e:
                raise _bad(f"{layout.name}: cons {e}") from None
            cat.add_tensors([layout], ent.get("opt"), cons)
            t = cat.tensors[layout.name]
        t.versions[split_key(key)[1]] = int(ent["st"].get("version", 0))

    def _learn_table(self, name: str, ent: dict) -> None:
        cat = self.core.catalog
        if name not in cat.tables:
            cat.add_table(name, ent.get("table"))
        tbl = cat.tables[name]
        tbl.base = max(tbl.base, int(ent.get("version", 0)) - tbl.applied)

    def _drop(self, names, ref) -> list[str]:
        core, gate, cat = self.core, self.core.tier, self.core.catalog
        if type(names) is not list or not all(type(n) is str for n in names):
            raise _bad("drop names a list of strings")
        if any(gate.owns(n) for n in names):
            raise _bad("drop of names this member holds")
        keys = []
        for n in names:
            t = cat.tensors.pop(n, None)
            if t is not None:
                for i, key in enumerate(t.layout.block_keys()):
                    p = partition_of(key, core.P)
                    core.table.account(p, -t.layout.block_bytes(i))
                    core.sequencer.enqueue(p, {"op": "drop", "key": key}, None, None, ref)
                    keys.append(key)
            tb = cat.tables.pop(n, None)
            if tb is not None:
                for p in table_partitions(n, core.P, tb.cfg["spread"]).tolist():
                    key = row_key(n, p)
                    core.sequencer.enqueue(p, {"op": "drop", "key": key}, None, None, ref)
                    keys.append(key)
        return keys

