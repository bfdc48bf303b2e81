"""What the user's threads hand the agent thread: one frozen dataclass per command.

Every command that waits for an answer carries its :class:`~concurrent.futures.Future` as
``future``, so whatever stops the agent can fail every queued command the same way.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SendMessage:
    """A push or an init, named by its ``msg`` id: settled by ACK, INIT_OK or ERROR, and sent
    again until then (the broker's duplicate window applies it once). ``future`` is None for a
    push with ``acks=0``. ``sent``: the user's thread wrote it on the local link itself (the
    agent only waits for its answer)."""
    msg: int
    frames: list
    future: Future | None
    sent: bool = False
    parts: frozenset = frozenset()   # the partitions a push carries blocks of (conflated
                                     # delivery: its own weights come back for them)


@dataclass(frozen=True, slots=True)
class Forward:
    """Frames for the broker that a user's thread could not write on the local link itself."""
    frames: list
    future: None = None


@dataclass(frozen=True, slots=True)
class Request:
    """A request named by its ``req`` id (CATALOG, STATUS), answered by one reply or ERROR."""
    req: int
    frames: list
    future: Future


@dataclass(frozen=True, slots=True)
class ReadRows:
    """A read of table rows: one ROWS_REPLY per shard involved, gathered before ``future``
    resolves to ``(rows, table_version)``."""
    req: int
    frames: list
    future: Future


@dataclass(frozen=True, slots=True)
class Track:
    """Follow these tensors' layouts (subscribe to their partitions, then snapshot them)."""
    layouts: list
    future: Future


@dataclass(frozen=True, slots=True)
class Refresh:
    """Snapshot these blocks again: their bytes in a board were rewritten and no newer update
    came in time."""
    keys: list
    future: None = None


@dataclass(frozen=True, slots=True)
class CheckTable:
    """A pull found partitions down by the table this client holds, which may be stale (a
    TABLE dropped on the way, or still behind an answer that came another way): ask the
    broker for its table before the pull says so."""
    future: None = None


@dataclass(frozen=True, slots=True)
class Watch:
    """A pull waits for live partitions ``parts`` to reach a version: follow their updates
    meanwhile (``on``), or no longer (``on=False``), so that it is woken when they change."""
    parts: tuple
    on: bool
    future: None = None


@dataclass(frozen=True, slots=True)
class Read:
    """The application read (or, ``waiting``, waits to read newer) weights of partitions
    ``parts``, holding seq ``seqs`` of each: a client that follows them by conflated delivery
    grants the broker a credit for each that received nothing since (protocol section 22)."""
    parts: tuple
    seqs: tuple
    waiting: bool
    future: None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """End the agent thread."""
    future: None = None


Command = SendMessage | Forward | Request | ReadRows | Track | Refresh | Watch | Read | Stop
