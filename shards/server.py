"""The shard process: one DEALER to the broker's backend around :class:`ShardCore`.

It finds the backend port with a HELLO on the broker's client URL, registers, heartbeats every
``HEARTBEAT_INTERVAL`` and re-registers (after a fresh HELLO, with back-off) when the broker is
silent for ``LIVENESS`` intervals: the decisions are :class:`~.registration.Registration`'s,
the sockets, clocks, checkpoint thread and fault injection are here.

Until the broker is heard on a backend connection, every send on it honours a deadline (the
hello timeout from the connect): libzmq drops the pipe of a connection whose handshake failed,
and a plain send on it would block for ever. A send that cannot go out by then, or a failed
handshake, is a lost connection (a new one is made, as for a silent broker); a key the broker
refuses is a :class:`~gradbus.codecs.errors.SecurityError`. Every wait (HELLO, those sends,
the loop's poll) gives up within ``net.STOP_STEP`` seconds of :meth:`ShardServer.stop`.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid

import zmq

from gradbus.codecs import cores, hops, link, messages, net, security, timing, wire
from gradbus.codecs import shm as shmem
from gradbus.codecs.errors import Code, WireError

from . import checkpoint
from .core import ShardCore
from .meters import ShardMeters
from .registration import Connect, Fence, Heartbeat, Register, Registration
from .shm_io import PRUNE_EVERY, ShardShm

log = logging.getLogger("gradbus.shard")

DRAIN_MAX = 64
ROUTING_ID_BYTES = 16     # a backend connection's routing id: random, one per connection
TOKEN_BYTES = 16          # this process's registration token


class ShardServer:
    def __init__(self, broker_url: str, shard_id: str | None = None, *, clock=time.monotonic,
                 ctx: zmq.Context | None = None, hello_timeout: float = 30.0,
                 curve: security.Curve | None = None,
                 heartbeat_interval: float = timing.HEARTBEAT_INTERVAL,
                 liveness: int = timing.LIVENESS, apply_delay: float = 0.0,
                 data_dir: str | None = None, checkpoint_interval: float = 0.0,
                 checkpoint_keep: int = 3, restore: str | None = None,
                 on_metrics=None, metrics_url: str | None = None, shm: bool | None = None,
                 shm_reply_bytes: int | None = None, connect=None, spin: float | None = 0.0,
                 **core_kw):
        """``shm``: read pushes from and publish weights into shared memory when the broker is
        on this host (None: ``$GRADBUS_SHM``, else on); ``shm_reply_bytes``: the cap of its
        reply area (None: ``$GRADBUS_SHM_REPLY_MB``, else 256 MiB; 0: replies as frames);
        ``connect``: a shard inside the broker's process (:meth:`start`, :meth:`pump`,
        :meth:`turn`, driven by the broker's loop): called for each connection, it returns
        the broker's end of a fresh :class:`~gradbus.codecs.pipe.Pipe` made known to the
        broker, and the WELCOME a HELLO would have brought; ``spin``: seconds its loop polls
        without sleeping after a turn that had messages (0: it sleeps at once; None: judged
        from the host's cores, :class:`gradbus.codecs.cores.Spin`)."""
        # one broker, or a broker pair's two (protocol section 23): the shard talks to one
        # at a time, and goes to the other when that one is gone or says it is the standby
        self.broker_urls = net.broker_urls(broker_url)
        self.broker_at = 0
        self.broker_url = self.broker_urls[0]
        self._gone = None        # a pair: the backend connection's monitor (its closing)
        self.shard_id = shard_id or f"shard-{uuid.uuid4().hex[:8]}"
        core_kw.setdefault("threads", None)      # from the host's cores
        self.core = ShardCore(self.shard_id, **core_kw)
        self.clock = clock
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.hello_timeout = hello_timeout
        self.curve = curve   # CURVE keys (this shard's pair, the broker's public key) or None
        self.hb_interval = heartbeat_interval
        self.liveness = liveness
        self.apply_delay = apply_delay   # fault injection: a slow shard (seconds per message)
        self.spin = cores.Spin.from_seconds(spin, cores.SHARD_SPIN_US)
        self.stopping = threading.Event()
        self.registered = threading.Event()
        self.sock = None
        self.shm = ShardShm(shmem.wanted(shm), shm_reply_bytes,
                            pins=getattr(self.core.backend, "pins", None))
        # until the broker is heard on self.sock: its handshake failures, and the time
        # (time.monotonic) by which a send on it must have gone out
        self._watch: security.HandshakeWatch | None = None
        self._send_by = 0.0
        self.reg = Registration(heartbeat_interval, liveness)
        # this process's secret, in every REGISTER: a REGISTER on a new connection that
        # carries it is this process reconnecting, not another taking its name (6.10)
        self.token = os.urandom(TOKEN_BYTES)
        if checkpoint_interval < 0 or checkpoint_keep < 1:
            raise ValueError("checkpoint_interval must be >= 0 and checkpoint_keep >= 1")
        self.on_metrics = on_metrics      # called with a metrics snapshot every interval
        self.metrics_url = metrics_url    # announced in heartbeats (status lists it)
        self.data_dir = data_dir
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_keep = checkpoint_keep
        self._ckpt_thread: threading.Thread | None = None
        self._ckpt_done: collections.deque = collections.deque()   # replies from the writer
        self._ckpt_waiting: list = []            # CHECKPOINT requests for the running write
        self.last_checkpoint: checkpoint.Checkpoint | None = None
        self.meters = ShardMeters(checkpoint_interval, data_dir)
        self.connector = connect
        self._last_ckpt = self._next_prune = 0.0
        if restore:
            self.restore(restore)

    def restore(self, path: str) -> None:
        """Load a checkpoint directory (before registering: the broker learns the partitions,
        tensors and versions from REGISTER). A damaged one raises
        :class:`~.checkpoint.DamagedCheckpoint` naming the file and what is wrong."""
        ck = checkpoint.read_manifest(path)
        for h, descs, frames in checkpoint.load(ck, self.core.max_tensor_bytes):
            self.core.install_state(h, descs, frames)
        log.info("%s restored %d partitions from %s", self.shard_id, len(ck.partitions), path)

    # -- checkpoints: the state is copied in the loop (consistent at each partition's seq),
    # written and fsynced by a thread, answered from the loop ----------------------------------
    def _start_checkpoint(self, request) -> None:
        if request is not None:
            if not self.data_dir:
                self._reply_checkpoint(request, None, "this shard has no data directory "
                                                      "(--data-dir)")
                return
            self._ckpt_waiting.append(request)
        if self._ckpt_thread is not None or not self.data_dir:
            return      # one write at a time; a request is answered by the next one
        states = self.core.states()
        waiting, self._ckpt_waiting = self._ckpt_waiting, []

        def write():
            try:
                ck = checkpoint.write(self.data_dir, self.shard_id, states, self.checkpoint_keep)
                self._ckpt_done.append((ck, None, waiting))
            except OSError as e:
                log.error("%s: checkpoint failed: %s", self.shard_id, e)
                self._ckpt_done.append((None, f"checkpoint failed: {e}", waiting))
        self._ckpt_thread = threading.Thread(target=write, name=f"gradbus-ckpt-{self.shard_id}",
                                             daemon=True)
        self._ckpt_thread.start()

    def _checkpoint_replies(self) -> None:
        while self._ckpt_done:
            ck, err, waiting = self._ckpt_done.popleft()
            self._ckpt_thread.join()
            self._ckpt_thread = None
            if ck is not None:
                self.last_checkpoint = ck
                self.meters.checkpoint_written(ck.time)
                self.core.stats["checkpoints"] = self.core.stats.get("checkpoints", 0) + 1
            else:
                self.meters.checkpoint_failed()
            for req in waiting:
                self._reply_checkpoint(req, ck, err)
        if self._ckpt_waiting:
            self._start_checkpoint(None)   # asked while the last one was being written

    def _reply_checkpoint(self, req, ck, err: str | None) -> None:
        fields = {k: v for k in ("client", "of") if (v := getattr(req, k)) is not None}
        if ck is not None:
            fields.update(path=ck.path, time=ck.time, partitions=len(ck.partitions))
        else:
            fields["error"] = err
        self.sock.send(wire.pack(wire.CHECKPOINT_REPLY, req=req.req, shard=self.shard_id,
                                 **fields))

    # -- the loop: sockets and clocks around the core and the registration state machine ------
    def _connect(self, next_broker: bool = False) -> bool:
        """HELLO the broker (retried with back-off; of a pair, the other first when
        ``next_broker``) and connect a fresh backend socket; False when the shard was stopped
        first."""
        self._close_sock()
        if self.connector is not None:      # inside the broker's process: a fresh pipe
            sock, welcome = self.connector()
            self.shm.welcome(welcome)
            self.sock = sock
            self.broker_url = "this process"
            return True
        urls = self.broker_urls
        first = self.broker_at + 1 if next_broker else self.broker_at
        log.info("%s: asking the broker at %s for its ports", self.shard_id,
                 urls[first % len(urls)])
        try:
            self.broker_at, welcome = net.hello_any(self.ctx, urls, first, "shard",
                                                    self.hello_timeout, curve=self.curve,
                                                    stop=self.stopping)
        except net.Stopped:
            return False
        self.broker_url = urls[self.broker_at]
        host, _ = net.split_url(self.broker_url)
        self.shm.welcome(welcome)
        # a fresh, unguessable routing id per connection (never starting with a zero byte,
        # which libzmq reserves): the broker binds this shard's name to it only by REGISTER
        rid = b"S" + os.urandom(ROUTING_ID_BYTES - 1)
        if self.shm.cluster is not None and self.curve is None:
            lnk = link.connect((welcome.get("shm") or {}).get("link"), link.SHARD, rid)
            if lnk is not None:      # on the broker's host: a local link, not the backend
                self.sock = link.LinkSocket(lnk)
                log.info("%s: connected to the broker over a local link", self.shard_id)
                return True
        backend = net.url(host, welcome["backend"])
        self.sock = self.ctx.socket(zmq.DEALER)
        net.tune(self.sock)
        if self.curve is not None:
            security.client_setup(self.sock, self.curve)
        self.sock.setsockopt(zmq.ROUTING_ID, rid)
        self._watch = security.HandshakeWatch(self.sock, self.curve, backend)
        self.sock.connect(backend)
        self._send_by = time.monotonic() + self.hello_timeout
        return True

    def _close_sock(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        net.stop_watching(self.sock, self._gone)
        self._gone = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _heard(self) -> None:
        """The broker was heard on this connection: its pipe is up, sends need no deadline.
        Of a pair, the connection's closing is watched from now on (a socket has one
        monitor: the handshake's until now): a broker whose process went away is left at
        once."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
            if len(self.broker_urls) > 1 and self.sock is not None and self._gone is None:
                self._gone = net.watch_closing(self.sock)

    def _send(self, msg) -> bool:
        """Send a registration message; False when it could not go out on this connection
        (see the module's docstring), or the shard is stopping."""
        if self._watch is None:
            self.sock.send(msg)
            return not getattr(self.sock, "lost", False)
        while not self.stopping.is_set():
            failures = self._watch.failures
            step = min(self._send_by, time.monotonic() + net.STOP_STEP)
            if net.send_before(self.sock, msg, step, self._watch):
                return True
            if self._watch.failures > failures or time.monotonic() >= self._send_by:
                return False
        return False

    def _broker_gone(self) -> bool:
        """Of a pair: the backend connection closed (the broker's process went away)."""
        if self._gone is None or not self._gone.poll(0):
            return False
        self._gone.recv_multipart()
        return True

    def _handshake_failed(self) -> bool:
        """Whether this connection's handshake failed (before the broker was heard on it);
        a refused key raises SecurityError."""
        if self._watch is None:
            return False
        failures = self._watch.failures
        self._watch.check()
        return self._watch.failures > failures

    def _act(self, actions: list) -> None:
        """Carry out the registration's actions, in order (those an action's event returns
        first); a send that could not go out makes a new connection instead of the rest."""
        todo = collections.deque(actions)
        while todo:
            sent = True
            match todo.popleft():
                case Connect(silent_for=silent, lost=lost, next=next_broker, why=why):
                    if why:
                        log.warning("%s: leaving the broker at %s: %s", self.shard_id,
                                    self.broker_url, why)
                    elif lost:
                        log.warning("%s: the connection to the broker failed before it answered"
                                    ", reconnecting", self.shard_id)
                    elif silent is not None:
                        log.warning("%s: broker silent for %.2fs, reconnecting", self.shard_id,
                                    silent)
                    self.registered.clear()
                    if not self._connect(next_broker or (silent is not None
                                                         and len(self.broker_urls) > 1)):
                        break       # stopping
                    todo.extendleft(reversed(self.reg.connected(self.clock())))
                case Fence(epoch=epoch):
                    self._send(wire.error(Code.FENCED, f"this shard has seen broker epoch "
                                                       f"{epoch}", bepoch=epoch))
                case Register(rejoin=rejoin):
                    bepoch = {"bepoch": self.reg.bepoch} if self.reg.bepoch else {}
                    sent = self._send(wire.pack(wire.REGISTER, shard=self.shard_id,
                                                rejoin=rejoin, token=self.token, **bepoch,
                                                **self.core.register_fields(),
                                                **self.shm.register_fields()))
                case Heartbeat():
                    # counters every interval, busy or not (status and top read them)
                    info = self.core.info()
                    if self.metrics_url:
                        info["metrics_url"] = self.metrics_url
                    sent = self._send(wire.pack(wire.HEARTBEAT, info=info))
                    if self.on_metrics is not None:
                        self.on_metrics(self.metrics())
            if not sent:
                if self.stopping.is_set():
                    break
                todo.clear()
                todo.extend(self.reg.lost(self.clock()))
        if self.reg.registered != self.registered.is_set():
            if self.reg.registered:
                self.registered.set()
                log.info("%s registered with %s", self.shard_id, self.broker_url)
            else:
                self.registered.clear()

    def run(self) -> None:
        wait = min(self.hb_interval, 0.05)
        spin = 0.0       # after a turn with messages: the next ones often follow at once
        try:
            self.start()
            log.info("%s: %d pass thread(s), loop %s", self.shard_id,
                     self.core.applier.passes.threads, self.spin.describe())
            while not self.stopping.is_set():
                if self._connection_lost():
                    continue
                if cores.spin_then_block(self._poll, wait, spin):
                    if hops.ON:
                        hops.woke()
                    self._drain()
                    spin = self.spin.seconds()
                else:
                    spin = 0.0
                self.turn()
        finally:
            self.close()

    def _poll(self, ms: float) -> int:
        """The broker's connection polled for a message for up to ``ms`` milliseconds."""
        return self.sock.poll(int(ms), zmq.POLLIN)

    def start(self) -> None:
        """Connect and register (the first of the loop's work)."""
        self._act(self.reg.start())
        self._last_ckpt = self._next_prune = self.clock()

    def _connection_lost(self) -> bool:
        if self._handshake_failed() or getattr(self.sock, "lost", False) \
                or self._broker_gone():
            self._act(self.reg.lost(self.clock()))
            return True
        return False

    def pump(self) -> None:
        """Inside the broker's process: take every message the broker handed over (the
        loop's reads, without its wait)."""
        if self.stopping.is_set() or self._connection_lost():
            return
        while self.sock.poll(0) and not self.stopping.is_set():
            self._drain()
            if getattr(self.sock, "lost", False):
                break

    def turn(self) -> None:
        """The loop's work between reads: checkpoints, the shared-memory prune, heartbeats
        and the broker's liveness (inside the broker's process, the broker's loop running
        this turn is the broker heard)."""
        now = self.clock()
        if self.connector is not None and not getattr(self.sock, "lost", True):
            self.reg.heard(now, wire.HEARTBEAT)
        if self._ckpt_done:
            self._checkpoint_replies()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY
            self.shm.prune()
        if (self.checkpoint_interval and self.data_dir and self._ckpt_thread is None
                and now - self._last_ckpt >= self.checkpoint_interval):
            self._last_ckpt = now
            self._start_checkpoint(None)
        self._act(self.reg.tick(now))

    def _drain(self) -> None:
        """Up to DRAIN_MAX waiting messages: the registration's to the state machine, the
        core's to the core (its replies sent), checkpoint and stop requests here."""
        take = getattr(self.sock, "take", None) or self._recv
        for _ in range(DRAIN_MAX):
            frames = take()
            if frames is None:
                break
            self._heard()
            head = _peek(frames[0]) if frames else None
            kind = head.kind if head is not None else None
            code = head.code if kind == wire.ERROR else None
            sock = self.sock
            self._act(self.reg.heard(self.clock(), kind, code,
                                     head.bepoch if kind == wire.REGISTERED else 0))
            if self.sock is not sock:
                break            # left for the other broker of a pair
            if kind == wire.REGISTERED:
                self.shm.registered(head, self.core.publisher)
            if not frames or kind in (wire.REGISTERED, wire.HEARTBEAT):
                continue
            if kind == wire.ERROR:
                if code != Code.NOT_REGISTERED.value:
                    log.warning("broker error: %s", head.message)
                continue
            if kind == wire.CHECKPOINT:
                self._start_checkpoint(head)
                continue
            if kind == wire.STOP:     # drained: nothing left here
                log.info("%s drained; stopping", self.shard_id)
                self.stopping.set()
                break
            if self.apply_delay:
                time.sleep(self.apply_delay)
            t = getattr(head, "t", None)
            if t and not self.shm.resolve(t, frames) and kind == wire.STATE:
                # rewritten in the primary's reply area before it was read whole: nothing is
                # installed, the broker asks the primary again (with frames)
                self.core.stats["shm_states_torn"] = self.core.stats.get("shm_states_torn", 0) + 1
                self.sock.send(wire.error(Code.SHM_TORN, f"the state of partition {head.p} was "
                                          "rewritten before it was read", p=head.p))
                continue
            try:
                outs = self.core.handle(frames, head)
            except Exception:   # a bug must not take the shard down
                log.exception("%s failed handling a %s", self.shard_id, kind)
                self.core.stats["errors"] += 1
                continue
            for out in outs:
                self.sock.send_multipart(out, copy=False)
                self.reg.sent(self.clock())
            if self.reg.quiet(self.clock()):
                break   # a slow shard still heartbeats between messages

    def _recv(self) -> list | None:
        """The DEALER's next message, or None when none waits."""
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def metrics(self) -> dict:
        """A snapshot for the Prometheus exporter: the core's, the checkpoints' and shared
        memory's."""
        return {**self.core.metrics(), **self.meters.snapshot(self.shm)}

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name=f"gradbus-{self.shard_id}", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self._ckpt_thread is not None:
            self._ckpt_thread.join()    # a checkpoint being written is finished, not torn
        final_failed = False
        if self.data_dir and self.stopping.is_set():
            try:    # a clean stop leaves a checkpoint of the final state
                self.last_checkpoint = checkpoint.write(self.data_dir, self.shard_id,
                                                        self.core.states(), self.checkpoint_keep)
            except OSError as e:
                final_failed = True
                log.error("%s: final checkpoint failed, the state since the last checkpoint "
                          "is not on disk: %s", self.shard_id, e)
        if self.sock is not None:
            try:
                self.sock.send(wire.pack(wire.BYE), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._close_sock()
        self.core.publisher.board = None   # values stepped onto the board settle first
        self.core.close()
        self.shm.close()
        if hasattr(self.core.backend, "close"):      # a GPU backend's pinned memory
            self.core.backend.close()
        if self._own_ctx:
            self.ctx.term()
        if final_failed:    # not a clean stop: the process exits non-zero
            raise SystemExit(1)


def _peek(frame):
    """A message from the broker, typed (:mod:`gradbus.codecs.messages`), or None if it does
    not pass validation (the core will report it)."""
    try:
        return messages.unpack(frame, wire.SHARD_KINDS)
    except WireError:
        return None
