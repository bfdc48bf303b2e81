"""The typed replies and events a client receives (WELCOME, INIT_OK, the read and ops replies,
TABLE), each built and checked once when unpacked: the half of :mod:`.messages` that only
clients and ops tools read. :mod:`.messages` re-exports every class here and dispatches to
:data:`BUILD`."""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import wire
from .errors import Code, WireError
from .nested import Tensors as _Tensors
from .nested import int_list, run_id, str_list
from .nested import of_count as _of
from .nested import opt as _opt


@dataclass(frozen=True, slots=True)
class Welcome:
    kind = wire.WELCOME
    events: int
    backend: int
    partitions: int
    down: tuple
    hb: float | None          # the broker's heartbeat interval, when usable
    shm: dict | None          # the broker's shared-memory offer (checked by shm.accept)
    run: int | None = None    # the broker process's run id


@dataclass(frozen=True, slots=True)
class InitOk:
    kind = wire.INIT_OK
    msg: int
    created: tuple
    existing: tuple
    header: dict


@dataclass(frozen=True, slots=True)
class SnapshotReply(_Tensors):
    kind = wire.SNAPSHOT_REPLY
    req: int
    parts: tuple              # (p, seq)
    missing: tuple
    client: bytes | None
    of: int
    t: list


@dataclass(frozen=True, slots=True)
class RowsReply(_Tensors):
    kind = wire.ROWS_REPLY
    req: int
    missing: tuple
    tv: int | None
    client: bytes | None
    of: int
    t: list


@dataclass(frozen=True, slots=True)
class CatalogReply:
    kind = wire.CATALOG_REPLY
    req: int
    tensors: list
    tables: list
    header: dict


@dataclass(frozen=True, slots=True)
class StatusReply:
    kind = wire.STATUS_REPLY
    req: int
    status: dict
    header: dict


@dataclass(frozen=True, slots=True)
class DigestReply:
    kind = wire.DIGEST_REPLY
    req: int
    shard: str
    parts: tuple              # (p, seq, digest)
    client: bytes | None
    of: int
    header: dict


@dataclass(frozen=True, slots=True)
class CheckpointReply:
    kind = wire.CHECKPOINT_REPLY
    req: int
    shard: str
    path: str | None
    time: float | None
    partitions: int | None
    error: str | None
    client: bytes | None
    of: int
    header: dict


@dataclass(frozen=True, slots=True)
class AdminReply:
    kind = wire.ADMIN_REPLY
    req: int
    result: dict
    header: dict


@dataclass(frozen=True, slots=True)
class Table:
    kind = wire.TABLE
    version: int
    owners: tuple
    standbys: tuple | None
    epochs: tuple | None
    down: tuple
    run: int | None = None    # the broker process's run id
    tier: dict | None = None  # a tier member's map (protocol 24), as sent


# ------------------------------------------------------------------ builders
def _welcome(h, P):
    for name in ("events", "backend", "partitions"):
        if not 1 <= h[name] <= 65535:
            raise WireError(Code.BAD_FIELD, f"welcome: {name} {h[name]} is not in 1..65535")
    down, hb = h.get("down"), h.get("hb")
    ok_hb = type(hb) in (int, float) and math.isfinite(hb) and hb > 0
    return Welcome(h["events"], h["backend"], h["partitions"],
                   tuple(down) if type(down) is list and all(type(x) is int for x in down)
                   else (), float(hb) if ok_hb else None, _opt(h.get("shm"), dict),
                   run_id(h.get("run")))


def _snapshot_reply(h, P):
    parts = h["parts"]
    if not all(type(x) is list and len(x) == 2 and type(x[0]) is int and type(x[1]) is int
               for x in parts):
        raise WireError(Code.BAD_FIELD, "snapshot_reply: parts must be [[partition, seq], ...]")
    missing = h.get("missing")
    return SnapshotReply(h["req"], tuple((p, s) for p, s in parts),
                         str_list(missing, "snapshot_reply", "missing") if missing else (),
                         _opt(h.get("client"), bytes), _of(h), h.get("t", []))


def _rows_reply(h, P):
    missing = h.get("missing")
    return RowsReply(h["req"], int_list(missing, "rows_reply", "missing") if missing else (),
                     _opt(h.get("tv"), int), _opt(h.get("client"), bytes), _of(h),
                     h.get("t", []))


def _digest_reply(h, P):
    parts = h["parts"]
    if not all(type(x) is list and len(x) == 3 and type(x[0]) is int and type(x[1]) is int
               and type(x[2]) is str for x in parts):
        raise WireError(Code.BAD_FIELD, "digest_reply: parts must be [[p, seq, digest], ...]")
    return DigestReply(h["req"], h["shard"], tuple(tuple(x) for x in parts),
                       _opt(h.get("client"), bytes), _of(h), h)


def _checkpoint_reply(h, P):
    t = h.get("time")
    return CheckpointReply(h["req"], h["shard"], _opt(h.get("path"), str),
                           float(t) if type(t) in (int, float) else None,
                           _opt(h.get("partitions"), int), _opt(h.get("error"), str),
                           _opt(h.get("client"), bytes), _of(h), h)


def _table(h, P):
    standbys, epochs, down = h.get("standbys"), h.get("epochs"), h.get("down")
    return Table(h["version"], str_list(h["owners"], "table", "owners"),
                 tuple(tuple(s) for s in standbys) if type(standbys) is list and all(
                     type(s) is list for s in standbys) else None,
                 tuple(epochs) if type(epochs) is list and all(type(e) is int for e in epochs)
                 else None,
                 tuple(x for x in down if type(x) is int) if type(down) is list else (),
                 run_id(h.get("run")), h.get("tier") if type(h.get("tier")) is dict else None)


BUILD = {
    wire.WELCOME: _welcome,
    wire.INIT_OK: lambda h, P: InitOk(h["msg"], str_list(h["created"], "init_ok", "created"),
                                      str_list(h["existing"], "init_ok", "existing"), h),
    wire.SNAPSHOT_REPLY: _snapshot_reply, wire.ROWS_REPLY: _rows_reply,
    wire.CATALOG_REPLY: lambda h, P: CatalogReply(h["req"], h["tensors"],
                                                  _opt(h.get("tables"), list) or [], h),
    wire.STATUS_REPLY: lambda h, P: StatusReply(h["req"], h["status"], h),
    wire.DIGEST_REPLY: _digest_reply, wire.CHECKPOINT_REPLY: _checkpoint_reply,
    wire.ADMIN_REPLY: lambda h, P: AdminReply(h["req"], h["result"], h),
    wire.TABLE: _table,
}
