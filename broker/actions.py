"""What the broker core asks its loop to do: typed, frozen actions.

* :class:`ToClient` -- send ``frames`` to a client (frontend ROUTER); :class:`AckClient` is the
  one coalesced ACK message for the pushes of one client acknowledged in one step;
  :class:`ReplyClient` a shard's reply whose shared-memory refs are copied out first;
* :class:`ToShard` -- send ``frames`` to a shard (backend ROUTER), with the tensors a client
  left in shared memory inlined first where ``inline`` says so; :class:`Adopt` is the ADOPT
  that starts a catch-up (counted by ops commands);
* :class:`Publish` -- publish ``frames`` on events (XPUB), ``frames[0]`` is the topic;
  :class:`Capture` is a partition's UPDATE that clients follow by conflated delivery: the loop
  publishes it, then hands it back to :meth:`~.core.BrokerCore.on_published` with any
  shared-memory references copied into its frames;
* :class:`AppendLog` -- append one BATCH's parts to the update log, before it is sent;
* :class:`SyncLog` -- fsync the update log;
* :class:`ReadLog` -- read the update log and hand the REGISTER ``frames`` from ``identity``
  back to the core with its contents (a returning shard may be rebuilt from it).

:class:`Acked` is not an action: settlement returns it for one acknowledged push and the core
folds all of them into :class:`AckClient` messages once per step.

Tensor frames are the objects the loop received (``zmq.Frame``), passed by reference.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToClient:
    identity: bytes
    frames: list


@dataclass(frozen=True, slots=True)
class AckClient(ToClient):
    msgs: tuple = ()          # the msg ids this ACK acknowledges


@dataclass(frozen=True, slots=True)
class ReplyClient(ToClient):
    """A shard's reply whose tensors are refs into its reply area, for a client that does not
    read shared memory: the bytes are copied into the frames first, and ``torn`` (an ERROR
    ``SHM_TORN``) goes instead when they were rewritten before they were read whole."""
    torn: list = ()


INLINE_VIEW = 1      # ToShard.inline: put shared-memory bytes in the frames (zero-copy views)
INLINE_COPY = 2      # ... as copies (for a receiver nothing waits for: its slots may be reused)
RELAY = 3            # ... the other way: frames from clients without it go into the broker's
                     # ring and the shard gets references (ToShard.relay names the slots)
INLINE_REPLY = 4     # a shard's reply (STATE) with refs into its reply area, copied out first;
                     # ToShard.torn is done instead when they were rewritten before


@dataclass(frozen=True, slots=True)
class ToShard:
    identity: bytes
    frames: list
    inline: int = 0           # the receiver does not read shared memory: see INLINE_*; RELAY
    relay: int = 0            # RELAY: the id the broker's ring holds this message's bytes under
    torn: object = None       # INLINE_REPLY: the action to do instead when the refs were torn


@dataclass(frozen=True, slots=True)
class Adopt(ToShard):
    p: int = -1               # the partition the shard starts catching up on


@dataclass(frozen=True, slots=True)
class Publish:
    frames: list
    refs: bool = False        # an UPDATE from a shard that may reference its board


@dataclass(frozen=True, slots=True)
class Capture(Publish):
    p: int = -1               # the partition
    seq: int = 0              # the UPDATE's seq
    owners: tuple = ()        # followers whose pushes its batch applied


@dataclass(frozen=True, slots=True)
class AppendLog:
    parts: list               # BATCH header parts
    t_list: list              # their tensor descriptors
    frames: list              # their tensor frames
    time: float               # wall clock


@dataclass(frozen=True, slots=True)
class FreeRelays:
    relays: tuple             # relay ids whose batches every replica applied: free their slots


@dataclass(frozen=True, slots=True)
class SyncLog:
    pass


@dataclass(frozen=True, slots=True)
class ReadLog:
    identity: bytes
    frames: list
    key: str | None = None     # the sender's CURVE key (None: CURVE off)


@dataclass(frozen=True, slots=True)
class Acked:
    client: bytes
    msg: int
    ver: int | None = None      # the least version of the push's tensors once it was applied


Action = (ToClient | ReplyClient | ToShard | Publish | Capture | AppendLog | SyncLog | ReadLog
          | FreeRelays)
