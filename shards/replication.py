"""A partition's whole state moving between replicas: export (STATE for a catching-up
standby, or a checkpoint), install, the batches held back while a standby catches up, DROP,
and what REGISTER and DIGEST report about the partitions held.

A standby catches up on partition ``p`` in three steps: ADOPT (batches for ``p`` are held, in
order, from then on), STATE (the primary's export at seq S replaces ``p``; the held batches
after S are applied) and SYNCED back to the broker. An exported state installed anywhere
equals the exporter's state as of its seq, so replicas stay bit-identical.
"""
from __future__ import annotations

import logging

import numpy as np

from gradbus.codecs import wire
from gradbus.codecs.messages import StateRows
from gradbus.codecs.partition import split_row_key
from gradbus.codecs.tier import name_of

from .imports import put_block, put_table
from .publish import host_copy
from .shm_io import place_reply
from .store import ParameterStore

log = logging.getLogger("gradbus.shard")


class Replication:
    """Owns the partitions being caught up on (``installing``: partition -> the batch parts
    held back since ADOPT, in order)."""

    def __init__(self, store: ParameterStore, backend, counters: dict, *, max_tensor_bytes: int,
                 forget):
        self.store = store
        self.backend = backend
        self.stats = counters          # the shard's counters (shared with the other parts)
        self.max_tensor_bytes = max_tensor_bytes
        self._forget = forget          # called with the keys of blocks dropped
        self.installing: dict[int, list] = {}

    # -- catching up -------------------------------------------------------------------------
    def adopt(self, p: int) -> None:
        """ADOPT: batches for ``p`` are held from now until its state is installed."""
        self.installing[p] = []

    def hold(self, part, descs, frames) -> bool:
        """Keep a batch part for a partition being caught up on; False when it is not one."""
        held = self.installing.get(part.p)
        if held is None:
            return False
        # bytes read from a client's ring are its until the batch is applied by the in-sync
        # replicas, which do not wait for this one: keep a copy
        frames = [bytes(f) if type(f) is memoryview else f for f in frames]
        held.append((part, descs, frames))
        return True

    def install(self, h, descs, frames, apply) -> list:
        """Replace partition ``p`` with the state a primary exported at seq S (a typed STATE),
        then apply (with ``apply(part, descs, frames)``) the batches held back since ADOPT that
        come after S; answer SYNCED."""
        p = h.p
        held = self.installing.pop(p, None)
        if held is None:
            log.warning("state for partition %d that was not adopted: ignored", p)
            return []
        seq = self.install_state(h, descs, frames)
        for part, bdescs, bframes in held:
            if part.seq > seq:
                apply(part, bdescs, bframes)
        self.stats["syncs"] += 1
        return [[wire.pack(wire.SYNCED, p=p, seq=self.store.partition(p).seq)]]

    def drop(self, ps) -> None:
        """DROP: forget these partitions (moved elsewhere), caught up on or not."""
        for p in ps:
            self.installing.pop(p, None)
            self._forget(self.store.drop(p))
            self.stats["dropped"] += 1

    # -- export and install ------------------------------------------------------------------
    def export(self, p: int, to: str, area=None, names=None, req: int | None = None) -> list:
        """The whole state of partition ``p`` (values, optimizer state, versions, seq) for the
        standby ``to``: installed there, it equals this shard's state as of this seq. With
        ``area`` (a reply area: the standby reads shared memory) the bytes go there when they
        fit; a checkpoint's states never do. ``names`` (a tier move's export, answering
        request ``req``): only the blocks and rows of these tensors and tables."""
        pst = self.store.partition(p)
        frames = area is None
        metas, descs, bufs = [], [], []
        keep = (lambda key: True) if names is None else (lambda key: name_of(key) in names)
        for key in sorted(k for k in pst.keys if keep(k)):
            blk = self.store.blocks[key]
            arrays = sorted(k for k, v in blk.state.items() if not isinstance(v, (int, float)))
            scalars = {k: v for k, v in blk.state.items() if isinstance(v, (int, float))}
            metas.append({"key": key, "layout": blk.layout.to_wire(), "opt": blk.opt,
                          "version": blk.version, "arrays": arrays, "scalars": scalars})
            for _name, arr in [("", blk.newest)] + [(a, blk.state[a]) for a in arrays]:
                host = host_copy(self.backend, arr) if frames else self.backend.to_host(arr)
                d, buf = wire.encode_tensor(key, host, "raw", hashed=frames)
                descs.append(d)
                bufs.append(buf)
        for key in sorted(k for k in pst.tables if keep(k)):
            scalars, arrays = self.store.tables[key].export()
            metas.append({"key": key, "table": self.store.tables[key].cfg, "scalars": scalars,
                          "arrays": [name for name, _ in arrays]})
            for _, arr in arrays:
                d, buf = wire.encode_tensor(key, np.ascontiguousarray(arr), "raw", hashed=frames)
                descs.append(d)
                bufs.append(buf)
        bufs = place_reply(area, descs, bufs, self.stats)
        self.stats["states_sent"] += 1
        extra = {} if req is None else {"req": req}
        return [wire.pack(wire.STATE, descs, p=p, to=to, seq=pst.seq, epoch=pst.epoch,
                          blocks=metas, recent=[list(r) for r in pst.recent], **extra), *bufs]

    def install_state(self, h, descs, frames) -> int:
        """Replace partition ``h.p`` with an exported state (a typed STATE, from a primary or a
        checkpoint); returns its seq."""
        p, seq, epoch = h.p, h.seq, h.epoch
        self._forget(self.store.drop(p))
        pst = self.store.partition(p)
        pos = 0
        for meta in h.blocks:
            n = meta.nframes
            if type(meta) is StateRows:
                # bytes copied out of a reply area under matching stamps are not hashed again
                arrs = {name: np.array(wire.decode_tensor(d, f, self.max_tensor_bytes,
                                                          verify=d.ref is None))
                        for name, d, f in zip(meta.arrays, descs[pos:pos + n],
                                              frames[pos:pos + n])}
                pos += n
                put_table(self.store, meta.key, p, meta.table, meta.scalars, arrs)
                continue
            arrs = [wire.decode_tensor(d, f, self.max_tensor_bytes, verify=d.ref is None)
                    for d, f in zip(descs[pos:pos + n], frames[pos:pos + n])]
            pos += n
            put_block(self.store, self.backend, meta.key, p, meta.layout, meta.opt, arrs,
                      meta.arrays, meta.scalars, meta.version)
        pst.seq, pst.epoch = seq, epoch
        for r in h.recent:
            pst.recent[r] = None
        return seq

    def states(self) -> list[list]:
        """Every settled partition's STATE message (for a checkpoint)."""
        return [self.export(p, "") for p in self.settled()]

    def settled(self) -> list[int]:
        """The partitions held and not being caught up on, in order."""
        return [p for p in sorted(self.store.partitions) if p not in self.installing]

    # -- what the broker is told -------------------------------------------------------------
    def holdings(self) -> dict:
        """What REGISTER tells the broker: the partitions held with their (epoch, seq), and
        the tensors and block versions they hold, so a restarted broker can rebuild its
        table and catalog from its shards."""
        st = self.store.partitions
        ps = self.settled()
        tensors, blocks = {}, []
        for p in ps:
            for key in sorted(st[p].keys):
                blk = self.store.blocks[key]
                tensors.setdefault(blk.layout.name, {**blk.layout.to_wire(), "opt": blk.opt})
                blocks.append([key, blk.version])
            for key in sorted(st[p].tables):
                tbl, name = self.store.tables[key], split_row_key(key)[0]
                tensors.setdefault(name, {"name": name, "table": tbl.cfg})
                blocks.append([key, tbl.version])
        return {"holds": [[p, st[p].epoch, st[p].seq] for p in ps],
                "tensors": list(tensors.values()), "blocks": blocks}

    def partition_digest(self, p: int) -> str:
        """A hash of partition ``p``: every block's value, version and optimizer state, and
        every table's rows."""
        import xxhash
        hsh = xxhash.xxh3_64()
        pst = self.store.partitions.get(p)
        for key in sorted(pst.keys if pst else ()):
            blk = self.store.blocks[key]
            hsh.update(key.encode())
            hsh.update(blk.version.to_bytes(8, "little"))
            hsh.update(self.backend.to_host(blk.newest).tobytes())
            for name in sorted(blk.state):
                v = blk.state[name]
                hsh.update(name.encode())
                hsh.update(repr(v).encode() if isinstance(v, (int, float))
                           else self.backend.to_host(v).tobytes())
        for key in sorted(pst.tables if pst else ()):
            hsh.update(key.encode())
            self.store.tables[key].digest_into(hsh)
        return hsh.hexdigest()

    def digest_reply(self, h, shard_id: str) -> list:
        """DIGEST: each settled partition asked for (all when none are named) with its seq
        and :meth:`partition_digest`."""
        ps = sorted(self.store.partitions) if h.ps is None else [
            p for p in h.ps if p in self.store.partitions]
        parts = [[p, self.store.partitions[p].seq, self.partition_digest(p)] for p in ps
                 if p not in self.installing]
        fields = {k: v for k in ("client", "of") if (v := getattr(h, k)) is not None}
        return [wire.pack(wire.DIGEST_REPLY, req=h.req, shard=shard_id, parts=parts,
                          **fields)]

    def validate(self) -> None:
        """Held batch parts belong to the partition they are held for."""
        for p, held in self.installing.items():
            if not isinstance(p, int):
                raise AssertionError(f"partition being caught up on is not an int: {p!r}")
            for part, _, _ in held:
                if getattr(part, "p", None) != p:   # a typed BatchPart of partition p
                    raise AssertionError(f"a part for partition {getattr(part, 'p', part)!r} "
                                         f"held for {p}")
