"""Typed messages: one slots dataclass per kind (the replies and events only clients read are in
:mod:`.replies`, the broker-shard link's kinds in :mod:`.shard_link`, re-exported here), built
and checked once when a message is unpacked, so handlers read attributes that hold what the
protocol says they hold.

:func:`unpack` is :func:`wire.unpack_header` (steps 1-6 of the protocol's validation: size,
msgpack, version, kind, required fields' types; still the only msgpack unpacker) followed by
:func:`from_header`, which checks every field beyond that, nested ones included (BATCH parts and
entries, APPLIED results, INIT tensors and optimizer, ROWS queries, ADMIN ops, REGISTER holds,
STATE blocks: :mod:`.nested`), and raises :class:`FieldError` (``BAD_FIELD``, or the code the
protocol names) naming the kind and the field. A receiver that must check a sender's roles
between the two (the broker) calls them apart.

Rules, as protocol.md section 6.0 gives them: an optional field of the wrong type is absent
(None, or its default) unless the protocol names an error for it; fields a receiver does not
know are ignored. Dicts stay only where the protocol carries free-form maps (status, a shard's
``info``, optimizer and table settings forwarded as sent) and in ``t``, the raw descriptors,
which :func:`wire.parse_descs` checks against the frames (:meth:`descs`). Replies that resolve
a client's Future keep their ``header`` (the public API returns it).

PUSH, BATCH, APPLIED, ACK and UPDATE are per message on the hot path: their builders trust the
types :func:`wire.unpack_header` already checked and use plain slots classes (a frozen one
costs four times as much to build).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import follow, replies, shard_link, specs, wire
from .errors import Code, WireError
from .follow import Credit, Follow  # noqa: F401  (re-exported: conflated delivery's kinds)
from .nested import (  # noqa: F401  (re-exported: the nested types handlers match on)
    MAX_SHARD_ID,
    MAX_TOKEN,
    AppliedPart,
    BatchPart,
    DropEntry,
    HeldTensor,
    InitEntry,
    Invalid,
    PushEntry,
    StateBlock,
    StateRows,
    TableInitEntry,
    TableSpec,
    Tensors,
    TensorSpec,
    applied_part,
    batch_part,
    held_tensor,
    init_tables,
    init_tensors,
    int_list,
    of_count,
    opt,
    opt_int,
    recent,
    run_id,
    state_block,
    str_list,
)
from .replies import (  # noqa: E402,F401  (re-exported: every kind's class is here)
    AdminReply,
    CatalogReply,
    CheckpointReply,
    DigestReply,
    InitOk,
    RowsReply,
    SnapshotReply,
    StatusReply,
    Table,
    Welcome,
)
from .shard_link import (  # noqa: E402,F401  (re-exported: every kind's class is here)
    Adopt,
    Drop,
    PairBeat,
    Register,
    Registered,
    State,
    StateReq,
    Synced,
)


class FieldError(WireError):
    """A message past steps 1-6 with a malformed field: ``ids`` holds its ``msg`` or ``req``
    (an ERROR answering it copies them)."""

    def __init__(self, code: Code, message: str, ids: dict):
        super().__init__(code, message)
        self.ids = ids


# ------------------------------------------------------------------ hot path
@dataclass(slots=True)
class Push(Tensors):
    kind = wire.PUSH
    msg: int
    acks: int            # 0, 1 or ACKS_ALL
    ver: int | None
    t: list


@dataclass(slots=True)
class Ack:
    kind = wire.ACK
    msg: int
    msgs: tuple | None    # every push acknowledged, when a non-empty list of ints came
    header: dict
    ver: int | None = None          # ``msg``'s version, when an int >= 0 came
    vers: dict | None = None        # msg -> version, from ``vers`` beside ``msgs``
    free: tuple = ()                # pushes whose shared-memory slots are free (ints only)

    @property
    def ids(self) -> tuple:
        return self.msgs or (self.msg,)

    def version(self, msg: int) -> int | None:
        """The version push ``msg``'s tensors had once it was applied (None: not said)."""
        if self.vers is not None:
            return self.vers.get(msg)
        return self.ver if msg == self.msg else None


