"""The agent thread: the only one that touches the client's DEALER and SUB sockets, and the only
reader of its local link.

The user's threads hand it commands through a queue and an empty wake-up frame on an inproc
PAIR (the zguide's Clone-client shape); it feeds them, the broker's messages and the passing of
time to its :class:`~gradbus.workers.agent_state.AgentState` and carries out the actions that
come back. Everything it decides lives in the state; this module only moves bytes.

On the broker's host the client talks to the broker over a local link
(:mod:`gradbus.codecs.link`) instead of the DEALER: a user's thread writes its pushes on the link
itself (:meth:`Agent.direct`) after queueing their bookkeeping for the agent without waking it
(:meth:`Agent.note`), so a push costs no hand-over between threads; the agent reads every
answer. A link that closes (the broker went away) is not made again: the agent sends whatever
was unanswered once more on the DEALER, and goes on there.
"""
from __future__ import annotations

import collections
import logging
import math
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from gradbus.codecs import hops, link, net, security, wire
from gradbus.codecs.errors import ClosedError, GradbusError

from .actions import AskTable, Reconnect, Subscribe, Unsubscribe
from .agent_state import AgentState, Send
from .reader import LinkReader

log = logging.getLogger("gradbus.client")

EVENTS_RCVHWM = 64
DRAIN_BATCH = 256            # messages read from one socket before the others get a turn


