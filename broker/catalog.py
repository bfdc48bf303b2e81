"""The catalog: tensors (layout, optimizer, consistency, block versions) and embedding tables,
the checks of what clients name in pushes, reads and INITs, and the planning of an INIT."""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from gradbus.codecs import specs, wire
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.messages import Invalid, TensorSpec
from gradbus.codecs.partition import (
    TensorLayout,
    partition_of,
    row_partitions,
    split_key,
    split_row_key,
    table_partitions,
)

from .settings import MAX_BLOCKS_PER_TENSOR, MAX_PARAM_BYTES

log = logging.getLogger("gradbus.broker")


@dataclass(slots=True)
class Tensor:
    layout: TensorLayout
    opt: dict
    versions: dict = field(default_factory=dict)   # block index -> last version seen
    cons: dict = field(default_factory=lambda: specs.consistency_from_wire(None))

    @property
    def version(self) -> int:
        if len(self.versions) < self.layout.nblocks:
            return 0
        return min(self.versions.values())


@dataclass(slots=True)
class Table:
    """An embedding table: rows spread over every partition (key ``name#p``)."""
    name: str
    cfg: dict                                       # specs.table_from_wire
    rows: dict = field(default_factory=dict)        # p -> [rows, bytes] the primary reported
    applied: int = 0     # pushes to the table applied since this broker started ...
    base: int = 0        # ... on top of this many (learned from the shards after a restart)
    stepping: int = 0    # bsp: pushes of released steps not yet applied

    @property
    def version(self) -> int:
        """Pushes applied to the table (what staleness counts)."""
        return self.base + self.applied

    @property
    def cons(self) -> dict:
        return self.cfg["cons"]      # table_from_wire always fills it in


@dataclass(frozen=True, slots=True)
class InitPlan:
    """What an INIT creates once every check passed."""
    opt: dict
    cons: dict
    created: list
    existing: list
    blocks: list          # (layout, key, partition, (desc, raw desc, frame) | None)
    tables: list          # (name, settings)


PULSE_EVERY = 256     # INIT tensors planned between two calls of the loop's pulse


def check_finite(key: str, desc, frame, max_tensor_bytes: int) -> None:
    """NOT_FINITE when an INIT's initial values hold NaN or Inf, as a pushed gradient's do
    (nothing is created)."""
    if desc.codec == "raw":    # the frame's bytes as they are (the shard checks the checksum)
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        vals = np.frombuffer(buf, desc.dtype)
    else:
        vals = wire.decode_tensor(desc, frame, max_tensor_bytes)
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(np.add.reduce(vals, axis=None)) or bool(np.isfinite(vals).all()):
            return
    raise WireError(Code.NOT_FINITE, f"{key}: initial values hold NaN or Inf")


