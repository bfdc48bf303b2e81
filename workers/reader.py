"""A caller waiting for its push's answer reads the local link itself.

Without this, the answer to a push wakes two threads in turn: the agent, which reads the link
and resolves the Future, then the caller, which was waiting on it. A caller that waits in
``result()`` (or ``exception()``) of a push's Future reads the link in its own thread instead,
while the agent sleeps: one wake-up per round trip instead of two, and no hand-over of the
interpreter lock between them (``bench/peers.py --hops``; docs/performance.md).

Everything the agent decides lives in its :class:`~.agent_state.AgentState`, which is not
thread-safe; :attr:`LinkReader.turn` is the lock around it. The agent holds the turn whenever it
is not sleeping in its poll. Only a holder of the turn resolves a push's Future, so a waiting
caller waits for the turn; holding it, it takes every whole message on the link to the state
and carries out what goes back on the link. What needs the agent's sockets (a send on the
DEALER, a subscription, a reconnect) is left to the agent, which is woken for it.

While callers read the link, and for :data:`LEND` after the last one left it (the next push's
caller comes soon), the agent polls without the link's fd, so an answer wakes the caller alone.
A caller that leaves while other answers are due gives the link back at once and wakes the
agent, as does a thread about to wait for answers without reading (``flush()``, a full credit
window, a ``pull`` waiting for a version, a callback added to a Future no caller reads for:
:meth:`LinkReader.recall`). What remains (an answer that comes as the last caller leaves) the
agent reads at its next look: it sleeps :data:`AGENT_TICK` at most while the link is lent. When the agent reads answers
while the link is lent (it was still polling the link as a caller came), it wakes the callers
asleep on the link through a pipe, since the bytes they wait for are gone; a caller looks again
every :data:`CALLER_TICK` all the same.

``spin`` (seconds, the client's ``spin_us``): the caller polls the link without sleeping for
that long before it blocks, for a round trip shorter by the kernel's wake-up, at the cost of a
core while it waits.
"""
from __future__ import annotations

import math
import os
import select
import threading
import time
from concurrent import futures
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED

from gradbus.codecs import cores, hops

LEND = 0.005            # seconds the link stays lent after the last caller left it
AGENT_TICK = 0.05       # seconds the agent sleeps at most while the link is lent
CALLER_TICK = 0.1       # seconds a waiting caller sleeps at most before it looks again
_SETTLED = frozenset({FINISHED, CANCELLED, CANCELLED_AND_NOTIFIED})


def _settled(fut: futures.Future) -> bool:
    """``fut.done()`` without taking the Future's lock (five calls each time): its state is
    one attribute, set under the lock after its result; a stale read only means one more
    look, and the result itself is read through the Future."""
    return fut._state in _SETTLED