@dataclass(slots=True)
class Free:
    kind = wire.FREE
    msgs: tuple          # the pushes whose shared-memory slots are free (ints only)


@dataclass(slots=True)
class Batch(Tensors):
    kind = wire.BATCH
    parts: list          # BatchPart
    t: list


@dataclass(slots=True)
class Applied:
    kind = wire.APPLIED
    parts: list          # AppliedPart
    shard: str | None

    def updates(self, frames: list) -> list:
        """Per part, the frames of its embedded UPDATE (None for ``n == -1``); ``frames``
        the message's frames after the header. BAD_FIELD when their count is not what the
        parts' ``n`` say."""
        out, pos = [], 0
        for part in self.parts:
            n = part.n
            if n < 0:
                out.append(None)
                continue
            out.append(frames[pos:pos + 1 + n])
            pos += 1 + n
        if pos != len(frames):
            raise WireError(Code.BAD_FIELD, f"applied: parts announce {pos} update frames, "
                                            f"{len(frames)} came")
        return out


@dataclass(slots=True)
class Update(Tensors):
    kind = wire.UPDATE
    p: int
    seq: int
    epoch: int
    t: list
    since: int | None = None    # conflated delivery: it holds every block changed after it


# ------------------------------------------------------------------ frontend requests
@dataclass(frozen=True, slots=True)
class Hello:
    kind = wire.HELLO
    role: str


@dataclass(frozen=True, slots=True)
class Init(Tensors):
    kind = wire.INIT
    msg: int
    opt: dict                 # the optimizer, checked, as sent (forwarded in init entries)
    tensors: tuple            # TensorSpec or Invalid per entry, in request order
    tables: object            # None, Invalid (not a list), or TableSpec/Invalid per entry
    cons: dict                # normalized (specs.consistency_from_wire)
    t: list
    imp: object = None        # a tier move's import: entries carrying exported state
    drop: object = None       # a tier move's end: names to forget (broker/tier_moves.py)


@dataclass(frozen=True, slots=True)
class Snapshot:
    kind = wire.SNAPSHOT
    req: int
    keys: tuple
    client: bytes | None
    of: int | None
    shm: bool | None          # a client's: True it reads shared memory, False frames only
                              # (asked again after a torn reply); the broker's to a shard:
                              # True, the reply may reference its reply area


@dataclass(frozen=True, slots=True)
class Rows:
    kind = wire.ROWS
    req: int
    table: str
    q: tuple                  # (p, ids bytes) pairs, well formed
    malformed: int            # pairs that were not [int, bin of 8k bytes] (a shard skips them)
    min: int | None
    tv: int | None
    client: bytes | None
    of: int | None
    shm: bool | None          # as a SNAPSHOT's

    def fields(self) -> dict:
        """What a ROWS forwarded to a shard carries besides ``req``, routing and ``tv``."""
        return {"table": self.table, "q": [list(x) for x in self.q]}


@dataclass(frozen=True, slots=True)
class Catalog:
    kind = wire.CATALOG
    req: int
    names: tuple | None


@dataclass(frozen=True, slots=True)
class Status:
    kind = wire.STATUS
    req: int
    table: bool


@dataclass(frozen=True, slots=True)
class Digest:
    kind = wire.DIGEST
    req: int
    ps: tuple | None
    client: bytes | None
    of: int | None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    kind = wire.CHECKPOINT
    req: int
    ps: tuple | None
    client: bytes | None
    of: int | None


ADMIN_OPS = ("rebalance", "drain", "tier")


@dataclass(frozen=True, slots=True)
class Admin:
    kind = wire.ADMIN
    req: int
    op: str                   # one of ADMIN_OPS
    shard: str | None         # drain only
    args: dict | None = None  # tier only: the step and its fields (broker/tier_moves.py)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    kind = wire.HEARTBEAT
    info: dict | None         # a shard's counters (free-form)
    ps: tuple | None          # events: partitions published, with ...
    seqs: tuple | None        # ... their last seqs (None unless both are int lists alike)
    tv: dict | None           # events: tensor -> version
    shm: bool | None          # a client's: it took up the broker's shared memory
    run: int | None = None    # events: the broker process's run id (a new one: it restarted)


