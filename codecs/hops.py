"""Per-hop stamps of pushes on their round trip, for finding where the time goes.

Off unless ``$GRADBUS_HOPS`` names a directory when the process starts. Then every process of
the cluster (worker, broker, shard) appends one record per push and hop to its own file there,
``hops-<pid>.bin``: the push's msg id, the hop's number and ``time.monotonic_ns()``, a clock
that every process of one host shares, so no clock sync is needed. ``bench/peers.py --hops``
sets it for one worker at depth 1 and prints the median time between consecutive hops.

A message's crossing from one process to the next splits in two at the receiver's wake: each
loop that reads messages (the broker's, a shard's, a client's I/O agent) notes when its poll
returns (:func:`woke`), and the receiver's first hop of a message is preceded by a ``*_wake``
hop at that time (:func:`stamp_woke`). Sender's hop to wake: the rest of the sender's work, the
write and the kernel waking the receiver; wake to the receiver's hop: its loop, the read and
the checks of the message before its hop.

Each record is written with one unbuffered ``os.write`` (a few microseconds, counted in the
hop after it): a process stopped by a signal leaves every record it made. With the variable
unset, a hop costs the check of :data:`ON`.
"""
from __future__ import annotations

import os
import struct
import threading
import time

# the hops of a push and its answer, in the order they happen
HOPS = ("push", "agent_send", "broker_wake", "broker_in", "batch_out", "shard_wake", "shard_in",
        "applied", "shard_out", "broker_wake_applied", "broker_applied", "ack_out", "agent_wake",
        "agent_ack", "resolved", "pull_returned")
WAKES = ("broker_wake", "shard_wake", "broker_wake_applied", "agent_wake")
_ID = {h: i for i, h in enumerate(HOPS)}
RECORD = struct.Struct("<QQB")      # msg, monotonic ns, hop

ON = bool(os.environ.get("GRADBUS_HOPS"))
_fd: int | None = None
_pid = 0
_loop = threading.local()        # .woke: when this thread's loop last returned from its poll


def _file() -> int:
    global _fd, _pid
    if _fd is None or _pid != os.getpid():     # a forked child writes its own file
        _pid = os.getpid()
        _fd = os.open(os.path.join(os.environ["GRADBUS_HOPS"], f"hops-{_pid}.bin"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return _fd


def stamp(hop: str, msgs, t: int | None = None) -> None:
    """Record that the pushes ``msgs`` (an int, or an iterable of them) passed ``hop`` now (or
    at ``t``, in ``time.monotonic_ns()``)."""
    t = time.monotonic_ns() if t is None else t
    h = _ID[hop]
    if type(msgs) is int:
        data = RECORD.pack(msgs, t, h)
    else:
        data = b"".join(RECORD.pack(m, t, h) for m in msgs if type(m) is int)
    if data:
        os.write(_file(), data)


def woke() -> None:
    """Note that this thread's loop woke (its poll returned) now."""
    _loop.woke = time.monotonic_ns()


def stamp_woke(hop: str, msgs) -> None:
    """Stamp ``msgs`` at ``hop`` (a wake) with the time this thread's loop last woke; nothing
    from a thread whose loop never noted one."""
    t = getattr(_loop, "woke", None)
    if t is not None:
        stamp(hop, msgs, t)


def close() -> None:
    """Close this process's file (the next stamp opens it again)."""
    global _fd
    if _fd is not None:
        os.close(_fd)
        _fd = None


def read(directory: str) -> dict[int, dict[str, int]]:
    """Every record under ``directory``: msg -> {hop: ns} (the first stamp of each hop)."""
    out: dict[int, dict[str, int]] = {}
    for name in os.listdir(directory):
        if not name.startswith("hops-"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        usable = len(data) - len(data) % RECORD.size
        for msg, t, h in RECORD.iter_unpack(data[:usable]):
            out.setdefault(msg, {}).setdefault(HOPS[h], t)
    return out