class Catalog:
    def __init__(self, partitions: int, settings, meters, check_recovering):
        self.P = partitions
        self.settings = settings
        self.meters = meters
        self.check_recovering = check_recovering    # (what, known elsewhere) -> None or raises
        self.tensors: dict[str, Tensor] = {}
        self.tables: dict[str, Table] = {}
        # () -> None, set by the loop: called every PULSE_EVERY tensors of an INIT's plan, so a
        # large INIT does not hold back the heartbeats shards judge the broker's liveness by
        self.pulse = None

    # ------------------------------------------------------------------ lookups
    def block(self, key: str) -> tuple[Tensor, int]:
        """The catalog entry and block index of an initialised block key, or UNKNOWN_KEY."""
        try:
            name, idx = split_key(key)
        except ValueError:
            raise WireError(Code.UNKNOWN_KEY, f"{key!r} is not a block key") from None
        t = self.tensors.get(name)
        if t is None or idx >= t.layout.nblocks:
            self.check_recovering(key, True)
            raise WireError(Code.UNKNOWN_KEY, f"{key} was never initialised")
        return t, idx

    def table(self, name) -> Table:
        """An initialised table, or UNKNOWN_KEY (RECOVERING while a restarted broker may
        still hear of it from its shards)."""
        tbl = self.tables.get(name) if isinstance(name, str) else None
        if tbl is None:
            self.check_recovering(f"table {name!r}", True)
            raise WireError(Code.UNKNOWN_KEY, f"table {name!r} was never initialised")
        return tbl

    def row_ids(self, tbl: Table, parts: list) -> None:
        """Check that every row id sent for ``tbl`` in a partition lives there (a client that
        placed rows by another rule would split a row in two). ``parts``: [(p, ids)]."""
        ids = np.concatenate([i for _, i in parts]) if len(parts) > 1 else parts[0][1]
        want = np.repeat([p for p, _ in parts], [len(i) for _, i in parts])
        bad = np.flatnonzero(row_partitions(tbl.name, ids, self.P, tbl.cfg.get("spread", 0))
                             != want)
        if len(bad):
            raise WireError(Code.BAD_FIELD, f"{tbl.name}: row id {ids[bad[0]]} sent for "
                                            f"partition {want[bad[0]]}, which it does not "
                                            "belong to")

    def rows_of(self, d) -> tuple[Table, int]:
        """The table and partition of a pushed rows frame, checked."""
        name_p = split_row_key(d.key)
        if name_p is None:
            raise WireError(Code.BAD_FIELD, f"{d.key!r} carries row ids but is not a row key")
        tbl = self.table(name_p[0])
        cfg = tbl.cfg
        if d.dtype != cfg["dtype"] or d.shape[1] != cfg["dim"]:
            raise WireError(Code.BAD_SHAPE, f"{d.key}: rows {d.dtype}{list(d.shape)} do not "
                                            f"match {cfg['dtype']}[n, {cfg['dim']}]")
        if tcodec.parse_stages(d.codec).sparsifier is not None:
            raise WireError(Code.BAD_CODEC, f"{d.key}: rows take a dense codec chain, not "
                                            f"{d.codec!r}")
        if not 0 <= name_p[1] < self.P:
            raise WireError(Code.BAD_FIELD, f"{d.key}: partition out of range")
        return tbl, name_p[1]

    def route_push(self, descs: list, frames: list, live_owner):
        """Check a push's tensors against the catalog: ``(routed, tensors, decoded bytes)``
        with ``routed`` = [(partition, desc, frame, tensor or table name)]."""
        routed = []
        decoded = 0
        tensors: dict = {}
        rows: dict[str, list] = {}
        for d, fr in zip(descs, frames):
            if d.ids is not None:             # a table's rows for one partition
                tbl, p = self.rows_of(d)
                live_owner(d.key, p)
                routed.append((p, d, fr, tbl.name))
                rows.setdefault(tbl.name, []).append((p, d.row_ids()))
                tensors[tbl.name] = tbl
                decoded += d.shape[0] * d.shape[1] * tcodec.DTYPES[d.dtype].itemsize
                continue
            t, idx = self.block(d.key)
            start, stop = t.layout.block_range(idx)
            if d.shape != (stop - start,) or d.dtype != t.layout.dtype:
                raise WireError(Code.BAD_SHAPE, f"{d.key}: gradient {d.dtype}{list(d.shape)} does "
                                                f"not match {t.layout.dtype}[{stop - start}]")
            p = partition_of(d.key, self.P)
            live_owner(d.key, p)
            routed.append((p, d, fr, t.layout.name))
            tensors[t.layout.name] = t
            decoded += t.layout.block_bytes(idx)
        if not routed:
            raise WireError(Code.BAD_REQUEST, "push carries no tensors")
        for name, parts in rows.items():      # one vectorized check per table
            self.row_ids(self.tables[name], parts)
        return routed, tensors, decoded

    def reply(self, h) -> list:
        """The frames of a CATALOG_REPLY to a typed CATALOG (``names``: strings, or None);
        RECOVERING where names it does not know may be held by shards not registered again
        yet (a young, restarted broker)."""
        names = h.names
        if names is not None:      # a restarted broker may not have relearned them yet
            missing = [n for n in names if n not in self.tensors and n not in self.tables]
            if missing:
                self.check_recovering(f"catalog of {', '.join(missing[:4])}", True)
        sel = self.tensors if names is None else {n: self.tensors[n] for n in names
                                                  if n in self.tensors}
        tensors = [{**t.layout.to_wire(), "version": t.version, "cons": t.cons}
                   for t in sel.values()]
        tables = [{"name": t.name, **t.cfg, "version": t.version} for n, t in self.tables.items()
                  if names is None or n in names]
        return [wire.pack(wire.CATALOG_REPLY, req=h.req, tensors=tensors, tables=tables)]

    # ------------------------------------------------------------------ init
    def plan_init(self, h, frames: list, table) -> InitPlan:
        """Every check of a typed INIT against the catalog and the partition table (its
        optimizer and consistency model were checked when it was unpacked, its tensor and
        table maps too: a bad one, an Invalid, is refused in its turn); nothing changes until
        the plan is carried out."""
        opt, cons = h.opt, h.cons
        descs = h.descs(frames, self.settings.max_tensor_bytes)
        given = {d.key: (d, raw, fr) for d, raw, fr in zip(descs, h.t, frames)}
        created, existing, plan = [], [], []
        named = set()       # created, as a set: a 10,000-tensor INIT is not quadratic
        pulse = self.pulse
        for n, t in enumerate(h.tensors):
            if pulse is not None and not n % PULSE_EVERY:
                pulse()
            layout, rule = self.check_tensor(t)
            cur = self.tensors.get(layout.name)
            if layout.name in self.tables:
                raise WireError(Code.SHAPE_MISMATCH, f"{layout.name} exists as a table")
            if cur is None:
                self.check_recovering(f"init of {layout.name}", False)
            if cur is not None:
                if cur.layout.dtype != layout.dtype or cur.layout.shape != layout.shape:
                    raise WireError(Code.SHAPE_MISMATCH,
                                    f"{layout.name} exists as {cur.layout.dtype}"
                                    f"{list(cur.layout.shape)}, init asks "
                                    f"{layout.dtype}{list(layout.shape)}")
                existing.append(layout.name)
                continue
            if layout.name in named:
                raise WireError(Code.BAD_REQUEST, f"{layout.name} named twice")
            for i, key in enumerate(layout.block_keys()):
                p = partition_of(key, self.P)
                if not table.available(p):
                    table.live_owner(key, p)     # raises: lost, or its owner is not live
                g = None
                if rule["name"] == "given":
                    g = given.get(key)
                    start, stop = layout.block_range(i)
                    if g is None or g[0].shape != (stop - start,) or g[0].dtype != layout.dtype:
                        raise WireError(Code.BAD_SHAPE, f"{key}: initial values missing or not "
                                                        f"{layout.dtype}[{stop - start}]")
                    check_finite(key, g[0], g[2], self.settings.max_tensor_bytes)
                plan.append((layout, rule, key, p, g))
            created.append(layout.name)
            named.add(layout.name)
        new_tables = self._plan_tables(h.tables, created, existing, table.available)
        return InitPlan(opt, cons, created, existing, plan, new_tables)

    def _plan_tables(self, tables, created: list, existing: list, available) -> list:
        """The tables of an INIT that are new: ``[(name, settings)]``; existing ones (same
        dim and dtype) go to ``existing``."""
        if tables is None:
            return []
        if type(tables) is Invalid:     # not a list
            tables.raise_()
        new = []
        for t in tables:
            if type(t) is Invalid:
                t.raise_()
            name, cfg = t.name, t.cfg
            cur = self.tables.get(name)
            if name in self.tensors or name in created:
                raise WireError(Code.SHAPE_MISMATCH, f"{name} exists as a dense tensor or is "
                                                     "named twice")
            if cur is not None:
                if (cur.cfg["dim"], cur.cfg["dtype"]) != (cfg["dim"], cfg["dtype"]):
                    raise WireError(Code.SHAPE_MISMATCH,
                                    f"table {name} exists with rows of {cur.cfg['dtype']}"
                                    f"[{cur.cfg['dim']}], init asks {cfg['dtype']}[{cfg['dim']}]")
                existing.append(name)
                continue
            self.check_recovering(f"init of table {name}", False)
            down = [p for p in table_partitions(name, self.P, cfg["spread"]).tolist()
                    if not available(p)]
            if down:
                raise WireError(Code.SHARD_UNAVAILABLE, f"table {name}: partitions {down[:8]} "
                                                        "have no live shard")
            new.append((name, cfg))
            created.append(name)
        return new

    def check_tensor(self, t: TensorSpec | Invalid) -> tuple[TensorLayout, dict]:
        """The limits of this broker on a tensor whose map was checked when it was unpacked
        (an Invalid raises its error here, in the tensor's turn)."""
        if type(t) is Invalid:
            t.raise_()
        name, dtype, block = t.name, t.dtype, t.block
        layout = t.layout()
        itemsize = 8 if dtype == "float64" else 4
        if min(block, layout.size) * itemsize > self.settings.max_tensor_bytes:
            raise WireError(Code.TOO_LARGE, f"{name}: block of {block} elements above the cap")
        if layout.size * itemsize > MAX_PARAM_BYTES or layout.nblocks > MAX_BLOCKS_PER_TENSOR:
            raise WireError(Code.TOO_LARGE, f"{name}: {layout.size} elements in {layout.nblocks} "
                                            f"blocks is above the limits ({MAX_PARAM_BYTES} B, "
                                            f"{MAX_BLOCKS_PER_TENSOR} blocks)")
        return layout, t.rule

    def add_tensors(self, layouts, opt: dict, cons: dict) -> None:
        for layout in layouts:
            self.tensors[layout.name] = Tensor(layout, opt, cons=cons)

    def add_table(self, name: str, cfg: dict) -> None:
        self.tables[name] = Table(name, cfg)

    # ------------------------------------------------------------------ learning
    def init_entry(self, e: dict) -> TensorLayout | None:
        """The layout of a logged INIT entry (None for other entries), put in the catalog if
        the tensor is new to it."""
        if e.get("op") != "init":
            return None
        if "table" in e:           # a table's rows start empty: no bytes to account
            name = split_row_key(e["key"])[0]
            self.tables.setdefault(name, Table(name, e["table"]))
            return None
        layout = TensorLayout.from_wire(e["layout"])
        if layout.name not in self.tensors:
            self.tensors[layout.name] = Tensor(layout, e["opt"])
        return layout

    def least_version(self, names) -> int | None:
        """The least version of tensors ``names`` as the primaries last reported them (None
        when none of them is known)."""
        vs = [t.version for n in names if (t := self.tensors.get(n)) is not None]
        return min(vs) if vs else None

    def learn_versions(self, vers: dict) -> None:
        """Block versions a primary reports after a batch."""
        for key, ver in vers.items():
            if split_row_key(key) is not None:
                continue      # a table's version counts acknowledged pushes instead
            try:
                name, idx = split_key(key)
            except ValueError:
                continue
            t = self.tensors.get(name)
            if t is not None:
                t.versions[idx] = ver

    def learn_rows(self, p: int, tr) -> int:
        """The rows and bytes a primary reports holding in p's tables after a batch; returns
        by how many bytes p's size changed."""
        if not isinstance(tr, dict):
            return 0
        delta = 0
        for name, rb in tr.items():
            tbl = self.tables.get(name)
            if tbl is None or not (isinstance(rb, list) and len(rb) == 2
                                   and all(isinstance(x, int) for x in rb)):
                continue
            old = tbl.rows.get(p, [0, 0])[1]
            tbl.rows[p] = rb
            delta += rb[1] - old
        return delta

    def learn_registration(self, h) -> dict[int, int]:
        """Tensors and block versions a registering shard (a typed REGISTER: the entries it
        could not use were left out and counted in ``skipped``) holds that this broker does
        not know (it restarted, or the cluster was restored from checkpoints); returns the
        parameter bytes it holds per partition."""
        held: dict[int, int] = defaultdict(int)
        if h.skipped:
            self.meters.errors[Code.BAD_FIELD.value] += h.skipped
            log.warning("register: %d tensors or blocks of %s skipped (malformed)", h.skipped,
                        h.shard)
        for t in h.tensors:
            if t.name in self.tensors or t.name in self.tables:
                continue
            if t.cfg is not None:
                self.tables[t.name] = Table(t.name, t.cfg)
                continue
            try:
                layout, _ = self.check_tensor(t.spec)
            except WireError as e:        # above this broker's limits
                self.meters.errors[Code.BAD_FIELD.value] += 1
                log.warning("register: tensor %s: %s", t.name, e)
                continue
            self.tensors[layout.name] = Tensor(layout, t.opt)
        for key, version in h.blocks:
            name_p = split_row_key(key)
            if name_p is not None:
                tbl = self.tables.get(name_p[0])
                if tbl is not None:      # pushes applied: at least the most any part saw
                    tbl.base = max(tbl.base, version - tbl.applied)
                continue
            try:
                t, idx = self.block(key)
            except WireError:            # not a block of a known tensor
                continue
            t.versions.setdefault(idx, version)
            held[partition_of(key, self.P)] += t.layout.block_bytes(idx)
        return held

    def validate_state(self) -> list[str]:
        problems = []
        for name in self.tensors.keys() & self.tables.keys():
            problems.append(f"{name} is both a tensor and a table")
        for t in self.tables.values():
            if t.stepping < 0:
                problems.append(f"table {t.name} has {t.stepping} step pushes in flight")
        return problems
