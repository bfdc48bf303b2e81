"""The typed messages of conflated delivery (protocol section 22), checked once when unpacked:
FOLLOW (the partitions a client that reads weights as frames follows) and CREDIT (it read what
it holds of them: the broker may send each one UPDATE). :mod:`.messages` re-exports them and
dispatches to :data:`BUILD`."""
from __future__ import annotations

from dataclasses import dataclass

from . import wire
from .errors import Code, WireError
from .nested import int_list


@dataclass(frozen=True, slots=True)
class Follow:
    kind = wire.FOLLOW
    ps: tuple                 # partitions, distinct, each in 0..P-1


@dataclass(frozen=True, slots=True)
class Credit:
    kind = wire.CREDIT
    ps: tuple                 # partitions, distinct, each in 0..P-1
    seqs: tuple               # per partition: the seq the client holds
    again: bool               # the last credit for them went unanswered: answer from ``seqs``


def _ps(h: dict, P: int | None) -> tuple:
    ps = int_list(h["ps"], h["kind"], "ps", 0, P or 65536)
    if len(set(ps)) != len(ps):
        raise WireError(Code.BAD_FIELD, f"{h['kind']}: ps names a partition twice")
    return ps


def _credit(h: dict, P: int | None) -> Credit:
    ps = _ps(h, P)
    seqs = int_list(h["seqs"], "credit", "seqs", 0)
    if len(seqs) != len(ps):
        raise WireError(Code.BAD_FIELD, "credit: seqs must be as long as ps")
    return Credit(ps, seqs, h.get("again") is True)


BUILD = {
    wire.FOLLOW: lambda h, P: Follow(_ps(h, P)),
    wire.CREDIT: _credit,
}