class Agent(threading.Thread):
    def __init__(self, ctx: zmq.Context, client_id: bytes, state: AgentState,
                 lock: threading.Lock, spin: float = 0.0):
        super().__init__(name=f"gradbus-agent-{client_id.hex()[:8]}", daemon=True)
        self.ctx, self.client_id, self.state = ctx, client_id, state
        self.lock = lock       # the user threads' lock around submit()
        self.cmds: collections.deque = collections.deque()
        self.wake_pending = False
        self.pipe_in = ctx.socket(zmq.PAIR)   # agent side
        self.pipe_in.linger = 0
        addr = f"inproc://gradbus-{client_id.hex()}"
        self.pipe_in.bind(addr)
        self.pipe_out = ctx.socket(zmq.PAIR)  # user side, used under ``lock``
        self.pipe_out.linger = 0
        self.pipe_out.connect(addr)
        self.dealer = self.sub = self.watch = self.gone = None
        self.link: link.Link | None = None
        self.error: BaseException | None = None
        # a broker pair (protocol section 23): its client URLs, the one in use, and the events
        # topics subscribed (subscribed again on the other broker's events socket)
        self.urls: list = []
        self.at = 0
        self.topics: set[bytes] = set()
        self._curve = self._curve_configure = None
        self._poller: zmq.Poller | None = None
        self._link_flags = 0
        # the turn around ``state``, and the link lent to callers waiting for their pushes
        self.reader = LinkReader(self, spin)

    # called from user threads, under ``lock``
    def submit(self, cmd) -> None:
        self.cmds.append(cmd)
        # Wake the agent only if it has not been woken since it last emptied the queue: it
        # clears the flag *before* draining, so a command appended while the flag is set is
        # always drained (saves a socket send per push under load).
        self._signal()

    def _signal(self) -> None:
        """Wake the agent unless a wake-up is pending. Under ``lock``."""
        if not self.wake_pending:
            self.wake_pending = True
            self.pipe_out.send(b"", zmq.NOBLOCK)

    def wake(self) -> None:
        """Wake the agent for what a caller's turn left it (see :mod:`.reader`); nothing once
        it stopped."""
        with self.lock:
            if not self.pipe_out.closed:
                try:
                    self._signal()
                except zmq.ZMQError:
                    pass

    def note(self, cmd) -> None:
        """Queue ``cmd`` without waking the agent (its answer will): a push a user's thread
        writes on the link itself, noted first so that its answer finds it. Under ``lock``."""
        self.cmds.append(cmd)

    def direct(self, frames: list) -> bool:
        """Write ``frames`` on the local link from the calling thread; False when there is
        none (or it closed, or its queue is full): hand them to the agent instead."""
        lnk = self.link
        return lnk is not None and lnk.send(frames)

    def open(self, url: str, events_url: str, curve, curve_configure,
             link_name: str | None = None, urls=(), at: int = 0) -> None:
        """Connect to the broker at ``url`` (its events at ``events_url``); ``urls``: a
        broker pair's client URLs, ``url`` being ``urls[at]``."""
        self.urls, self.at = list(urls) or [url], at
        self._events_url = events_url
        self._curve, self._curve_configure = curve, curve_configure
        self.dealer = self.ctx.socket(zmq.DEALER)
        net.tune(self.dealer)
        self.dealer.setsockopt(zmq.ROUTING_ID, self.client_id)
        if curve is not None:
            security.client_setup(self.dealer, curve)
            # a key refused later (revoked, then a reconnect) stops the client with that error
            self.watch = security.HandshakeWatch(self.dealer, curve, url, limit=None,
                                                 closing=len(self.urls) > 1)
        if curve_configure:
            curve_configure(self.dealer)
        if len(self.urls) > 1 and self.watch is None:
            # a broker whose process went away is left at once (a socket has one monitor:
            # with CURVE, the handshake watch counts the closings)
            self.gone = net.watch_closing(self.dealer)
        self.dealer.connect(url)
        self.sub = self.ctx.socket(zmq.SUB)
        net.tune(self.sub)
        self.sub.rcvhwm = EVENTS_RCVHWM
        if curve is not None:
            security.client_setup(self.sub, curve)
        if curve_configure:
            curve_configure(self.sub)
        self.sub.connect(events_url)
        self.sub.subscribe(wire.TOPIC_TABLE)
        self.sub.subscribe(wire.TOPIC_HEARTBEAT)
        for topic in self.topics:
            self.sub.subscribe(topic)
        if link_name and curve is None:
            self.link = link.connect(link_name, link.CLIENT, self.client_id)
        self._send([self.state._hb])     # registers this worker with the broker

    def _register(self, poller: zmq.Poller) -> None:
        for s in (self.dealer, self.sub):
            poller.register(s, zmq.POLLIN)
        if self.watch is not None:
            poller.register(self.watch.mon, zmq.POLLIN)
        if self.gone is not None:
            poller.register(self.gone, zmq.POLLIN)

    def run(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self.pipe_in, zmq.POLLIN)
        self._register(poller)
        state, cmds, reader = self.state, self.cmds, self.reader
        reader.take()
        try:
            while not state.stopped:
                lnk = self.link
                timeout = state.poll_ms
                if lnk is not None:
                    # callers waiting for their pushes read the link: an answer wakes them
                    # alone, and the agent takes the link back at its first turn without them
                    lent = reader.lent_for()
                    flags = (0 if lent is not None else net.POLLIN) | \
                        (net.POLLOUT if lnk.pending else 0)
                    if flags != self._link_flags:
                        poller.register(lnk.fd, flags)     # 0: unregistered
                        self._link_flags = flags
                    if lnk.buffered:
                        timeout = 0
                    elif lent is not None:
                        timeout = min(timeout, math.ceil(lent * 1000))
                elif self._link_flags:
                    self._link_flags = 0
                reader.give()
                try:
                    ready = dict(poller.poll(timeout))
                finally:
                    reader.take()
                if hops.ON:
                    hops.woke()
                if self.watch is not None and self.watch.mon in ready:
                    closed = self.watch.closed
                    self.watch.check()
                    if self.watch.closed > closed:
                        state.leave("the connection to the broker closed")
                if self.gone is not None and self.gone in ready:
                    recv_monitor_message(self.gone)
                    state.leave("the connection to the broker closed")
                if self.pipe_in in ready:
                    while True:
                        try:
                            self.pipe_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self.wake_pending = False
                while cmds:
                    state.command(cmds.popleft())
                self._act()
                if lnk is not None:
                    ev = ready.get(lnk.fd, 0)
                    if ev & net.POLLOUT:
                        lnk.flush()
                    if ev & net.POLLIN or lnk.buffered or lnk.closed:
                        self._drain_link(lnk, poller)
                if self.dealer in ready:
                    state.heard()
                    self._drain(self.dealer, state.reply)
                if self.sub in ready:
                    state.heard()
                    self._drain(self.sub, state.event)
                state.tick()
                self._act()
        except security.SecurityError as e:
            self.error = e
            log.error("client stopped: %s", e)
        except BaseException as e:  # surface the failure to every waiter
            self.error = e
            log.exception("client agent failed")
        finally:
            try:
                self._shut()
            finally:
                reader.give()
                reader.notify()

    def _shut(self) -> None:
        err = self.error or ClosedError("client closed")
        with self.lock:   # commands queued before the error was visible fail with it
            queued = list(self.cmds)
            self.cmds.clear()
        self.state.fail_all(err, queued)
        bye = wire.pack(wire.BYE)
        if self.link is not None:
            self.link.send([bye])
            self.link.flush()
            self.link.close()
            self.link = None
        try:
            self.dealer.send(bye, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._close_broker()
        self.pipe_in.close(linger=0)

    def _close_broker(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        net.stop_watching(self.dealer, self.gone)
        self.gone = None
        for s in (self.dealer, self.sub):
            if s is not None:
                s.close(linger=0)
        self.dealer = self.sub = None

    def _reconnect(self, why: str) -> None:
        """A broker pair: HELLO the other broker (then this one again, in turn) and open the
        sockets there; the state sends what was unanswered. No broker within the silence
        window: the state asks again later."""
        log.warning("leaving the broker at %s: %s", self.urls[self.at], why)
        state, poller = self.state, self._poller
        for s in (self.dealer, self.sub, self.watch and self.watch.mon, self.gone):
            if s is not None and poller is not None:
                poller.unregister(s)
        self._close_broker()
        urls = self.urls
        try:
            at, welcome = net.hello_any(self.ctx, urls, self.at + 1, "client",
                                        state.silence_after * 2, self._curve_configure,
                                        curve=self._curve)
        except GradbusError as e:
            log.warning("no broker of %s answered: %s", ",".join(urls), e)
            at, welcome = self.at, None
        host, _ = net.split_url(urls[at])
        if welcome is None:      # the same again; the state leaves once more when silent
            self.open(urls[at], self._events_url, self._curve, self._curve_configure,
                      urls=urls, at=at)
            state.stay()
        else:
            self._events_url = net.url(host, welcome["events"])
            self.open(urls[at], self._events_url, self._curve, self._curve_configure,
                      urls=urls, at=at)
            log.info("now at the broker at %s", urls[at])
            state.arrived(welcome)
        if poller is not None:
            self._register(poller)

    def _send(self, frames: list) -> None:
        lnk = self.link
        if lnk is None or not lnk.send(frames):
            self.dealer.send_multipart(frames, copy=False)

    def _act(self) -> None:
        for a in self.state.take():
            t = type(a)
            if t is Send:
                self._send(a.frames)
            elif t is Subscribe:
                self.topics.add(a.topic)
                self.sub.subscribe(a.topic)
            elif t is Unsubscribe:
                self.topics.discard(a.topic)
                self.sub.unsubscribe(a.topic)
            elif t is AskTable:     # subscribed once, whatever was asked before
                self.sub.unsubscribe(wire.TOPIC_TABLE)
                self.sub.subscribe(wire.TOPIC_TABLE)
            elif t is Reconnect:
                self._reconnect(a.why)

    def _read_link(self, lnk: link.Link) -> int:
        """Take the whole messages on the link (:data:`DRAIN_BATCH` at most) to the state;
        how many. Under the turn; raises :class:`link.LinkClosed`."""
        state, cmds = self.state, self.cmds
        n = 0
        for n in range(1, DRAIN_BATCH + 1):
            frames = lnk.recv()
            if frames is None:
                return n - 1
            # a push a user's thread wrote on the link was noted before it was written:
            # its answer is read only once the note is taken (else no Future waits for it)
            while cmds:
                state.command(cmds.popleft())
            state.heard()
            state.reply(frames)
        return n

    def _drain_link(self, lnk: link.Link, poller: zmq.Poller) -> None:
        try:
            if self._read_link(lnk) and self.reader.lent:
                self.reader.notify()    # a caller may be asleep on what was just read
        except link.LinkClosed:
            log.warning("the local link to the broker closed; going on over TCP")
            self.link = None
            if self._link_flags:
                poller.unregister(lnk.fd)
                self._link_flags = 0
            lnk.close()
            # pushes noted before they were written on it are among what it carried
            while self.cmds:
                self.state.command(self.cmds.popleft())
            self.state.link_lost()
        self._act()

    def read_for_caller(self, lnk: link.Link) -> bool:
        """A waiting caller's turn (see :mod:`.reader`): read the link, and send what goes
        back on it; what needs the agent's sockets waits for the agent, woken. False when the
        link closed (left to the agent, woken, which goes on over TCP)."""
        state = self.state
        try:
            state.stats["link_reads_by_callers"] += self._read_link(lnk)
        except link.LinkClosed:
            self.wake()
            return False
        acts = state.take()
        for i, a in enumerate(acts):
            if type(a) is not Send or not lnk.send(a.frames):
                state.out = acts[i:] + state.out
                self.wake()
                break
        return True

    def _drain(self, sock, handler) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            handler(frames)
        self._act()
