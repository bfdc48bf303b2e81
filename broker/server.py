"""The broker process: three sockets around :class:`~gradbus.broker.core.BrokerCore`.

* frontend ROUTER (clients; shards' discovery HELLO), ``ROUTER_MANDATORY`` and ``ROUTER_HANDOVER``;
* backend ROUTER (shards), ``ROUTER_MANDATORY`` without ``ROUTER_HANDOVER``: a routing id is
  no credential, and a peer connecting with one in use is ignored (the shard keeps its route);
* events XPUB (weight updates by partition topic, the partition table, heartbeats).

With ``curve`` (a :class:`~gradbus.codecs.security.Curve` holding the broker's key pair and an
allow directory) all three are CURVE servers and a ZAP thread admits only the allowed keys.
Each message then reaches the core with the roles of the key that sent it (libzmq attaches the
ZAP user id, the sender's Z85 public key, to every message as its ``User-Id`` property; the
allow list maps it to roles); the core refuses what those roles do not permit. A backend
message also carries the key itself: a shard's name is bound to the key that registered it.

The loop drains what is ready (backend first, so credit returns before new work is batched),
then flushes batches: pushes that arrived together for a partition go to its shard as one batch.
Tensor frames are received with ``copy=False`` and sent on as the same frames.

The loop does the core's I/O: it carries out its typed actions (:mod:`.actions`), writes and
fsyncs the update log when asked, reads it for a returning shard's REGISTER and hands the
contents back, and applies fault injection (``fault_drop``, tests) at the transport.
"""
from __future__ import annotations

import logging
import threading
import time

import zmq

from gradbus.codecs import cores, hops, net, security, wire
from gradbus.codecs import shm as shmem
from gradbus.codecs.errors import WireError

from . import log as ulog
from .actions import (
    AppendLog,
    Capture,
    FreeRelays,
    Publish,
    ReadLog,
    ReplyClient,
    SyncLog,
    ToClient,
    ToShard,
)
from .core import BrokerCore
from .faults import FaultInjector
from .flow import ByteCap
from .inproc import InprocShards, welcome_of
from .links import CLIENT, SHARD, Links
from .pair import Deposed, Pair
from .pair_gate import PairGate
from .pair_link import PairLink
from .shm_io import ShmIO

log = logging.getLogger("gradbus.broker")

_HB_SUBSCRIBED, _TABLE_SUBSCRIBED = b"\x01" + wire.TOPIC_HEARTBEAT, b"\x01" + wire.TOPIC_TABLE
EVENTS_SNDHWM = 64        # messages queued per subscriber before XPUB drops (clients re-snapshot)
FRONTEND_RCVHWM = 16      # messages libzmq queues per client connection before TCP back-pressure:
                          # the loop reads the frontend always (the byte cap refuses pushes past
                          # it), so a deep queue buys nothing, and what it may hold in a stalled
                          # loop is part of the memory bound (docs/operations.md)
FRONTEND_SNDHWM = 10000   # replies queued per client; replies are small and bounded by its window,
                          # and a reply that still finds the queue full is counted and dropped
DRAIN_MAX = 512           # messages read from one socket before flushing


class BrokerServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 5555, *, backend_port: int = 0,
                 events_port: int = 0, batch_window: float = 0.0, clock=time.monotonic,
                 ctx: zmq.Context | None = None, curve: security.Curve | None = None,
                 on_metrics=None, log: ulog.UpdateLog | None = None, fault_drop: float = 0.0,
                 fault_seed: int = 0, shm: bool | None = None, peer: str | None = None,
                 peer_port: int = 0, pair: Pair | None = None, spin: float | None = 0.0,
                 **core_kw):
        """``log``: the update log to write (batches, as they go out); ``shm``: offer shared
        memory to clients and shards on this host (None: ``$GRADBUS_SHM``, else on);
        ``peer``: the pair address of this broker's peer (a broker pair, protocol section
        23), this broker's own bound on ``peer_port``; ``pair``: the pair state a deposed
        broker's loop left (it starts again as the standby); ``spin``: seconds the loop polls
        without sleeping after a turn that had messages (0: it sleeps at once; None: judged from
        the host's cores, :class:`gradbus.codecs.cores.Spin`); ``core_kw``:
        the core's (partitions, replay, and the fields of :class:`~.settings.Settings`)."""
        self.clock = clock
        self.on_metrics = on_metrics   # called with a metrics snapshot every tick
        self.batch_window = batch_window
        self.spin = cores.Spin.from_seconds(spin, cores.BROKER_SPIN_US)
        self.log = log
        if log is not None:
            core_kw["log_fsync"] = log.fsync
        elif core_kw.get("log_fsync"):
            raise ValueError("log_fsync needs an update log (log=)")
        self.core = BrokerCore(now=clock(), **core_kw)
        # the core's event handlers, through fault injection when there is some
        self.handlers = FaultInjector(self.core, fault_drop, fault_seed) if fault_drop \
            else self.core
        # the frontend's messages, through the byte cap on held tensor data
        self.on_frontend = ByteCap(self.core, self.handlers.on_frontend)
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.host = host
        self.curve = curve
        self.auth = self.handshakes = self.frontend = self.backend = self.events = None
        self.shm_io = self.links = None
        self.inproc: InprocShards | None = None     # shards in this process (add_shard)
        try:
            self._open(curve, port, backend_port, events_port)
            self.shm_io = ShmIO(self.core, f"{host}:{self.port}", shmem.wanted(shm))
            if self.core.shm is not None and curve is None:
                # peers on this host talk over local links (codecs/link.py); with CURVE on they
                # keep its authentication and use the ROUTERs
                self.links = Links(self.shm_io.cluster, self.core.meters.counters,
                                   self.core.errors)
                self.core.shm["link"] = self.links.name
        except BaseException:
            self.close()
            raise
        self.core.ports = {"events": self.events_port, "backend": self.backend_port}
        self.core.catalog.pulse = self._pulse
        self.stopping = threading.Event()
        self.send_failures = 0
        self.pair = self.pair_link = self.gate = None
        self.deposed: Deposed | None = None     # set when the loop ended deposed
        if peer is not None:
            if log is not None or core_kw.get("replay") is not None:
                self.close()
                raise ValueError("a broker pair (peer=) runs without an update log for now")
            s = self.core.settings
            self.pair = pair or Pair(self.core.run, now=clock(),
                                     heartbeat_interval=s.heartbeat_interval,
                                     liveness=s.liveness)
            self.pair.run = self.core.run
            self.pair.deposed = None      # a deposed broker's pair state: standby from now on
            try:
                self.pair_link = PairLink(self.ctx, host, peer_port, peer, curve, self.auth)
            except BaseException:
                self.close()
                raise
            self.gate = PairGate(self.core, self.pair, self.pair_link, clock, self._do,
                                 self._deposed)

    def _open(self, curve, port: int, backend_port: int, events_port: int) -> None:
        if curve is not None:
            if not curve.allow:
                raise security.SecurityError("a CURVE broker needs an allow directory "
                                             "(--curve-allow DIR)")
            # the ZAP handler must answer before the first connection is accepted
            self.auth = security.Authenticator(self.ctx, curve.allow).start()
        # never stall the loop on one slow client; a client that reconnects keeps its id
        self.frontend = self._router(sndtimeo=0, handover=True)
        # shards: bounded by credit, so rarely full. No handover: a peer connecting with a live
        # shard's routing id must not take its route (shards pick a fresh random one per
        # connection; a REGISTER binds the shard's name to it)
        self.backend = self._router(sndtimeo=1000, handover=False)
        self.events = self.ctx.socket(zmq.XPUB)
        net.tune(self.events)
        self.events.sndhwm = EVENTS_SNDHWM
        # every subscription is noticed, not only a topic's first: a client that subscribes to
        # heartbeats (connected, or back after a restart) gets one at once
        self.events.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.frontend.rcvhwm = FRONTEND_RCVHWM
        self.frontend.sndhwm = FRONTEND_SNDHWM
        if curve is not None:
            for s in (self.frontend, self.backend, self.events):
                security.server_setup(s, curve)
            self.handshakes = security.FailureCounter((self.frontend, self.backend, self.events))
        self.port = self._bind(self.frontend, port)
        self.backend_port = self._bind(self.backend, backend_port)
        self.events_port = self._bind(self.events, events_port)

    def _router(self, sndtimeo: int, handover: bool):
        s = self.ctx.socket(zmq.ROUTER)
        net.tune(s)
        s.router_mandatory = 1
        s.setsockopt(zmq.ROUTER_HANDOVER, int(handover))
        s.sndtimeo = sndtimeo
        return s

    def _bind(self, sock, port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port(f"tcp://{self.host}")
        sock.bind(f"tcp://{self.host}:{port}")
        return port

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _do(self, actions) -> None:
        for act in actions:
            try:
                match act:
                    case ReplyClient(identity, frames, torn):
                        out = self.shm_io.inline_reply(frames)
                        self._to_client(identity, torn if out is None else out)
                    case ToClient(identity, frames):
                        self._to_client(identity, frames)
                    case ToShard(identity, frames, inline, relay, torn):
                        if inline:
                            frames = self.shm_io.to_shard(frames, inline, relay)
                        if frames is None:        # a reply's refs were torn: ask again instead
                            if torn is not None:
                                self._do([torn])
                            continue
                        if self.inproc is not None and self.inproc.put(identity, frames):
                            continue
                        if self.links is None or self.links.send(SHARD, identity,
                                                                 frames) is None:
                            self.backend.send_multipart([identity, *frames], copy=False)
                    case Capture(frames, refs, p, seq, owners):
                        # published, then cached and sent to the clients that follow p
                        out = self.shm_io.publish(self.events, frames, refs, keep=True)
                        self._do(self.core.on_published(p, out, owners, self.clock(), seq))
                    case Publish(frames, refs):
                        self.shm_io.publish(self.events, frames, refs)
                    case AppendLog(parts, t_list, frames, at):
                        self.log.append(parts, *self.shm_io.to_log(t_list, frames), at)
                    case SyncLog():
                        self.log.sync()
                    case FreeRelays(relays):
                        self.shm_io.free_relays(relays)
                    case ReadLog(identity, frames, key):
                        self._do(self._with_log(identity, frames, key))
                    case _:
                        raise TypeError(f"unknown action {act!r}")
            except zmq.ZMQError as e:
                # Peer gone (EHOSTUNREACH) or stuck past SNDTIMEO: count it, keep serving.
                self.send_failures += 1
                self.core.errors["send_" + (zmq.strerror(e.errno) or str(e.errno))] += 1
            except WireError as e:
                # a client's shared-memory ref names nothing readable (its ring is gone)
                self.send_failures += 1
                self.core.errors["shm_" + e.code.value] += 1
                log.warning("shared memory: %s", e)

    def _to_client(self, identity: bytes, frames: list) -> None:
        """To a client: over its local link while it has one, else through the frontend."""
        if self.links is None or self.links.send(CLIENT, identity, frames) is None:
            self.frontend.send_multipart([identity, *frames], copy=False)

    def _with_log(self, identity: bytes, frames: list, key: str | None) -> list:
        """A REGISTER the core wants this broker's update log for: read it, hand it over."""
        self.log.sync()
        index = ulog.LogIndex(self.log.dir)
        return self.handlers.on_backend(identity, frames, self.clock(), log_index=index,
                                        key=key)

    def _drain(self, sock, handler, limit: int) -> int:
        n = 0
        while n < limit:
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            if len(msg) < 2:
                continue  # ROUTER always gives identity + at least one frame; ignore otherwise
            if sock is self.backend and (
                    (self.links is not None and self.links.holds(SHARD, msg[0].bytes))
                    or (self.inproc is not None and self.inproc.holds(msg[0].bytes))):
                # a live shard's link (or pipe) identity from a socket: another peer's,
                # never the shard's (it speaks on one only), so it takes no shard's place
                self.core.meters.counters["links_impersonated"] += 1
                continue
            if self.auth is not None:    # the authenticated sender's key and roles
                key = _user_id(msg[1])
                self._handle(handler, msg[0].bytes, msg[1:], self.auth.allow.roles_of(key),
                             key if sock is self.backend else None)
            else:
                self._handle(handler, msg[0].bytes, msg[1:])
        return n

    def _handle(self, handler, identity: bytes, frames: list, roles=None,
                key: str | None = None) -> None:
        if self.gate is not None and not self.gate.admits(handler == self.handlers.on_backend,
                                                          identity, frames):
            return
        try:
            if roles is not None:
                kw = {"key": key} if key is not None else {}
                actions = handler(identity, frames, self.clock(), roles=roles, **kw)
            else:
                actions = handler(identity, frames, self.clock())
        except Exception:  # a bug must not take the broker down: count it, keep serving
            log.exception("handler failed on a message from %r", identity[:32])
            self.core.errors["INTERNAL"] += 1
            return
        self._do(actions)

    # -- a broker pair (protocol section 23: broker/pair_gate.py) ------------------------------
    def _deposed(self, deposed: Deposed | None, why: str) -> None:
        if deposed is None or self.deposed is not None:
            return
        log.warning("broker pair: deposed (%s); starting again as the standby", why)
        self.deposed = deposed
        self.stopping.set()

    def _drain_links(self, fds, role: bytes) -> int:
        """What the links ``fds`` (of peers with ``role``) sent, to the frontend's or the
        backend's handler."""
        links, n = self.links, 0
        for fd in fds:
            ent = links.by_fd.get(fd)
            if ent is None or (ent[1] is not None and ent[1] != role):
                continue       # another role's (a fresh link says which it is first)
            for r, identity, frames in links.read(fd, DRAIN_MAX):
                n += 1
                if frames:
                    self._handle(self.on_frontend if r == CLIENT else self.handlers.on_backend,
                                 identity, frames)
        return n

    # -- shards in this process (broker/inproc.py) ----------------------------------------------
    def add_shard(self, make_shard):
        """Run a shard inside this process: ``make_shard(connect)`` builds it with
        ``connect`` as its connector (:class:`~gradbus.shards.server.ShardServer`'s
        ``connect=``); it registers at the loop's first turn. Call before :meth:`run`."""
        if self.pair is not None or self.curve is not None:
            raise ValueError("a shard inside the broker's process runs without a broker pair "
                             "and without CURVE")
        if self.inproc is None:
            self.inproc = InprocShards(self._welcome, self.core.errors)
        return self.inproc.add(make_shard)

    def _welcome(self) -> dict:
        """The WELCOME this broker gives a shard's HELLO."""
        return welcome_of(self.core.on_frontend(b"P-inproc-hello",
                                                [wire.pack(wire.HELLO, role="shard")],
                                                self.clock()))

    def _pump(self) -> None:
        self.inproc.pump(self._from_inproc)

    def _from_inproc(self, identity: bytes, frames: list) -> None:
        self._handle(self.handlers.on_backend, identity, frames)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.backend, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)   # subscription notices: what topics to send
        poller.register(self.frontend, zmq.POLLIN)  # always: the byte cap holds producers back
        pair_socks = ()
        if self.pair_link is not None:
            pair_socks = (self.pair_link.sub, self.pair_link.mon)
            for s in pair_socks:
                poller.register(s, zmq.POLLIN)
        links = self.links
        if links is not None:
            links.attach(poller)
            listener = links.fileno()
        tick_every = self.core.settings.heartbeat_interval / 2
        next_tick = self.clock()
        first_pending = None
        spin = 0.0       # after a turn with messages: the next ones often follow at once
        try:
            while not self.stopping.is_set():
                now = self.clock()
                timeout = max(0.0, next_tick - now)
                if first_pending is not None:
                    timeout = min(timeout, max(0.0, first_pending + self.batch_window - now))
                if links is not None and links.again:
                    timeout = 0.0
                inproc = self.inproc
                if inproc is not None:
                    inproc.turn(now)      # what it sends is pumped after the reads below
                    if inproc.busy():
                        timeout = 0.0
                events = net.poll_spinning(poller, min(timeout, 0.05), spin)
                spin = self.spin.seconds() if events else 0.0
                if hops.ON:
                    hops.woke()
                if pair_socks and any(s in events for s in pair_socks):
                    self.gate.tick(self.clock(), beat=False)
                if self.events in events:
                    self._drain_subscriptions()
                if links is not None:
                    ready = set(links.again)
                    for fd, ev in events.items():
                        if type(fd) is int and fd != listener:
                            if ev & net.POLLOUT:
                                links.writable(fd)
                            if ev & ~net.POLLOUT:
                                ready.add(fd)
                    self._drain_links(ready, SHARD)
                if self.backend in events:
                    self._drain(self.backend, self.handlers.on_backend, DRAIN_MAX)
                if links is not None:
                    self._drain_links(ready, CLIENT)
                    if listener in events:
                        links.accept()
                if self.frontend in events:
                    self._drain(self.frontend, self.on_frontend, DRAIN_MAX)
                now = self.clock()
                # a pair's broker judges its votes again before batches go out when a
                # REGISTER or BYE may have placed copies or taken them away since the tick
                if self.core.has_flushable() and (self.gate is None
                                                  or self.gate.may_flush(now)):
                    # Work a shard could take now. (Entries waiting on a shard without credit
                    # do not count: the loop sleeps in poll until an APPLIED returns credit.)
                    if first_pending is None:
                        first_pending = now
                    if now - first_pending >= self.batch_window:
                        self._do(self.handlers.flush(now))
                        first_pending = None
                else:
                    first_pending = None
                if inproc is not None:
                    self._pump()
                if now >= next_tick:
                    # read what shards sent meanwhile before judging their liveness (a shard
                    # in this process first sends its heartbeat when one is due: it could
                    # not while the loop was busy)
                    if inproc is not None:
                        inproc.turn(now, force=True)
                        self._pump()
                    got = self._drain(self.backend, self.handlers.on_backend, DRAIN_MAX)
                    if links is not None:
                        got += self._drain_links([fd for fd, ent in links.by_fd.items()
                                                  if ent[1] == SHARD], SHARD)
                    if got:
                        now = self.clock()
                    if self.handshakes is not None:   # refused CURVE handshakes, in errors
                        self.handshakes.drain(self.core.errors)
                    gate = self.gate
                    if gate is not None:
                        gate.tick(now)
                    if gate is None or gate.acts(now):   # a standby serves nobody
                        self._do(self.handlers.on_tick(now))
                        if gate is not None:    # the tick may have placed copies
                            gate.acts(now)
                    elif self.pair.active:      # without the votes: heard by its shards only
                        self._pulse()
                        self._do(gate.without_votes(now))
                    self.shm_io.tick(now)
                    if self.on_metrics is not None:
                        self.on_metrics(self.core.metrics(now))
                    next_tick = now + tick_every
        finally:
            self.close()

    def _pulse(self) -> None:
        """Heartbeats to the shards in the middle of one long request (a large INIT's plan),
        when one is due: a shard judges the broker by them and would otherwise reconnect."""
        core = self.core
        now = self.clock()
        if now - core.last_hb_sent >= core.settings.heartbeat_interval:
            core.last_hb_sent = now
            hb = wire.pack(wire.HEARTBEAT)
            self._do([ToShard(s.identity, [hb]) for s in core.members.live_shards()])

    def _drain_subscriptions(self) -> None:
        hb = table = False
        for _ in range(DRAIN_MAX):
            try:
                notice = self.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.shm_io.subscription(notice)
            hb = hb or notice == _HB_SUBSCRIBED
            table = table or notice == _TABLE_SUBSCRIBED
        out = []
        if hb:       # a new subscriber to heartbeats: it hears this broker's run id now
            out.append(self.core.events_heartbeat())
        if table and (self.pair is None or self.pair.active):
            # a subscriber to the table (a new one, or one asking again because what it holds
            # may be stale): the table now, after any published before (section 6.14)
            out.append(Publish(self.core.table.message()))
        if out:
            self._do(out)

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name="gradbus-broker", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        inproc, self.inproc = self.inproc, None
        try:
            if inproc is not None:      # first: a shard's final checkpoint, its last messages
                inproc.close()
        finally:
            self._close()

    def _close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.handshakes is not None:
            self.handshakes.close()
        for s in (self.frontend, self.backend, self.events):
            if s is not None:
                s.close(linger=0)
        if getattr(self, "pair_link", None) is not None:
            self.pair_link.close()
        if self.links is not None:
            self.links.close()
        if self.shm_io is not None:
            self.shm_io.close()
        if self.auth is not None:
            self.auth.stop()
        if self._own_ctx:
            self.ctx.term()


def _user_id(frame) -> str | None:
    """The ZAP user id libzmq attached to a received message (None without one)."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None
