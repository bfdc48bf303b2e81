"""The typed messages of the broker-shard link and the broker pair's link (protocol sections
6.10, 6.15 and 23): REGISTER, REGISTERED, ADOPT, STATE_REQ, STATE, SYNCED, DROP and PAIR,
checked once when unpacked. :mod:`.messages` re-exports them and dispatches to :data:`BUILD`."""
from __future__ import annotations

from dataclasses import dataclass

from . import wire
from .errors import Code, WireError
from .nested import (
    MAX_SHARD_ID,
    MAX_TOKEN,
    Tensors,
    held_tensor,
    opt_int,
    recent,
    state_block,
    str_list,
)


@dataclass(frozen=True, slots=True)
class Register:
    kind = wire.REGISTER
    shard: str
    holds: tuple              # (p, epoch, seq)
    rejoin: bool
    tensors: tuple            # HeldTensor, usable ones
    blocks: tuple             # (key, version), usable ones
    skipped: int              # entries of tensors and blocks that were not usable
    shm: bool                 # it took up the broker's shared memory (protocol section 21)
    token: bytes | None = None    # the shard process's own secret (section 6.10)


@dataclass(frozen=True, slots=True)
class Registered:
    kind = wire.REGISTERED
    shard: str
    partitions: int | None
    shm: bool                 # the broker sends this shard shared-memory references
    bepoch: int = 0           # the broker pair's epoch (section 23; 0: no pair)


@dataclass(frozen=True, slots=True)
class PairBeat:
    """A broker pair's state, on the pair link (section 23)."""
    kind = wire.PAIR
    role: str                 # "active" or "standby"
    epoch: int
    run: int


def _pair(h, P):
    if h["role"] not in ("active", "standby") or h["epoch"] < 0 or h["run"] < 0:
        raise WireError(Code.BAD_FIELD, "pair: role active or standby, epoch and run >= 0")
    return PairBeat(h["role"], h["epoch"], h["run"])


@dataclass(frozen=True, slots=True)
class Adopt:
    kind = wire.ADOPT
    p: int


@dataclass(frozen=True, slots=True)
class StateReq:
    kind = wire.STATE_REQ
    p: int
    to: str
    shm: bool                 # the standby reads shared memory: STATE may reference it
    names: frozenset | None = None   # a tier move's export: only these names' keys ...
    req: int | None = None           # ... answering this request


@dataclass(frozen=True, slots=True)
class State(Tensors):
    kind = wire.STATE
    p: int
    to: str
    seq: int
    epoch: int
    blocks: tuple             # StateBlock or StateRows, in frame order
    recent: tuple             # (c, m, key)
    t: list
    req: int | None = None    # a tier move's export (STATE_REQ ``req``): for the mover


@dataclass(frozen=True, slots=True)
class Synced:
    kind = wire.SYNCED
    p: int
    seq: int


@dataclass(frozen=True, slots=True)
class Drop:
    kind = wire.DROP
    ps: tuple                 # entries that are not ints are left out


def _register(h, P):
    sid, holds = h["shard"], h.get("holds", [])
    if not sid or len(sid) > MAX_SHARD_ID:
        raise WireError(Code.BAD_FIELD, f"register: shard id must be 1..{MAX_SHARD_ID} "
                                        "characters")
    if type(holds) is not list or not all(
            type(x) is list and len(x) == 3 and all(type(v) is int and v >= 0 for v in x)
            and x[0] < (P or 65536) for x in holds):
        raise WireError(Code.BAD_FIELD, "register: holds must be [[partition, epoch, seq], ...]")
    tensors, blocks = h.get("tensors"), h.get("blocks")
    tensors = tensors if type(tensors) is list else []
    blocks = blocks if type(blocks) is list else []
    held = []
    for t in tensors:
        try:
            held.append(held_tensor(t))
        except WireError:
            pass
    good = tuple((b[0], b[1]) for b in blocks if type(b) is list and len(b) == 2
                 and type(b[0]) is str and type(b[1]) is int and b[1] >= 0)
    return Register(sid, tuple(tuple(x) for x in holds), h.get("rejoin") is True, tuple(held),
                    good, len(tensors) - len(held) + len(blocks) - len(good),
                    h.get("shm") is True, _token(h))


def _token(h) -> bytes | None:
    """A REGISTER's ``token``: absent, or 16..MAX_TOKEN bytes."""
    token = h.get("token")
    if token is not None and (type(token) is not bytes or not 16 <= len(token) <= MAX_TOKEN):
        raise WireError(Code.BAD_FIELD, f"register: token must be 16..{MAX_TOKEN} bytes")
    return token


def _registered(h, P):
    return Registered(h["shard"], opt_int(h.get("partitions"), 1), h.get("shm") is True,
                      opt_int(h.get("bepoch"), 0) or 0)


def _p(h, P) -> int:
    p = h["p"]
    if not 0 <= p < (P or 65536):
        raise WireError(Code.BAD_FIELD, f"{h['kind']}: p {p} is not a partition")
    return p


def _state_req(h, P):
    names = h.get("names")
    if names is not None:
        names = frozenset(str_list(names, "state_req", "names"))
    return StateReq(_p(h, P), h["to"], h.get("shm") is True, names, opt_int(h.get("req"), 0))


def _state(h, P):
    blocks = tuple(state_block(b) for b in h["blocks"])
    if sum(b.nframes for b in blocks) != len(h.get("t", [])):
        raise WireError(Code.BAD_FIELD, "state: blocks name another number of frames than t "
                                        "holds")
    return State(_p(h, P), h["to"], h["seq"], h["epoch"], blocks, recent(h.get("recent")),
                 h.get("t", []), opt_int(h.get("req"), 0))



BUILD = {
    wire.REGISTER: _register, wire.REGISTERED: _registered,
    wire.ADOPT: lambda h, P: Adopt(_p(h, P)),
    wire.STATE_REQ: _state_req,
    wire.STATE: _state,
    wire.SYNCED: lambda h, P: Synced(_p(h, P), h["seq"]),
    wire.DROP: lambda h, P: Drop(tuple(p for p in h["ps"] if type(p) is int)),
    wire.PAIR: _pair,
}
