"""An in-process pipe: a shard's messages to and from a broker that runs in the same process,
handed over as lists of frames, with no socket, no system call and no thread between them.

A shard whose core runs inside the broker's process (``gradbus broker --inproc-shard``) talks to
the broker over a :class:`Pipe` where it would use a local link or its DEALER: the shard's end
(:class:`ShardEnd`) has the calls of a DEALER that the shard's loop makes (``send``,
``send_multipart``, ``recv_multipart``, ``poll``, ``close``, ``lost``; and ``take``, which a
link's end has too), so the shard runs the same code it runs in a process of its own.
Nothing here waits: the broker's loop hands a message to the shard (:meth:`Pipe.put`), lets
the shard take what is there, and takes what the shard sent back (:meth:`Pipe.take`), all on
the one thread.

The receiver sees each frame as a flat byte view (a ``memoryview``), as it sees frames read
from a local link; a frame is never copied. What crosses the pipe is still a whole protocol
message, packed and checked by the receiver as over a socket: the shard's core and the broker's
meet at the same boundary as between two processes.

The queues are bounded by what feeds them (the broker's credit per shard, the shard's replies
to what it was given); a pipe that either side closed refuses messages (``lost`` on the
shard's end) and drops what waits for the shard.
"""
from __future__ import annotations

import collections

import zmq

from .link import byte_view as _view


class Pipe:
    """Both directions between the broker and one in-process shard. The broker's side is the
    pipe itself (:meth:`put`, :meth:`take`, :attr:`to_shard`); the shard's is :attr:`shard`."""

    def __init__(self):
        self.to_shard: collections.deque = collections.deque()
        self.to_broker: collections.deque = collections.deque()
        self.closed = False
        self.shard = ShardEnd(self)

    def put(self, frames) -> bool:
        """A message for the shard; False once the pipe is closed (dropped)."""
        if self.closed:
            return False
        self.to_shard.append([_view(f) for f in frames])
        return True

    def take(self) -> list | None:
        """The shard's oldest message to the broker, or None."""
        return self.to_broker.popleft() if self.to_broker else None

    def close(self) -> None:
        """Refuse messages from now on; what the shard sent before is still taken (a
        shard's BYE as it stops)."""
        self.closed = True
        self.to_shard.clear()


class ShardEnd:
    """The shard's end of a :class:`Pipe`, behind the calls of a DEALER (see the module)."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe

    @property
    def lost(self) -> bool:
        return self.pipe.closed

    def send(self, msg, flags: int = 0, copy: bool = True, track: bool = False) -> None:
        self.send_multipart([msg])

    def send_multipart(self, frames, flags: int = 0, copy: bool = True,
                       track: bool = False) -> None:
        if not self.pipe.closed:
            self.pipe.to_broker.append([_view(f) for f in frames])

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> list:
        frames = self.take()
        if frames is None:
            raise zmq.Again()
        return frames

    def take(self) -> list | None:
        """The next message, or None when none waits (:meth:`recv_multipart` without the
        exception, for a loop that drains every turn)."""
        return self.pipe.to_shard.popleft() if self.pipe.to_shard else None

    def poll(self, timeout: int | None = None, flags: int = 1) -> int:
        """POLLIN (1) when a message is waiting (or the pipe closed), else 0 at once: the
        broker's loop, not a wait here, runs the shard."""
        return 1 if self.pipe.to_shard or self.pipe.closed else 0

    def close(self, linger: int | None = None) -> None:
        self.pipe.close()