@dataclass(frozen=True, slots=True)
class Bye:
    kind = wire.BYE


@dataclass(frozen=True, slots=True)
class Stop:
    kind = wire.STOP


@dataclass(frozen=True, slots=True)
class Error:
    kind = wire.ERROR
    code: str
    message: str
    msg: int | None
    req: int | None
    header: dict


# ------------------------------------------------------------------ builders
_ALL = wire.ACKS_ALL
_EMPTY: list = []      # never written to


def _fail(h: dict, e: WireError):
    """The FieldError for ``e``: its message names the kind first, and it carries the ids."""
    ids = {k: h[k] for k in ("msg", "req") if type(h.get(k)) is int}
    kind, message = h["kind"], str(e.args[0])
    raise FieldError(e.code, message if message.startswith(kind) else f"{kind}: {message}",
                     ids) from None


def _push(h, P):
    acks, ver = h["acks"], h.get("ver")
    if acks != 1 and acks != 0 and acks != _ALL:
        raise WireError(Code.BAD_FIELD, f"push: acks must be 0, 1 or {_ALL} (all), not {acks}")
    if ver is not None and ver.__class__ is not int:
        ver = None
    return Push(h["msg"], acks, ver, h.get("t", _EMPTY))


def _version(v) -> int | None:
    return v if v.__class__ is int and v >= 0 else None


def _ack(h, P):
    msgs, vers = h.get("msgs"), None
    if msgs is not None:
        if msgs.__class__ is list and msgs:
            for m in msgs:
                if m.__class__ is not int:
                    msgs = None
                    break
            else:
                v = h.get("vers")
                if v.__class__ is list and len(v) == len(msgs):
                    vers = {m: _version(x) for m, x in zip(msgs, v)}
                msgs = tuple(dict.fromkeys(msgs))
        else:
            msgs = None
    free = h.get("free")
    free = tuple(m for m in free if m.__class__ is int) if free.__class__ is list else ()
    return Ack(h["msg"], msgs, h, _version(h.get("ver")), vers, free)


def _batch(h, P):
    t = h.get("t", [])
    nt = len(t)
    return Batch([batch_part(x, nt) for x in h["parts"]], t)


def _applied(h, P):
    return Applied([applied_part(x, P) for x in h["parts"]], opt(h.get("shard"), str))


def _update(h, P):
    p, seq, epoch = h["p"], h["seq"], h["epoch"]
    if p < 0 or seq < 0 or epoch < 0:
        raise WireError(Code.BAD_FIELD, f"update: p, seq and epoch must be >= 0, not "
                                        f"{p}, {seq}, {epoch}")
    since = h.get("since")
    return Update(p, seq, epoch, h.get("t", []),
                  since if since.__class__ is int and since >= 0 else None)


def _init(h, P):
    opt, tensors = h["opt"], h["tensors"]
    if specs.optimizer_from_wire(opt).name == "ftrl" and tensors:
        raise WireError(Code.BAD_FIELD, "init: ftrl optimizes embedding table rows only "
                                        "(init_table)")
    try:
        cons = specs.consistency_from_wire(h.get("cons"))
    except ValueError as e:
        raise WireError(Code.BAD_FIELD, f"init: cons {e}") from None
    return Init(h["msg"], opt, init_tensors(tensors), init_tables(h.get("tables")), cons,
                h.get("t", []), h.get("imp"), h.get("drop"))


def _snapshot(h, P):
    return Snapshot(h["req"], str_list(h["keys"], "snapshot", "keys"),
                    opt(h.get("client"), bytes), opt_int(h.get("of"), 1), opt(h.get("shm"), bool))


