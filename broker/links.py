"""The broker's local links (:mod:`gradbus.codecs.link`): the listener its shared-memory offer
names, the links peers on this host opened, and which identity each one carries.

A client's link carries what its DEALER would to the frontend, a shard's what it would to the
backend; the loop hands their messages to the same handlers with the identity the link was
introduced with, and sends what the core addresses to that identity over its link while the
link is open (over the ROUTER otherwise). A second link introduced with an identity that has
one replaces it (a client that reconnected), except a shard's: a live shard's route is not
taken over by whoever names it (the first link stays until it closes).

Nothing here blocks: a link whose socket is full queues whole messages up to its bound
(:data:`CLIENT_QUEUE`, :data:`SHARD_QUEUE`) and the loop writes them out when it is writable; a
message past the bound is dropped and counted (``send_link_full``), as the frontend drops a
reply to a client whose pipe is full.
"""
from __future__ import annotations

import logging

from zmq import POLLIN, POLLOUT

from gradbus.codecs import link

log = logging.getLogger("gradbus.broker")

CLIENT_QUEUE = 16 << 20       # bytes queued to one client's link (replies are small)
SHARD_QUEUE = 1 << 30         # to one shard's (batches are bounded by credit and the byte cap)
MAX_LINKS = 4096              # links open at once (each a descriptor)
CLIENT, SHARD = link.CLIENT, link.SHARD


class Links:
    """The loop's poller (:meth:`attach`) is kept up to date here: every link is polled for
    input, and for room while it has output queued (``writing``); ``again`` names the links
    that hold whole messages already read, which their sockets will not show."""

    def __init__(self, cluster: str, counters, errors):
        self.listener, self.name = link.listen(cluster)
        self.counters = counters
        self.errors = errors
        self.by_fd: dict[int, list] = {}           # fd -> [Link, role, identity]
        self.routes: dict[tuple, link.Link] = {}   # (role, identity) -> its link
        self.poller = None
        self.writing: set[int] = set()             # polled for room too
        self.again: set[int] = set()               # whole messages read, not yet handled

    def fileno(self) -> int:
        return self.listener.fileno()

    def attach(self, poller) -> None:
        self.poller = poller
        poller.register(self.listener.fileno(), POLLIN)
        for fd in self.by_fd:
            poller.register(fd, POLLIN)

    # -- links coming and going -------------------------------------------------------------------
    def accept(self) -> None:
        for _ in range(64):
            if len(self.by_fd) >= MAX_LINKS:
                self.counters["links_refused"] += 1
                return
            lnk = link.accept(self.listener)
            if lnk is None:
                return
            lnk.limit = CLIENT_QUEUE
            self.by_fd[lnk.fd] = [lnk, None, None]
            if self.poller is not None:
                self.poller.register(lnk.fd, POLLIN)

    def _drop(self, fd: int) -> None:
        ent = self.by_fd.pop(fd, None)
        if ent is None:
            return
        lnk, role, ident = ent
        if role is not None and self.routes.get((role, ident)) is lnk:
            del self.routes[(role, ident)]
        if self.poller is not None:
            self.poller.unregister(fd)
        self.writing.discard(fd)
        self.again.discard(fd)
        lnk.close()

    def read(self, fd: int, limit: int) -> list[tuple]:
        """Up to ``limit`` messages of link ``fd``: ``(role, identity, frames)``; the link's
        introduction is taken here, and a link that closed or misbehaved is dropped."""
        ent = self.by_fd.get(fd)
        if ent is None:
            return []
        lnk, out = ent[0], []
        try:
            while len(out) < limit:
                frames = lnk.recv()
                if frames is None:
                    break
                if ent[1] is None:
                    if not self._introduce(fd, ent, frames):
                        return out
                    continue
                out.append((ent[1], ent[2], frames))
        except link.LinkClosed:
            if lnk.bad:
                log.warning("a local link sent %s: closed", lnk.bad)
            self._drop(fd)
            return out
        if lnk.buffered:
            self.again.add(fd)
        else:
            self.again.discard(fd)
        return out

    def _introduce(self, fd: int, ent: list, frames) -> bool:
        intro = link.introduction(frames)
        if intro is None:
            self.counters["links_refused"] += 1
            self._drop(fd)
            return False
        role, ident = intro
        old = self.routes.get(intro)
        if old is not None and role == SHARD and not old.closed:
            self.counters["links_refused"] += 1      # a live shard's route stays its own
            self._drop(fd)
            return False
        if old is not None:
            self._drop(old.fd)
        ent[1], ent[2] = role, ident
        ent[0].limit = SHARD_QUEUE if role == SHARD else CLIENT_QUEUE
        self.routes[intro] = ent[0]
        self.counters["links_opened"] += 1
        return True

    def writable(self, fd: int) -> None:
        ent = self.by_fd.get(fd)
        if ent is None:
            return
        if ent[0].flush() and fd in self.writing:
            self.writing.discard(fd)
            self.poller.register(fd, POLLIN)       # nothing queued: input only again
        if ent[0].closed:
            self._drop(fd)

    def holds(self, role: bytes, identity: bytes) -> bool:
        """Whether an open link carries ``identity`` (of ``role``): a message under that
        identity from a socket is another peer's, not this link's."""
        lnk = self.routes.get((role, identity))
        return lnk is not None and not lnk.closed

    # -- sending ---------------------------------------------------------------------------------
    def send(self, role: bytes, identity: bytes, frames) -> bool | None:
        """Send over ``identity``'s link: True when sent (or queued), False when its queue was
        full (dropped, counted), None when it has no link (the caller uses the ROUTER)."""
        lnk = self.routes.get((role, identity))
        if lnk is None:
            return None
        if lnk.send(frames):
            if lnk.pending and lnk.fd not in self.writing and self.poller is not None:
                self.writing.add(lnk.fd)
                self.poller.register(lnk.fd, POLLIN | POLLOUT)
            return True
        if lnk.closed:
            self._drop(lnk.fd)
            return None
        self.errors["send_link_full"] += 1
        return False

    def close(self) -> None:
        for fd in list(self.by_fd):
            self._drop(fd)
        self.listener.close()
