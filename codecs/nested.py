"""The nested parts of messages, checked once when a message is unpacked: tensor and table
specs of INIT and REGISTER, BATCH parts and their entries, APPLIED results, STATE blocks.

Each ``*_from_wire`` function takes what msgpack produced and returns a typed value (a slots
dataclass), or raises :class:`~.errors.WireError` naming the message kind and the field. Where
the protocol reports an item's fault later than at unpacking (a BATCH entry's fault is an error
for that entry only; an INIT's tensors are refused in request order, after the descriptors) the
item is kept as an :class:`Invalid` that carries the error instead. Messages are built from
these by :mod:`.messages`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import specs, tensor, wire
from .errors import Code, WireError
from .partition import MAX_NAME_LEN, TensorLayout, split_key, split_row_key

MAX_SHARD_ID = 128       # characters of a shard id (REGISTER)
MAX_TOKEN = 64           # bytes of a shard process's token (REGISTER)
_MAX_DIM = 2 ** 40
MAX_NDIM = 8


def run_id(v) -> int | None:
    """A broker's run id (WELCOME, TABLE and events HEARTBEAT ``run``): an int in
    0..2^63-1, else None."""
    return v if type(v) is int and 0 <= v < 1 << 63 else None


def bad(kind: str, field: str, what: str, code: Code = Code.BAD_FIELD):
    raise WireError(code, f"{kind}: {field} {what}")


def int_list(v, kind: str, field: str, lo: int = 0, hi: int | None = None) -> tuple:
    """A list of ints in ``lo..hi`` (``hi`` exclusive), else BAD_FIELD."""
    if type(v) is not list or not all(type(x) is int and x >= lo and (hi is None or x < hi)
                                      for x in v):
        bad(kind, field, "must be a list of ints" + (f" in {lo}..{hi - 1}" if hi else
                                                     f" >= {lo}"))
    return tuple(v)


def str_list(v, kind: str, field: str) -> tuple:
    if type(v) is not list or not all(type(x) is str for x in v):
        bad(kind, field, "must be a list of strings")
    return tuple(v)


@dataclass(frozen=True, slots=True)
class Invalid:
    """An item whose fault the protocol reports where the item is used (an entry's index, an
    INIT tensor's turn): the error it raises then."""
    code: Code
    message: str

    def raise_(self):
        raise WireError(self.code, self.message)


def _named(kind: str, message: str) -> str:
    """``message`` naming the message kind (or nested item) first."""
    return message if message.startswith(kind) else f"{kind}: {message}"


def _deferred(kind: str, fn, *args):
    """``fn(*args)``, or the :class:`Invalid` its WireError becomes (naming ``kind``)."""
    try:
        return fn(*args)
    except WireError as e:
        return Invalid(e.code, _named(kind, str(e.args[0])))


# ------------------------------------------------------------------ tensors and tables
@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An INIT tensor map (or a REGISTER tensor): structure checked; the limits that depend on
    the receiver (its tensor cap) are the catalog's."""
    name: str
    dtype: str
    shape: tuple
    block: int
    rule: dict            # the initializer, checked (specs.validate_init_rule)

    def layout(self) -> TensorLayout:
        return TensorLayout(self.name, self.dtype, self.shape, self.block)


def tensor_spec(t, kind: str = "init", default_rule: dict | None = None) -> TensorSpec:
    """An INIT ``tensors`` entry: BAD_FIELD for the map, its name or block, BAD_DTYPE for a
    dtype that is not a parameter dtype, BAD_SHAPE for the shape, BAD_FIELD for the rule."""
    if type(t) is not dict:
        raise WireError(Code.BAD_FIELD, f"{kind}: entries must be maps")
    name, dtype, shape, block = t.get("name"), t.get("dtype"), t.get("shape"), t.get("block")
    if type(name) is not str or not name or len(name) > MAX_NAME_LEN or "\x00" in name:
        raise WireError(Code.BAD_FIELD, f"{kind}: tensor name must be a non-empty string, "
                                        f"got {name!r}")
    if type(dtype) is not str or dtype not in tensor.PARAM_DTYPES:
        raise WireError(Code.BAD_DTYPE, f"{kind}: tensor {name} dtype: parameters must be "
                                        f"float32 or float64, not {dtype!r}")
    if (type(shape) is not list or len(shape) > MAX_NDIM
            or not all(type(s) is int and 0 < s < _MAX_DIM for s in shape)):
        raise WireError(Code.BAD_SHAPE, f"{kind}: tensor {name} shape must be a list of "
                                        "positive ints")
    if type(block) is not int or block < 1:
        raise WireError(Code.BAD_FIELD, f"{kind}: tensor {name} block must be a positive int")
    rule = t.get("init", {"name": "given"}) if default_rule is None else default_rule
    return TensorSpec(name, dtype, tuple(shape), block, specs.validate_init_rule(rule))


def layout_from_wire(d, kind: str, field: str = "layout") -> TensorLayout:
    """A layout map ``{name, dtype, shape, block}`` (BATCH init entries, STATE blocks)."""
    if type(d) is not dict:
        bad(kind, field, "must be a map")
    try:
        return tensor_spec(d, f"{kind}: {field}", {"name": "zeros"}).layout()
    except WireError as e:      # a malformed entry: BAD_FIELD whatever the field
        raise WireError(Code.BAD_FIELD, str(e.args[0])) from None


@dataclass(frozen=True, slots=True)
class TableSpec:
    """An INIT ``tables`` entry: its name and settings, normalized (specs.table_from_wire)."""
    name: str
    cfg: dict


def table_spec(t, kind: str = "init") -> TableSpec:
    if type(t) is not dict:
        raise WireError(Code.BAD_FIELD, f"{kind}: entries must be maps")
    name = t.get("name")
    if type(name) is not str or not name or len(name) > MAX_NAME_LEN or any(
            c in name for c in "\x00#"):
        raise WireError(Code.BAD_FIELD, f"{kind}: table name must be a non-empty string "
                                        f"without '#', got {name!r}")
    return TableSpec(name, specs.table_from_wire(t))


def init_tensors(v) -> tuple:
    """INIT ``tensors``: a TensorSpec or an Invalid per entry (refused in request order)."""
    return tuple(_deferred("init: tensors", tensor_spec, t, "init: tensors") for t in v)


def init_tables(v):
    """INIT ``tables``: None (absent), a TableSpec or an Invalid per entry, or one Invalid for
    a value that is not a list."""
    if v is None:
        return None
    if type(v) is not list:
        return Invalid(Code.BAD_FIELD, "init: tables must be a list")
    return tuple(_deferred("init: tables", table_spec, t, "init: tables") for t in v)


@dataclass(frozen=True, slots=True)
class HeldTensor:
    """A REGISTER ``tensors`` entry: a dense tensor (``spec``, ``opt``) or a table (``cfg``)."""
    name: str
    spec: TensorSpec | None
    opt: dict | None
    cfg: dict | None


def held_tensor(t) -> HeldTensor:
    if type(t) is not dict or type(t.get("name")) is not str:
        bad("register", "tensors", "entries must be maps with a name")
    if "table" in t:
        return HeldTensor(t["name"], None, None, specs.table_from_wire(t["table"]))
    spec = tensor_spec(t, "register", {"name": "zeros"})
    specs.optimizer_from_wire(t.get("opt"))
    return HeldTensor(spec.name, spec, t["opt"], None)


# ------------------------------------------------------------------ BATCH
@dataclass(slots=True)
class PushEntry:
    """A gradient: ``i`` indexes the batch's descriptors and frames; ``c``/``m`` its pushing
    client and msg (None when absent), ``ts`` rows' queue time, ``w`` a staleness scale in
    (0, 1) or None."""
    i: int
    c: bytes | None
    m: int | None
    ts: float
    w: float | None

    def ident(self, key: str) -> tuple | None:
        """The gradient's identity (client, msg, key) for skipping a resend; None without
        a msg id."""
        return None if self.m is None else (self.c, self.m, key)


@dataclass(frozen=True, slots=True)
class InitEntry:
    """A dense block to create: its layout, initializer and optimizer (``i``: the index of
    its given values, or None). ``st``: an imported block (a tier move, protocol 24.4): its
    whole state, the values at ``i`` and the optimizer's arrays after them, replacing any
    block of that key."""
    key: str
    layout: TensorLayout
    rule: dict
    opt: dict
    i: int | None
    st: "ImportedState | None" = None


@dataclass(frozen=True, slots=True)
class TableInitEntry:
    """A table's rows in one partition to create (``table``: the settings, as sent); with
    ``st`` and ``i``, imported rows replacing any of that key (a tier move)."""
    key: str
    table: dict
    st: "ImportedState | None" = None
    i: int | None = None


@dataclass(frozen=True, slots=True)
class ImportedState:
    """A block's or table's exported state as a tier move carries it in an init entry:
    ``version``, its arrays as ``(name, dtype, shape)`` back to back in the entry's one raw
    frame (a block's values first, named ``""``) and its scalar state."""
    version: int
    arrays: tuple
    scalars: dict

    def split(self, buf) -> list:
        """The arrays, views of ``buf`` (the entry's frame, decoded); ValueError when its
        length is not theirs."""
        flat = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        out, pos = [], 0
        for _name, dt, shape in self.arrays:
            n = dt.itemsize * int(np.prod(shape, dtype=np.int64))
            out.append(flat[pos:pos + n].view(dt).reshape(shape))
            pos += n
        if pos != flat.size:
            raise ValueError(f"an imported state of {pos} bytes in a frame of {flat.size}")
        return out


@dataclass(frozen=True, slots=True)
class DropEntry:
    """A block or table key to forget (its name moved to another tier member)."""
    key: str


def _array_spec(a) -> tuple:
    if not (type(a) is list and len(a) == 3 and type(a[0]) is str and type(a[1]) is str
            and type(a[2]) is list and all(type(x) is int and 0 <= x < 2 ** 40 for x in a[2])):
        raise WireError(Code.BAD_FIELD, "init entry: st arrays are [name, dtype, shape]")
    try:
        dt = np.dtype(a[1])
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "fiu" or dt.itemsize > 8:
        raise WireError(Code.BAD_FIELD, f"init entry: st dtype {a[1]!r} is not a number's")
    return a[0], dt, tuple(a[2])


def _imported(st, nt: int, i) -> ImportedState:
    """An init entry's ``st``, whose one frame ``i`` is in the batch."""
    if type(st) is not dict:
        raise WireError(Code.BAD_FIELD, "init entry: st must be a map")
    version, arrays, scalars = st.get("version"), st.get("arrays"), st.get("scalars", {})
    if type(version) is not int or version < 0:
        raise WireError(Code.BAD_FIELD, "init entry: st version must be an int >= 0")
    if type(arrays) is not list or not arrays:
        raise WireError(Code.BAD_FIELD, "init entry: st arrays must be a non-empty list")
    if type(scalars) is not dict or not all(type(k) is str for k in scalars):
        raise WireError(Code.BAD_FIELD, "init entry: st scalars must be a map of names")
    if type(i) is not int or not 0 <= i < nt:
        raise WireError(Code.BAD_FIELD, "init entry: st needs i indexing its frame")
    return ImportedState(version, tuple(_array_spec(a) for a in arrays), scalars)


def _init_entry(ent: dict, nt: int):
    key = ent.get("key")
    if type(key) is not str or not key:
        raise WireError(Code.BAD_FIELD, "init entry: key must be a non-empty string")
    if "table" in ent:
        if split_row_key(key) is None:
            raise WireError(Code.BAD_FIELD, f"init entry: {key!r} is not a row key")
        specs.table_from_wire(ent["table"])
        if "st" in ent:
            i = ent.get("i")
            return TableInitEntry(key, ent["table"], _imported(ent["st"], nt, i), i)
        return TableInitEntry(key, ent["table"])
    layout = layout_from_wire(ent.get("layout"), "init entry")
    try:
        name, index = split_key(key)
    except ValueError:
        name = index = None
    if name != layout.name or index >= layout.nblocks:
        raise WireError(Code.BAD_FIELD, f"init entry: {key!r} is not a block key of "
                                        f"{layout.name}")
    rule = specs.validate_init_rule(ent.get("rule"))
    opt = ent.get("opt")
    specs.optimizer_from_wire(opt)
    i = ent.get("i")
    if i is not None and (type(i) is not int or i >= nt):
        raise WireError(Code.BAD_FIELD, f"init entry {key}: i must index the batch's tensors")
    if "st" in ent:
        return InitEntry(key, layout, rule, opt, i, _imported(ent["st"], nt, i))
    return InitEntry(key, layout, rule, opt, i if i is not None and i >= 0 else None)


def _drop_entry(ent: dict, nt: int):
    key = ent.get("key")
    if type(key) is not str or not key:
        raise WireError(Code.BAD_FIELD, "drop entry: key must be a non-empty string")
    return DropEntry(key)


def _push_entry(ent: dict, nt: int):
    """A push entry (the hot path: one per gradient; plain checks, no helper calls)."""
    get = ent.get
    i, c, m, ts, w = get("i"), get("c"), get("m"), get("ts"), get("w")
    if i.__class__ is not int or not 0 <= i < nt:
        return Invalid(Code.BAD_FIELD, f"push entry: i {i!r} indexes none of the "
                                       f"batch's {nt} tensors")
    if c is not None and c.__class__ is not bytes:
        c = None
    if m is not None and m.__class__ is not int:
        m = None
    if ts is not None:      # table rows only
        ts = float(ts) if ts.__class__ is float or ts.__class__ is int else 0.0
    if w is not None and (w.__class__ is not float or not 0.0 < w < 1.0):
        w = None
    return PushEntry(i, c, m, 0.0 if ts is None else ts, w)


def batch_entry(ent, nt: int):
    """One BATCH entry (``nt``: the batch's descriptors): a PushEntry, InitEntry or
    TableInitEntry, or an Invalid (BAD_FIELD for that entry only)."""
    if type(ent) is not dict:
        return Invalid(Code.BAD_FIELD, "batch entry must be a map")
    op = ent.get("op")
    if op == "push":
        return _push_entry(ent, nt)
    if op == "init":
        return _deferred("init entry", _init_entry, ent, nt)
    if op == "drop":
        return _deferred("drop entry", _drop_entry, ent, nt)
    return Invalid(Code.BAD_FIELD, f"unknown entry op {op!r}")


@dataclass(slots=True)
class BatchPart:
    """One partition's part of a BATCH: ``o`` the publishing replica (None: the receiver)."""
    p: int
    seq: int
    epoch: int
    o: str | None
    e: list              # PushEntry, InitEntry, TableInitEntry or Invalid, in batch order


def batch_part(part, nt: int) -> BatchPart:
    if type(part) is not dict:
        bad("batch", "parts", "entries must be maps")
    p, seq, epoch, e, o = part.get("p"), part.get("seq"), part.get("epoch"), part.get("e"), \
        part.get("o")
    if type(p) is not int or not 0 <= p < 65536:
        bad("batch", "part p", f"{p!r} is not a partition")
    if type(seq) is not int or seq < 1:
        bad("batch", "part seq", f"{seq!r} is not an int >= 1")
    if type(epoch) is not int or epoch < 0:
        bad("batch", "part epoch", f"{epoch!r} is not an int >= 0")
    if type(e) is not list:
        bad("batch", "part e", "must be a list of entries")
    entries = []
    add = entries.append
    for x in e:     # push entries inline (one per gradient), as _push_entry checks them
        if x.__class__ is dict and len(x) == 4 and x.get("op") == "push":
            i, c, m = x.get("i"), x.get("c"), x.get("m")
            if (i.__class__ is int and 0 <= i < nt and c.__class__ is bytes
                    and m.__class__ is int):
                add(PushEntry(i, c, m, 0.0, None))    # {op, i, c, m}: what the broker sends
                continue
        add(_push_entry(x, nt) if x.__class__ is dict and x.get("op") == "push"
            else batch_entry(x, nt))
    return BatchPart(p, seq, epoch, o if type(o) is str else None, entries)


# ------------------------------------------------------------------ APPLIED
@dataclass(slots=True)
class AppliedPart:
    """One APPLIED result: ``n`` frames of UPDATE follow (-1: none), ``errors`` are
    ``(entry index, code, message)``, ``vers`` key -> version, ``tr`` table -> (rows, bytes)."""
    p: int
    seq: int
    epoch: int
    errors: list          # [entry index, code, message]
    vers: dict
    n: int
    dup: bool
    tr: dict | None


def _err_triple(x) -> bool:
    return (type(x) is list and len(x) == 3 and type(x[0]) is int and type(x[1]) is str
            and type(x[2]) is str)


def applied_part(r, partitions: int | None) -> AppliedPart:
    """One APPLIED result (per batch part: plain checks, no generators)."""
    if r.__class__ is not dict:
        bad("applied", "parts", "entries must be maps")
    get = r.get
    p, seq, epoch, n = get("p"), get("seq"), get("epoch"), get("n")
    errors, vers, tr = get("errors"), get("vers"), get("tr")
    if p.__class__ is not int or not 0 <= p < (partitions or 65536):
        bad("applied", "part p", f"{p!r} is not a partition")
    if seq.__class__ is not int or epoch.__class__ is not int:
        bad("applied", "part seq/epoch", "must be ints")
    if n.__class__ is not int or n < -1:
        bad("applied", "part n", f"{n!r} is not an int >= -1")
    if errors.__class__ is not list:
        bad("applied", "part errors", "must be a list of [index, code, message]")
    for x in errors:
        if not _err_triple(x):
            bad("applied", "part errors", "must be a list of [index, code, message]")
    if vers.__class__ is not dict:
        bad("applied", "part vers", "must map keys to ints")
    for k, v in vers.items():
        if k.__class__ is not str or v.__class__ is not int:
            bad("applied", "part vers", "must map keys to ints")
    if tr is not None:
        if tr.__class__ is not dict or not all(
                type(v) is list and len(v) == 2 and type(v[0]) is int and type(v[1]) is int
                for v in tr.values()):
            bad("applied", "part tr", "must map tables to [rows, bytes]")
    return AppliedPart(p, seq, epoch, errors, vers, n, get("dup") is True, tr)


# ------------------------------------------------------------------ STATE
@dataclass(frozen=True, slots=True)
class StateBlock:
    """A dense block of a STATE: its frames are the value, then one per name in ``arrays``."""
    key: str
    layout: TensorLayout
    opt: dict
    version: int
    arrays: tuple
    scalars: dict

    @property
    def nframes(self) -> int:
        return 1 + len(self.arrays)


@dataclass(frozen=True, slots=True)
class StateRows:
    """A table's rows in a STATE: one frame per name in ``arrays``."""
    key: str
    table: dict
    scalars: dict
    arrays: tuple

    @property
    def nframes(self) -> int:
        return len(self.arrays)


def _scalars(v) -> dict:
    """A block's numeric state (a table's ``swept`` may be nil: never swept)."""
    if type(v) is not dict or not all(
            type(k) is str and (x is None or type(x) in (int, float)) for k, x in v.items()):
        bad("state", "block scalars", "must map names to numbers")
    return v


def state_block(meta):
    if type(meta) is not dict or type(meta.get("key")) is not str:
        bad("state", "blocks", "entries must be maps with a key")
    arrays = str_list(meta.get("arrays"), "state", "block arrays")
    if "table" in meta:
        specs.table_from_wire(meta["table"])
        return StateRows(meta["key"], meta["table"], _scalars(meta.get("scalars")), arrays)
    layout = layout_from_wire(meta.get("layout"), "state", "block layout")
    specs.optimizer_from_wire(meta.get("opt"))
    version = meta.get("version")
    if type(version) is not int or version < 0:
        bad("state", "block version", f"{version!r} is not an int >= 0")
    return StateBlock(meta["key"], layout, meta["opt"], version, arrays,
                      _scalars(meta.get("scalars", {})))


def recent(v) -> tuple:
    """STATE ``recent``: the ``(c, m, key)`` identities; malformed entries are skipped."""
    if type(v) is not list:
        return ()
    return tuple(tuple(r) for r in v if type(r) is list and len(r) == 3
                 and (r[0] is None or type(r[0]) is bytes) and type(r[1]) is int
                 and type(r[2]) is str)


# ------------------------------------------------------------------ shared by the kinds
def opt(v, t):
    """``v`` when it has exactly type ``t``, else None (an optional field of the wrong type)."""
    return v if type(v) is t else None


def opt_int(v, lo: int = 0):
    """``v`` when it is an int of at least ``lo``, else None."""
    return v if type(v) is int and v >= lo else None


class Tensors:
    """For kinds that carry tensor frames: ``t``, the descriptors as sent."""
    __slots__ = ()

    def descs(self, frames, max_tensor_bytes: int = wire.MAX_TENSOR_BYTES) -> list:
        """The descriptors checked against ``frames`` (steps 7-9)."""
        return wire.parse_descs(self.kind, self.t, frames, max_tensor_bytes)


def of_count(h) -> int:
    """A fanned-out reply's ``of`` (how many replies make the answer), 1 when unusable."""
    of = h.get("of", 1)
    return of if type(of) is int and of >= 1 else 1