def _rows(h, P):
    q, good = h["q"], []
    for x in q:
        if (type(x) is list and len(x) == 2 and type(x[0]) is int and type(x[1]) is bytes
                and not len(x[1]) % 8 and (0 <= x[0] < P if P else x[0] >= 0)):
            good.append((x[0], x[1]))
    return Rows(h["req"], h["table"], tuple(good), len(q) - len(good), opt(h.get("min"), int),
                opt(h.get("tv"), int), opt(h.get("client"), bytes), opt_int(h.get("of"), 1),
                opt(h.get("shm"), bool))


def _ps(h, P):
    ps = h.get("ps")
    return None if ps is None else int_list(ps, h["kind"], "ps", 0, P or 65536)


def _digest(h, P):
    return Digest(h["req"], _ps(h, P), opt(h.get("client"), bytes), opt_int(h.get("of"), 1))


def _checkpoint(h, P):
    return Checkpoint(h["req"], _ps(h, P), opt(h.get("client"), bytes),
                      opt_int(h.get("of"), 1))


def _catalog(h, P):
    names = h.get("names")
    if names is not None and type(names) is not list:
        raise WireError(Code.BAD_FIELD, "catalog: names must be a list")
    return Catalog(h["req"], None if names is None else tuple(n for n in names
                                                              if type(n) is str))


def _admin(h, P):
    if h["op"] not in ADMIN_OPS:
        raise WireError(Code.BAD_FIELD, f"admin: unknown op {h['op']!r}")
    if h["op"] == "tier":
        return Admin(h["req"], "tier", None, {k: v for k, v in h.items()
                                              if k not in ("kind", "req", "op")})
    return Admin(h["req"], h["op"], opt(h.get("shard"), str))


def _heartbeat(h, P):
    ps, seqs, tv = h.get("ps"), h.get("seqs"), h.get("tv")
    if not (type(ps) is list and type(seqs) is list and len(ps) == len(seqs)
            and all(type(x) is int for x in ps) and all(type(x) is int for x in seqs)):
        ps = seqs = None
    if type(tv) is not dict or not all(type(k) is str and type(v) is int
                                       for k, v in tv.items()):
        tv = None
    return Heartbeat(opt(h.get("info"), dict), None if ps is None else tuple(ps),
                     None if seqs is None else tuple(seqs), tv, opt(h.get("shm"), bool),
                     run_id(h.get("run")))


def _error(h, P):
    return Error(h["code"], h["message"], opt(h.get("msg"), int), opt(h.get("req"), int), h)


_BUILD = {
    wire.PUSH: _push, wire.ACK: _ack, wire.BATCH: _batch,
    wire.FREE: lambda h, P: Free(tuple(m for m in h["msgs"] if type(m) is int)),
    wire.APPLIED: _applied,
    wire.UPDATE: _update, wire.HELLO: lambda h, P: Hello(h["role"]), wire.INIT: _init,
    wire.SNAPSHOT: _snapshot, wire.ROWS: _rows, wire.CATALOG: _catalog,
    wire.STATUS: lambda h, P: Status(h["req"], h.get("table") is True),
    wire.DIGEST: _digest, wire.CHECKPOINT: _checkpoint, wire.ADMIN: _admin,
    wire.HEARTBEAT: _heartbeat, wire.BYE: lambda h, P: Bye(), wire.STOP: lambda h, P: Stop(),
    wire.ERROR: _error,
    **shard_link.BUILD,
    **replies.BUILD,
    **follow.BUILD,
}
assert _BUILD.keys() == wire.SCHEMA.keys()


def from_header(h: dict, partitions: int | None = None):
    """The typed message of a header :func:`wire.unpack_header` returned. ``partitions``:
    the receiver's P, when it knows it (partition numbers are then checked against it).
    Raises :class:`FieldError`."""
    try:
        return _BUILD[h["kind"]](h, partitions)
    except WireError as e:
        _fail(h, e)


def unpack(frame, allowed_kinds: frozenset[str], partitions: int | None = None):
    """Unpack, check and type a header frame (:func:`wire.unpack_header`, then
    :func:`from_header`)."""
    return from_header(wire.unpack_header(frame, allowed_kinds), partitions)