class ReadingFuture(futures.Future):
    """A push's Future whose waiter reads the link (see the module) before it blocks."""

    def __init__(self, reader: "LinkReader"):
        super().__init__()
        self._reader = reader

    def result(self, timeout: float | None = None):
        return super().result(self._read(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._read(timeout))

    def add_done_callback(self, fn) -> None:
        """As a Future's; a callback on a Future not yet resolved may be all that waits for
        it: where no caller reads the link now, the agent takes it back at once rather than
        after :data:`LEND` (or :data:`AGENT_TICK`), so the callback runs when the answer comes
        (:meth:`LinkReader.recall`)."""
        super().add_done_callback(fn)
        if not _settled(self):
            self._reader.recall()

    def _read(self, timeout: float | None) -> float | None:
        """Read until this Future is resolved or ``timeout`` passes; the time left."""
        if _settled(self):
            return timeout
        return self._reader.wait(self, timeout)


class LinkReader:
    """The turn around the agent's state, and the link lent to the callers that wait.

    ``agent``: needs ``link``, ``state`` and ``read_for_caller(link)`` (the caller's turn: the
    link read, what goes back on it sent; False when the link closed) and ``wake()``."""

    def __init__(self, agent, spin=0.0):
        """``spin``: seconds a caller polls the link before it sleeps, or a
        :class:`gradbus.codecs.cores.Spin` that says how long each time."""
        self.agent = agent
        self.spin = cores.Spin.from_seconds(spin, cores.CALLER_SPIN_US)
        self.turn = threading.Lock()
        self.owner: int | None = None       # the thread holding the turn
        self.readers = 0                    # callers reading the link now
        self.until = 0.0                    # the link is lent until then (monotonic) too
        self._count = threading.Lock()
        self._wake: tuple[int, int] | None = None   # the wake-up pipe, made at the first sleep
        self._closed = False
        self._pollers = threading.local()   # each caller's poller of the link and the pipe

    def lent_for(self) -> float | None:
        """How long the agent may sleep without reading the link, lent to callers: while one
        reads it, :data:`AGENT_TICK` (the agent then looks again, for answers that came as the
        last caller left); else what is left of :data:`LEND` after the last one left (the next
        may come). None: the agent reads it."""
        if self.readers:
            return AGENT_TICK
        left = self.until - time.monotonic()
        return left if left > 0 else None

    @property
    def lent(self) -> bool:
        return self.lent_for() is not None

    def take(self) -> None:
        """The agent's turn (blocking)."""
        self.turn.acquire()
        self.owner = threading.get_ident()

    def give(self) -> None:
        self.owner = None
        self.turn.release()

    def recall(self) -> None:
        """A thread is about to wait for answers without reading the link (``flush()``, a
        full credit window, a ``pull`` waiting for a version): the agent takes the link back
        now if no caller reads it."""
        if self.readers == 0 and self.until:
            self.until = 0.0
            self.agent.wake()

    def notify(self) -> None:
        """The agent read answers from the link while callers read it: a caller about to sleep
        on the link's fd (the bytes it waited for already taken) wakes and looks again."""
        wake = self._wake
        if wake is None or self._closed:
            return      # no caller ever slept on the link
        try:
            os.write(wake[1], b"\0")
        except (BlockingIOError, OSError):
            pass        # full (a wake is pending anyway), or closed

    def close(self) -> None:
        """Close the wake-up pipe (the agent has stopped: nothing notifies any more)."""
        with self._count:
            if self._closed:
                return
            self._closed = True
        for fd in self._wake or ():
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake_fd(self) -> int | None:
        """The read end of the wake-up pipe, made now if it is not yet; None once closed."""
        with self._count:
            if self._closed:
                return None
            if self._wake is None:
                r, w = os.pipe()
                os.set_blocking(r, False)
                os.set_blocking(w, False)
                self._wake = (r, w)
            return self._wake[0]

    def _poller(self, fd: int):
        """This thread's poller of the link's ``fd`` and the wake-up pipe, made at its first
        sleep and kept while the link is the same."""
        cached = getattr(self._pollers, "poller", None)
        if cached is not None and cached[0] == fd:
            return cached[1]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        wake_r = self._wake_fd()
        if wake_r is not None:
            poller.register(wake_r, select.POLLIN)
        self._pollers.poller = (fd, poller)
        return poller

    def wait(self, fut: futures.Future, timeout: float | None) -> float | None:
        """Read the link until ``fut`` is resolved, ``timeout`` passes, or the link is gone
        (the caller then waits on the Future as without a link); what is left of ``timeout``.
        Only a holder of the turn resolves a push's Future, so waiting for the turn is waiting
        for the answer too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._wait(fut, deadline)
        finally:
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        return timeout

    def _wait(self, fut: futures.Future, deadline: float | None) -> None:
        agent = self.agent
        lnk = agent.link
        me = threading.get_ident()
        if lnk is None or self.owner == me:
            return    # no link, or called from the turn itself (a done-callback)
        spin = self.spin.seconds()
        spin_end = time.monotonic() + spin if spin else 0.0
        with self._count:
            self.readers += 1
        poller = None
        try:
            while not _settled(fut):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                if not self.turn.acquire(timeout=-1 if left is None else left):
                    return
                self.owner = me
                if hops.ON:
                    hops.woke()     # this thread looks at the link now (its loop's wake)
                try:
                    if _settled(fut) or agent.link is not lnk or agent.state.stopped:
                        return      # answered in the agent's turn, or no link to read
                    if not agent.read_for_caller(lnk):
                        return
                finally:
                    self.owner = None
                    self.turn.release()
                if _settled(fut):
                    return
                if poller is None:
                    poller = self._poller(lnk.fd)
                if spin_end and time.monotonic() < spin_end:
                    ms = 0
                else:
                    ms = math.ceil(1000 * (CALLER_TICK if left is None
                                           else min(CALLER_TICK, left)))
                for fd, _ in poller.poll(ms):
                    if fd != lnk.fd:
                        try:
                            os.read(fd, 4096)
                        except OSError:
                            pass
        finally:
            state = agent.state
            with self._count:
                self.readers -= 1
                due = not self.readers and bool(state.msg_futures or state.req_futures
                                                 or lnk.buffered)
                # answers still due: the agent takes the link back now; else it waits a while
                # for the next caller before it does
                self.until = 0.0 if due else time.monotonic() + LEND
            if due:
                agent.wake()
