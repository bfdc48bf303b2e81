"""The agent thread: the only one that touches the client's DEALER and SUB sockets.

The user's threads hand it commands through a queue and an empty wake-up frame on an inproc
PAIR (the zguide's Clone-client shape); it feeds them, the broker's messages and the passing of
time to its :class:`~gradbus.workers.agent_state.AgentState` and carries out the actions that
come back. Everything it decides lives in the state; this module only moves bytes.
"""
from __future__ import annotations

import collections
import logging
import threading

import zmq

from gradbus.codecs import net, security, wire
from gradbus.codecs.errors import ClosedError

from .agent_state import AgentState, Send

log = logging.getLogger("gradbus.client")

EVENTS_RCVHWM = 64
DRAIN_BATCH = 256            # messages read from one socket before the others get a turn


class Agent(threading.Thread):
    def __init__(self, ctx: zmq.Context, client_id: bytes, state: AgentState,
                 lock: threading.Lock):
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
        self.dealer = self.sub = self.watch = None
        self.error: BaseException | None = None

    # called from user threads, under ``lock``
    def submit(self, cmd) -> None:
        self.cmds.append(cmd)
        # Wake the agent only if it has not been woken since it last emptied the queue: it
        # clears the flag *before* draining, so a command appended while the flag is set is
        # always drained (saves a socket send per push under load).
        if not self.wake_pending:
            self.wake_pending = True
            self.pipe_out.send(b"", zmq.NOBLOCK)

    def open(self, url: str, events_url: str, curve, curve_configure) -> None:
        self.dealer = self.ctx.socket(zmq.DEALER)
        net.tune(self.dealer)
        self.dealer.setsockopt(zmq.ROUTING_ID, self.client_id)
        if curve is not None:
            security.client_setup(self.dealer, curve)
            # a key refused later (revoked, then a reconnect) stops the client with that error
            self.watch = security.HandshakeWatch(self.dealer, curve, url, limit=None)
        if curve_configure:
            curve_configure(self.dealer)
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
        self.dealer.send(self.state._hb)  # registers this worker with the broker

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.pipe_in, self.dealer, self.sub):
            poller.register(s, zmq.POLLIN)
        if self.watch is not None:
            poller.register(self.watch.mon, zmq.POLLIN)
        state, cmds = self.state, self.cmds
        try:
            while not state.stopped:
                ready = dict(poller.poll(state.poll_ms))
                if self.watch is not None and self.watch.mon in ready:
                    self.watch.check()
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
            self._shut()

    def _shut(self) -> None:
        err = self.error or ClosedError("client closed")
        with self.lock:   # commands queued before the error was visible fail with it
            queued = list(self.cmds)
            self.cmds.clear()
        self.state.fail_all(err, queued)
        try:
            self.dealer.send(wire.pack(wire.BYE), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if self.watch is not None:
            self.watch.close()
        for s in (self.dealer, self.sub, self.pipe_in):
            s.close(linger=0)

    def _act(self) -> None:
        for a in self.state.take():
            if type(a) is Send:
                self.dealer.send_multipart(a.frames, copy=False)
            else:
                self.sub.subscribe(a.topic)

    def _drain(self, sock, handler) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            handler(frames)
        self._act()
