"""The client SDK: :class:`Client` (the user's side) and :class:`Agent` (the I/O thread).

The agent thread owns every socket: a DEALER to the broker's frontend and a SUB to its events.
The user's threads hand it work through a queue and an empty wake-up frame on an inproc PAIR (the
zguide's Clone-client shape); results come back as ``concurrent.futures.Future`` objects, and
fresh weights land in a :class:`~gradbus.workers.cache.WeightCache` that ``pull()`` reads
without a round trip.

Flow control: at most ``window`` pushes are unacknowledged at once; ``push()`` blocks for a free
slot (``timeout`` seconds, then :class:`BackPressureError`). The broker acknowledges every push
once the shard applied it; ``acks=0`` only resolves the Future at send time.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future

import numpy as np
import zmq

from gradbus.codecs import device, net, security, specs, timing, wire
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.errors import (BackPressureError, BrokerUnavailableError, ClosedError, Code,
                                   GradbusError, ShardUnavailableError, WireError, error_from)
from gradbus.codecs.partition import (DEFAULT_BLOCK_BYTES, TensorLayout, block_elems_for,
                                      row_key)

from . import tables as rows_mod
from .cache import WeightCache

log = logging.getLogger("gradbus.client")

DEFAULT_WINDOW = 32          # unacknowledged pushes per client ...
DEFAULT_WINDOW_BYTES = 128 << 20   # ... and their bytes (one push may exceed it, alone)
DEFAULT_TIMEOUT = 30.0       # seconds for init/pull/flush round trips
EVENTS_RCVHWM = 64
SNAPSHOT_RETRY = 1.0         # seconds before a failed re-snapshot is tried again, doubling ...
SNAPSHOT_RETRY_MAX = 30.0    # ... up to this
RESEND_AFTER = 5.0           # seconds before an unacknowledged push or init is sent again,
RESEND_MAX = 60.0            # ... doubling per try up to this (the broker applies it once)
RECOVERING_RETRY = 0.2       # seconds before a push or init refused with RECOVERING is resent


class Agent(threading.Thread):
    """The I/O thread. Only this thread touches the DEALER and SUB sockets."""

    def __init__(self, client: "Client"):
        super().__init__(name=f"gradbus-agent-{client.client_id.hex()[:8]}", daemon=True)
        self.c = client
        self.ctx = client.ctx
        self.cmds: collections.deque = collections.deque()
        self.wake_pending = False
        self.pipe_in = self.ctx.socket(zmq.PAIR)   # agent side
        self.pipe_in.linger = 0
        addr = f"inproc://gradbus-{client.client_id.hex()}"
        self.pipe_in.bind(addr)
        self.pipe_out = self.ctx.socket(zmq.PAIR)  # user side, used under client._lock
        self.pipe_out.linger = 0
        self.pipe_out.connect(addr)
        self.dealer = self.sub = None
        self.futures: dict[tuple[str, int], Future] = {}
        self.snap_parts: dict[int, list] = {}      # req -> [replies...]
        self.row_parts: dict[int, dict] = {}       # req -> rows, versions, missing so far
        self.snap_need: dict[int, int] = {}
        self.internal: dict[int, list[str]] = {}   # req -> keys of a re-snapshot with no waiter
        self.retries: list = []                      # (when, keys) re-snapshots to try again
        self.retry_count: dict[str, int] = {}         # first key -> failed attempts in a row
        # msg -> [frames, when to resend, tries]: pushes and inits sent and not yet settled.
        # The broker's (client, msg) window makes a resend apply once (idempotent producer).
        self.unacked: collections.OrderedDict = collections.OrderedDict()
        self.last_heard = time.monotonic()
        self.stop_flag = False
        self.error: BaseException | None = None

    # called from user threads (under client._lock)
    def submit(self, cmd) -> None:
        self.cmds.append(cmd)
        # Wake the agent only if it has not been woken since it last emptied the queue: it
        # clears the flag *before* draining, so a command appended while the flag is set is
        # always drained (saves a socket send per push under load).
        if not self.wake_pending:
            self.wake_pending = True
            self.pipe_out.send(b"", zmq.NOBLOCK)

    def open(self, welcome: dict, host: str) -> None:
        c = self.c
        self.dealer = self.ctx.socket(zmq.DEALER)
        net.tune(self.dealer)
        self.dealer.setsockopt(zmq.ROUTING_ID, c.client_id)
        self.watch = None
        if c.curve is not None:
            security.client_setup(self.dealer, c.curve)
            # a key refused later (revoked, then a reconnect) stops the client with that error
            self.watch = security.HandshakeWatch(self.dealer, c.curve, c.url, limit=None)
        if c.curve_configure:
            c.curve_configure(self.dealer)
        self.dealer.connect(c.url)
        self.sub = self.ctx.socket(zmq.SUB)
        net.tune(self.sub)
        self.sub.rcvhwm = EVENTS_RCVHWM
        if c.curve is not None:
            security.client_setup(self.sub, c.curve)
        if c.curve_configure:
            c.curve_configure(self.sub)
        self.sub.connect(net.url(host, welcome["events"]))
        self.sub.subscribe(wire.TOPIC_TABLE)
        self.sub.subscribe(wire.TOPIC_HEARTBEAT)
        self.dealer.send(wire.pack(wire.HEARTBEAT))  # registers this worker with the broker

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.pipe_in, self.dealer, self.sub):
            poller.register(s, zmq.POLLIN)
        if self.watch is not None:
            poller.register(self.watch.mon, zmq.POLLIN)
        hb = wire.pack(wire.HEARTBEAT)
        last_hb = time.monotonic()
        try:
            while not self.stop_flag:
                ready = dict(poller.poll(int(timing.HEARTBEAT_INTERVAL * 1000 / 2)))
                if self.watch is not None and self.watch.mon in ready:
                    self.watch.check()
                if self.pipe_in in ready:
                    while True:
                        try:
                            self.pipe_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self.wake_pending = False
                while self.cmds:
                    self._command(self.cmds.popleft())
                now = time.monotonic()
                if self.dealer in ready:
                    self.last_heard = now
                    self._drain(self.dealer, self._on_reply)
                if self.sub in ready:
                    self.last_heard = now
                    self._drain(self.sub, self._on_event)
                silent = now - self.last_heard > timing.HEARTBEAT_INTERVAL * timing.LIVENESS
                if silent != self.c._broker_silent:
                    with self.c._cond:
                        self.c._broker_silent = silent
                        self.c._cond.notify_all()
                if self.retries and self.retries[0][0] <= now:
                    _, keys = self.retries.pop(0)
                    self._snapshot(keys, None)
                if self.unacked and self.c.resend_after:
                    self._resend(now)
                if now - last_hb >= timing.HEARTBEAT_INTERVAL:
                    self.dealer.send(hb)
                    last_hb = now
        except security.SecurityError as e:
            self.error = e
            log.error("client stopped: %s", e)
        except BaseException as e:  # surface the failure to every waiter
            self.error = e
            log.exception("client agent failed")
        finally:
            err = self.error or ClosedError("client closed")
            with self.c._lock:   # commands queued before the error was visible fail with it
                for cmd in self.cmds:
                    fut = cmd[-1] if cmd[0] in ("send", "track") else None
                    if fut is not None and not fut.done():
                        fut.set_exception(err)
                self.cmds.clear()
            for f in self.futures.values():
                if not f.done():
                    f.set_exception(err)
            self.futures.clear()
            with self.c._cond:
                self.c._cond.notify_all()
            try:
                self.dealer.send(wire.pack(wire.BYE), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if self.watch is not None:
                self.watch.close()
            for s in (self.dealer, self.sub, self.pipe_in):
                s.close(linger=0)

    def _drain(self, sock, handler) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handler(frames)
            except WireError as e:
                self.c.stats["bad_messages"] += 1
                log.warning("bad message from broker: %s", e)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
                self.c.stats["bad_messages"] += 1   # malformed beyond the schema: never fatal
                log.warning("malformed message from broker: %r", e)

    # -- commands from the user thread ------------------------------------------------
    def _command(self, cmd) -> None:
        op = cmd[0]
        if op == "send":              # ("send", (kind, id), frames, future|None)
            _, fid, frames, fut = cmd
            if fut is not None:
                self.futures[fid] = fut
            if fid[0] == "msg" and self.c.resend_after:
                self.unacked[fid[1]] = [frames, time.monotonic() + self.c.resend_after, 0]
            self.dealer.send_multipart(frames, copy=False)
        elif op == "track":            # ("track", [layouts], future)
            _, layouts, fut = cmd
            keys = []
            for layout in layouts:
                new_parts, ks = self.c.cache.track(layout)
                for p in new_parts:
                    self.sub.subscribe(wire.topic_partition(p))
                keys += ks
            if not keys:
                fut.set_result(None)
                return
            self._snapshot(keys, fut)
        elif op == "rows":             # ("rows", req, frames, future)
            _, req, frames, fut = cmd
            self.futures[("req", req)] = fut
            self.row_parts[req] = {"rows": [], "tv": [], "missing": []}
            self.dealer.send_multipart(frames, copy=False)
        elif op == "stop":
            self.stop_flag = True

    def _resend(self, now: float) -> None:
        """Send again what has waited past its resend time (oldest first; the order of
        ``unacked`` is the order of resend times, as each resend moves to the end)."""
        while self.unacked:
            msg, ent = next(iter(self.unacked.items()))
            if ent[1] > now:
                return
            ent[2] += 1
            ent[1] = now + min(self.c.resend_after * 2 ** ent[2], RESEND_MAX)
            self.unacked.move_to_end(msg)
            self.c.stats["resends"] += 1
            self.dealer.send_multipart(ent[0], copy=False)

    def _snapshot(self, keys: list[str], fut: Future | None) -> None:
        req = next(self.c._ids)
        if fut is not None:
            self.futures[("req", req)] = fut
        else:
            self.internal[req] = keys
        self.snap_parts[req] = []
        self.dealer.send(wire.pack(wire.SNAPSHOT, req=req, keys=keys))

    # -- replies on the DEALER --------------------------------------------------------
    def _on_reply(self, frames) -> None:
        h = wire.unpack_header(frames[0], wire.CLIENT_KINDS)
        kind = h["kind"]
        if kind in (wire.ACK, wire.INIT_OK) or (kind == wire.ERROR and "msg" in h):
            self._settle(h)
        elif kind == wire.SNAPSHOT_REPLY:
            self._on_snapshot(h, frames[1:])
        elif kind == wire.ROWS_REPLY:
            self._on_rows(h, frames[1:])
        elif kind in (wire.CATALOG_REPLY, wire.STATUS_REPLY) or (kind == wire.ERROR and "req" in h):
            req = h.get("req")
            self.snap_parts.pop(req, None)
            self.row_parts.pop(req, None)
            keys = self.internal.pop(req, None)
            if keys is not None and kind == wire.ERROR:
                # a re-snapshot failed (e.g. the shard is down): try again later
                n = self.retry_count.get(keys[0], 0) + 1 if keys else 1
                if keys:
                    self.retry_count[keys[0]] = n
                delay = min(SNAPSHOT_RETRY * 2 ** (n - 1), SNAPSHOT_RETRY_MAX)
                self.retries.append((time.monotonic() + delay, keys))
                self.retries.sort(key=lambda r: r[0])
            fut = self.futures.pop(("req", req), None)
            if fut is not None and not fut.done():
                if kind == wire.ERROR:
                    fut.set_exception(error_from(h["code"], h["message"]))
                else:
                    fut.set_result(h)
        elif kind == wire.ERROR:
            self.c.stats["errors"] += 1
            log.warning("broker error: %s %s", h["code"], h["message"])

    def _settle(self, h: dict) -> None:
        """Settle what an ACK (one push, or ``msgs``: several), INIT_OK or ERROR answers. The
        credit of every push it settles returns at once, after their Futures are resolved."""
        msgs = h.get("msgs") if h["kind"] == wire.ACK else None
        if isinstance(msgs, list) and msgs and all(isinstance(m, int) for m in msgs):
            settled = [m for m in msgs if self._settle_one({**h, "msg": m})]
        else:
            settled = [h["msg"]] if self._settle_one(h) else []
        if settled:
            c = self.c
            with c._cond:
                # the credit returns last: flush() never ends before the Future (or the error a
                # later push() raises) is settled
                for m in settled:
                    c._credit_held.pop(m, None)
                c._cond.notify_all()

    def _settle_one(self, h: dict) -> bool:
        """Resolve the Future of push ``h["msg"]``; False when it is to be sent again instead."""
        msg = h["msg"]
        c = self.c
        if h["kind"] == wire.ERROR and h["code"] == Code.RECOVERING.value and msg in self.unacked:
            # a restarted broker still hearing from its shards: send it again shortly
            self.unacked[msg][1] = time.monotonic() + RECOVERING_RETRY
            c.stats["recovering_retries"] += 1
            return False
        self.unacked.pop(msg, None)
        fut = self.futures.pop(("msg", msg), None)
        if h["kind"] == wire.ERROR:
            c.stats["push_errors"] += 1
            err = error_from(h["code"], h["message"])
            if fut is None:
                c._async_errors.append(err)
            elif not fut.done():
                fut.set_exception(err)
        else:
            if h["kind"] == wire.ACK:
                c.stats["pushes_acked"] += 1
            if fut is not None and not fut.done():
                fut.set_result(h)
        return True

    def _blocks(self, h: dict, frames, keep=None) -> list:
        """Validated, checksummed and decoded ``(key, array, version, base)`` of a message's
        tensors (only keys in ``keep``, when given)."""
        descs = wire.parse_tensors(h, frames, self.c.max_tensor_bytes)
        return [(d.key, wire.decode_tensor(d, f, self.c.max_tensor_bytes), d.version or 0, d.base)
                for d, f in zip(descs, frames) if keep is None or d.key in keep]

    def _on_snapshot(self, h: dict, frames) -> None:
        req = h["req"]
        got = self.snap_parts.get(req)
        if got is None:
            return   # a late reply to a request already answered or failed: nothing to decode
        blocks = self._blocks(h, frames)
        parts = {int(p): int(s) for p, s in h["parts"]}
        got.append((parts, blocks, h.get("missing") or []))
        if len(got) < int(h.get("of", 1)):
            return
        del self.snap_parts[req]
        keys = self.internal.pop(req, None)
        if keys:
            self.retry_count.pop(keys[0], None)
        missing = [m for _, _, ms in got for m in ms]
        with self.c._cond:
            again = set()
            for parts, blocks, _ in got:
                again.update(self.c.cache.on_snapshot(parts, blocks))
            self.c._cond.notify_all()
        for p in again:
            self._snapshot(self.c.cache.resync_keys(p), None)
        fut = self.futures.pop(("req", req), None)
        if fut is not None and not fut.done():
            if missing:
                fut.set_exception(error_from(Code.UNKNOWN_KEY.value,
                                             f"not held by any shard: {missing[:5]}"))
            else:
                fut.set_result(None)

    def _on_rows(self, h: dict, frames) -> None:
        """One shard's part of a table read; the Future resolves once every part is in."""
        req = h["req"]
        got = self.row_parts.get(req)
        if got is None:
            return
        descs = wire.parse_tensors(h, frames, self.c.max_tensor_bytes)
        got["rows"].extend((d, wire.decode_tensor(d, f, self.c.max_tensor_bytes))
                           for d, f in zip(descs, frames))
        got["tv"].append(h["tv"] if isinstance(h.get("tv"), int) else -1)   # one per reply
        if isinstance(h.get("missing"), list):
            got["missing"] += h["missing"]
        if len(got["tv"]) < int(h.get("of", 1)):
            return
        del self.row_parts[req]
        fut = self.futures.pop(("req", req), None)
        if fut is not None and not fut.done():
            if got["missing"]:
                fut.set_exception(error_from(Code.UNKNOWN_KEY.value, f"partitions "
                                             f"{got['missing'][:8]} of the table are not held"))
            else:     # the rows, and the table's version when the broker sent the read
                fut.set_result((got["rows"], min(got["tv"])))

    # -- events on the SUB ------------------------------------------------------------
    def _on_event(self, frames) -> None:
        topic = frames[0].bytes
        if topic == wire.TOPIC_TABLE:
            h = wire.unpack_header(frames[1], frozenset({wire.TABLE}))
            with self.c._cond:
                self.c.cache.down = set(h.get("down", []))
                self.c._cond.notify_all()
            return
        if topic == wire.TOPIC_HEARTBEAT:
            h = wire.unpack_header(frames[1], frozenset({wire.HEARTBEAT}))
            tv = h.get("tv")
            if isinstance(tv, dict):
                with self.c._cond:
                    self.c._server_versions.update(
                        {k: v for k, v in tv.items() if isinstance(k, str) and isinstance(v, int)})
                    self.c._cond.notify_all()
            ps, seqs = h.get("ps") or [], h.get("seqs") or []
            if isinstance(ps, list) and isinstance(seqs, list) and len(ps) == len(seqs):
                with self.c._cond:
                    behind = self.c.cache.on_heartbeat(ps, seqs)
                for p in behind:
                    self._snapshot(self.c.cache.resync_keys(p), None)
            return
        if not topic.startswith(b"p"):
            return
        h = wire.unpack_header(frames[1], frozenset({wire.UPDATE}))
        part = self.c.cache.parts.get(h["p"])
        if part is None:
            return
        blocks = self._blocks(h, frames[2:], part.keys)
        with self.c._cond:
            gap = self.c.cache.on_update(h["p"], h["seq"], blocks)
            self.c._cond.notify_all()
        self.c.stats["updates_received"] += 1
        self.c.stats["recv_bytes"] += sum(len(f) for f in frames[2:])
        if gap:
            self._snapshot(self.c.cache.resync_keys(h["p"]), None)


class Client:
    """A connection to a gradbus cluster. Thread-safe; use as a context manager.

    >>> with gradbus.connect("tcp://127.0.0.1:5555") as c:   # doctest: +SKIP
    ...     c.init({"w": np.zeros(10, np.float32)}, optimizer=gradbus.SGD(lr=0.1))
    ...     c.push({"w": np.ones(10, np.float32)}).result()
    ...     w = c.pull(min_version=1)["w"]

    ``curve``: a :class:`gradbus.Curve` (this client's key pair and the broker's public key)
    for a broker with CURVE on; None reads them from ``$GRADBUS_SECURITY_CURVE_SECRET`` and
    ``$GRADBUS_SECURITY_CURVE_SERVER_KEY`` when set; False: CURVE off. A broker that refuses
    the key raises :class:`gradbus.SecurityError` at once. ``curve_configure(sock)`` is called
    on every socket after that setup.

    ``error_feedback``: True keeps what a chain leaves out and adds it to the next push, for
    every lossy chain but plain ``bf16`` (with or without zstd), whose round-to-nearest error is
    at most 2**-9 of each value; ``"all"`` for bf16 too; False for none.
    """

    def __init__(self, url: str | None = None, *, client_id: bytes | str | None = None,
                 window: int = DEFAULT_WINDOW, timeout: float = DEFAULT_TIMEOUT,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, codec: str = "raw",
                 max_tensor_bytes: int = wire.MAX_TENSOR_BYTES, curve_configure=None,
                 error_feedback: bool | str = True, seed: int | None = None,
                 window_bytes: int = DEFAULT_WINDOW_BYTES,
                 resend_after: float | None = RESEND_AFTER,
                 curve: security.Curve | bool | None = None):
        self.url = url or net.default_broker()
        host, _ = net.split_url(self.url)
        if window < 1 or window_bytes < 1:
            raise ValueError("window and window_bytes must be >= 1")
        tcodec.parse_chain(codec)
        if error_feedback not in (True, False, "all"):
            raise ValueError(f"error_feedback must be True, False or 'all', not {error_feedback!r}")
        if isinstance(client_id, str):
            client_id = client_id.encode()
        self.client_id = client_id or uuid.uuid4().bytes
        if resend_after is not None and resend_after <= 0:
            raise ValueError("resend_after must be positive (or None: never resend)")
        self.window = window
        self.resend_after = resend_after
        self.timeout = timeout
        self.block_bytes = block_bytes
        self.codec = codec
        self.max_tensor_bytes = max_tensor_bytes
        self.curve_configure = curve_configure
        # CURVE keys: given, else from $GRADBUS_SECURITY_CURVE_SECRET and _SERVER_KEY; False: off
        self.curve = security.Curve.from_env() if curve is None else (curve or None)
        if self.curve is not None and not isinstance(self.curve, security.Curve):
            raise TypeError("curve must be a gradbus.Curve, False or None")
        self.stats = collections.Counter()
        # Message ids start from the wall clock in microseconds, so a worker restarted with the
        # same client_id never reuses an id the broker's duplicate window still remembers.
        self._ids = itertools.count(time.time_ns() // 1000)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self.window_bytes = window_bytes
        self._credit_held: dict[int, int] = {}   # msg -> bytes, pushes sent and not yet settled
        self._async_errors: list = []
        self.error_feedback = error_feedback   # True: chains that drop more than bf16 rounding
        self._residual: dict[str, np.ndarray] = {}   # block key -> what lossy codecs left unsent
        self._rng = np.random.default_rng(seed)
        self._acc: dict[str, list] = {}              # name -> [sum, count, chain, acks]
        self._acc_lock = threading.Lock()
        self._acc_every, self._acc_threshold = 1, None
        self._broker_silent = False
        self._closed = False
        self._cons: dict[str, dict] = {}             # name -> consistency model (from the broker)
        self._server_versions: dict[str, int] = {}   # name -> version named in heartbeats
        self._pulled: dict[str, int] = {}            # name -> version last returned by pull
        self._bsp_next: dict[str, int] = {}          # name -> version the next pull waits for
        self._tables: dict[str, dict] = {}           # table name -> its settings (from the broker)
        self.ctx = zmq.Context()
        try:
            welcome = net.hello(self.ctx, self.url, "client", timeout, curve_configure,
                                curve=self.curve)
            self.partitions = welcome["partitions"]
            self.cache = WeightCache(self.partitions)
            self.cache.down = set(welcome.get("down") or [])
            self.agent = Agent(self)
            self.agent.open(welcome, host)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.agent.start()

    # -- helpers ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")
        if isinstance(self.agent.error, security.SecurityError):   # the broker refused us
            raise security.SecurityError(self.agent.error.args[0])
        if self.agent.error is not None:
            raise GradbusError(f"client I/O thread failed: {self.agent.error!r}")

    def _send(self, kind: str, frames_fn, fut: Future | None):
        with self._lock:
            self._check_open()
            ident = next(self._ids)
            frames = frames_fn(ident)
            self.agent.submit(("send", (kind, ident), frames, fut))
        return ident

    def _request(self, kind: str, timeout: float | None = None, **fields) -> dict:
        fut: Future = Future()
        with self._lock:
            self._check_open()
            req = next(self._ids)
            self.agent.submit(("send", ("req", req), [wire.pack(kind, req=req, **fields)], fut))
        return fut.result(timeout if timeout is not None else self.timeout)

    def _layouts(self, names) -> dict[str, TensorLayout]:
        missing = [n for n in names if n not in self.cache.layouts]
        found = {n: self.cache.layouts[n] for n in names if n in self.cache.layouts}
        if missing:
            reply = self._request(wire.CATALOG, names=missing)
            for t in reply["tensors"]:
                found[t["name"]] = TensorLayout.from_wire(t)
                self._learn_cons(t)
            absent = [n for n in missing if n not in found]
            if absent:
                raise error_from(Code.UNKNOWN_KEY.value, f"no such tensor: {', '.join(absent)}")
        return found

    def _learn_cons(self, t: dict) -> None:
        try:
            self._cons[t["name"]] = specs.consistency_from_wire(t.get("cons"))
        except ValueError:
            pass

    # -- public API -----------------------------------------------------------------------
    def init(self, tensors: dict, optimizer: specs.Optimizer | None = None,
             timeout: float | None = None, consistency: str | None = None,
             stale_policy: str = "refuse", scale_lr: bool = False) -> dict[str, np.ndarray]:
        """Create parameters (no-op for names that exist) and return their current weights.

        ``tensors`` maps a name to an array (the initial values) or an initializer such as
        ``gradbus.Normal((784, 128), std=0.01)``. ``consistency``: ``"async"`` (default),
        ``"ssp:S"`` (bounded staleness; ``stale_policy`` ``"refuse"``: a push computed on
        weights more than S versions old fails with StaleError, ``"delay"``: ``pull`` waits
        until the weights are at most S versions behind) or ``"bsp:N"`` (a step is applied once
        N workers' gradients are in; ``pull`` after a push waits for the step). ``scale_lr``:
        each gradient is scaled by 1/staleness. Pushes of such tensors carry the version the
        weights were pulled at, unless ``push(version=...)`` says otherwise.
        """
        cons = specs.parse_consistency(consistency, stale_policy, scale_lr)
        optimizer = optimizer or specs.SGD(lr=0.01)
        opt = optimizer.to_wire()
        specs.optimizer_from_wire(opt)
        if not isinstance(tensors, dict) or not tensors:
            raise ValueError("init takes a non-empty dict of name -> array or initializer")
        metas, descs, bufs = [], [], []
        for name, val in tensors.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            if isinstance(val, specs.Initializer):
                dt = np.dtype(val.dtype)
                shape = tuple(int(s) for s in val.shape)
                rule = val.to_wire()
            else:
                arr = np.asarray(val)
                if arr.dtype.name not in tcodec.PARAM_DTYPES:
                    raise ValueError(f"{name}: parameters must be float32 or float64, "
                                     f"not {arr.dtype}")
                dt, shape, rule = arr.dtype, arr.shape, {"name": "given"}
            if not shape or any(s <= 0 for s in shape):
                shape = shape or (1,)
                if any(s <= 0 for s in shape):
                    raise ValueError(f"{name}: shape {shape} has an empty dimension")
            layout = TensorLayout(name, dt.name, tuple(shape), block_elems_for(dt.itemsize,
                                                                            self.block_bytes))
            metas.append({**layout.to_wire(), "init": rule})
            if rule["name"] == "given":
                flat = np.ascontiguousarray(val, dtype=dt).reshape(-1).copy()
                for i, key in enumerate(layout.block_keys()):
                    a, b = layout.block_range(i)
                    d, buf = wire.encode_tensor(key, flat[a:b], "raw")
                    descs.append(d)
                    bufs.append(buf)
        fut: Future = Future()
        extra = {"cons": cons} if cons["mode"] != "async" or cons["scale"] else {}
        self._send("msg", lambda msg: [wire.pack(wire.INIT, descs, msg=msg, opt=opt,
                                                 tensors=metas, **extra), *bufs], fut)
        fut.result(timeout or self.timeout)
        if extra:   # the model the broker holds (an existing tensor keeps its own)
            for t in self._request(wire.CATALOG, names=list(tensors))["tensors"]:
                self._learn_cons(t)
        return self.pull(list(tensors), timeout=timeout)

    def push(self, grads: dict, codec: str | None = None, acks: int | str = 1,
             version: int | None = None, timeout: float | None = None) -> Future:
        """Send gradients; returns a Future at once (resolved on ack, or at send for acks=0).

        The arrays are encoded (or copied) before this returns: the caller may reuse them.
        Blocks while ``window`` pushes are unacknowledged; after ``timeout`` seconds raises
        :class:`BackPressureError`. With a lossy ``codec`` the part of each gradient that was
        not sent is kept per key and added to the next push (error feedback; by default not for
        plain bf16, see the ``error_feedback`` argument of :class:`Client`). With local
        accumulation on (:meth:`accumulate`), gradients are summed here and sent only when a
        key is due; the Future then covers the keys sent by this call (None if none were).
        """
        if acks == "all":
            acks = wire.ACKS_ALL
        elif acks not in (0, 1):
            raise ValueError(f"acks must be 0, 1 or 'all', not {acks!r}")
        chain = codec or self.codec
        tcodec.parse_chain(chain)
        if not isinstance(grads, dict) or not grads:
            raise ValueError("push takes a non-empty dict of name -> gradient array")
        if self._async_errors:
            raise self._async_errors.pop(0)
        layouts = self._layouts(list(grads))
        flats = {}
        accumulating = self._acc_every > 1 or self._acc_threshold is not None
        for name, g in grads.items():
            layout = layouts[name]
            if device.is_device(g) and not accumulating:
                # a GPU gradient stays on the GPU: it is encoded there (codecs/device.py) and
                # only the compressed bytes are copied to the host
                if g.shape != layout.shape and g.size != layout.size:
                    raise ValueError(f"{name}: gradient shape {g.shape} does not match "
                                     f"{layout.shape}")
                flats[name] = g.astype(layout.dtype, copy=False).reshape(-1)
                continue
            arr = device.to_host(g) if device.is_device(g) else np.asarray(g)
            if arr.shape != layout.shape and arr.size != layout.size:
                raise ValueError(f"{name}: gradient shape {arr.shape} does not match "
                                 f"{layout.shape}")
            flats[name] = arr.astype(layout.dtype, copy=False).reshape(-1)
        modeled = [n for n in grads if self._cons.get(n, {}).get("mode", "async") != "async"]
        if version is None and modeled:
            version = min(self._pulled.get(n, self.cache.version(n) if self.cache.tracked(n)
                                           else 0) for n in modeled)
        for n in modeled:
            if self._cons[n]["mode"] == "bsp":
                self._bsp_next[n] = int(version) + 1     # the next pull waits for the step
        if self._acc_every > 1 or self._acc_threshold is not None:
            flats, counts = self._accumulate(flats, chain, acks)
            if not flats:
                fut: Future = Future()
                fut.set_result(None)
                return fut
            try:
                return self._send_push(flats, layouts, chain, acks, version, timeout, counts)
            except BaseException:
                self._hold_back(flats, counts, chain, acks)   # not sent: keep the sums
                raise
        return self._send_push(flats, layouts, chain, acks, version, timeout)

    def _send_push(self, flats: dict, layouts: dict, chain: str, acks: int,
                   version: int | None, timeout: float | None,
                   counts: dict | None = None) -> Future:
        lossy = (tcodec.is_lossy(chain) if self.error_feedback == "all" else
                 self.error_feedback and tcodec.drops_more_than_rounding(chain))
        descs, bufs, residuals = [], [], {}
        for name, flat in flats.items():
            layout = layouts[name]
            cnt = counts.get(name, 1) if counts else 1
            for i, key in enumerate(layout.block_keys()):
                a, b = layout.block_range(i)
                block = flat[a:b]
                on_device = device.is_device(block)
                if lossy:
                    res = self._residual.get(key)
                    if res is not None:     # kept where the gradients live
                        block = block + (device.array_module(block).asarray(res) if on_device
                                         else device.to_host(res))
                    d, buf, decoded = wire.encode_tensor_lossy(key, block, chain, self._rng)
                    residuals[key] = (block - decoded).astype(block.dtype, copy=False)
                else:
                    d, buf = wire.encode_tensor(key, block, chain, rng=self._rng)
                    if not on_device:
                        buf = net.detach(buf, flat)   # never send the caller's own memory
                if cnt != 1:
                    d["cnt"] = cnt      # the shard applies it as cnt gradients (steps of the mean)
                descs.append(d)
                bufs.append(buf)
        extra = {"ver": int(version)} if version is not None else {}
        fut = self._submit_push(descs, bufs, acks, timeout, extra)
        self._residual.update(residuals)    # only now is the push really on its way
        self.stats["push_raw_bytes"] += sum(f.nbytes for f in flats.values())
        return fut

    def _submit_push(self, descs: list, bufs: list, acks: int, timeout: float | None,
                     extra: dict) -> Future:
        """Take credit for an encoded push and hand it to the agent; returns its Future."""
        nbytes = sum(d["n"] for d in descs)
        msg = self._take_credit(nbytes, self.timeout if timeout is None else timeout)
        fut: Future = Future()
        try:
            with self._lock:
                self._check_open()
                frames = [wire.pack(wire.PUSH, descs, msg=msg, acks=acks, **extra), *bufs]
                self.agent.submit(("send", ("msg", msg), frames, fut if acks else None))
        except BaseException:
            with self._cond:
                self._credit_held.pop(msg, None)
                self._cond.notify_all()
            raise
        self.stats["pushes"] += 1
        self.stats["push_bytes"] += nbytes
        if acks == 0:
            fut.set_result(None)
        return fut

    def _take_credit(self, nbytes: int, timeout: float) -> int:
        """Wait for a slot in the credit window (count and bytes; a push larger than
        ``window_bytes`` goes alone); returns the push's msg id."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (len(self._credit_held) >= self.window or
                   (self._credit_held and
                    sum(self._credit_held.values()) + nbytes > self.window_bytes)):
                self._check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats["window_full"] += 1
                    raise BackPressureError(
                        f"credit window ({len(self._credit_held)} pushes, "
                        f"{sum(self._credit_held.values())} B unacknowledged; limits "
                        f"{self.window} pushes, {self.window_bytes} B) still full after {timeout}s")
                self._cond.wait(min(left, 0.1))
            msg = next(self._ids)
            self._credit_held[msg] = nbytes
            return msg

    # -- local accumulation ---------------------------------------------------------------
    def accumulate(self, every: int = 1, threshold: float | None = None) -> None:
        """Sum gradients locally and push a key only when it is due: after ``every`` pushes,
        or (with ``threshold``) once the summed gradient's norm reaches ``threshold`` times the
        norm of the key's current weights (the "significantly modified" filter). What is held
        back is sent by :meth:`flush` and :meth:`close`, never dropped. ``every=1`` and no
        threshold turns accumulation off."""
        if not isinstance(every, int) or every < 1:
            raise ValueError("every must be a positive int")
        if threshold is not None and not threshold > 0:
            raise ValueError("threshold must be positive")
        with self._acc_lock:
            pending = bool(self._acc)
        if pending:
            self._flush_accumulated()
        self._acc_every, self._acc_threshold = every, threshold

    def _accumulate(self, flats: dict, chain: str, acks: int) -> tuple[dict, dict]:
        due, counts = {}, {}
        with self._acc_lock:
            for name, flat in flats.items():
                ent = self._acc.get(name)
                if ent is None:
                    ent = self._acc[name] = [flat.astype(flat.dtype, copy=True), 0, chain, acks]
                else:
                    ent[0] += flat
                ent[1] += 1
                ent[2], ent[3] = chain, acks
                if self._due(name, ent):
                    due[name], counts[name] = self._acc.pop(name)[:2]
            self.stats["accumulated"] += len(flats) - len(due)
        return due, counts

    def _hold_back(self, flats: dict, counts: dict, chain: str, acks: int) -> None:
        with self._acc_lock:
            for name, flat in flats.items():
                ent = self._acc.get(name)
                if ent is None:
                    self._acc[name] = [flat, counts[name], chain, acks]
                else:
                    ent[0] += flat
                    ent[1] += counts[name]

    def _due(self, name: str, ent: list) -> bool:
        if self._acc_threshold is None:
            return ent[1] >= self._acc_every
        if self._acc_every > 1 and ent[1] >= self._acc_every:
            return True
        if not self.cache.tracked(name):
            return True
        w = self.cache.tensor(name)
        return float(np.linalg.norm(ent[0])) >= self._acc_threshold * float(np.linalg.norm(w))

    def _flush_accumulated(self) -> list[Future]:
        with self._acc_lock:
            held, self._acc = self._acc, {}
        futs = []
        groups: dict[tuple, dict] = {}
        for name, (flat, count, chain, acks) in held.items():
            groups.setdefault((chain, acks), {})[name] = (flat, count)
        for (chain, acks), items in groups.items():
            flats = {n: f for n, (f, _) in items.items()}
            futs.append(self._send_push(flats, self._layouts(list(flats)), chain, acks, None,
                                        None, {n: c for n, (_, c) in items.items()}))
        return futs

    def compression_stats(self) -> dict:
        """Bytes pushed on the wire against their decoded size, and the error-feedback state."""
        raw, wire_b = self.stats["push_raw_bytes"], self.stats["push_bytes"]
        res = list(self._residual.values())
        return {"push_bytes": wire_b, "push_raw_bytes": raw,
                "ratio": (raw / wire_b) if wire_b else None,
                "error_feedback_keys": len(res),
                "error_feedback_norm": float(np.sqrt(sum(float((r * r).sum()) for r in res))),
                "accumulating_keys": len(self._acc)}

    # -- embedding tables -----------------------------------------------------------------
    def init_table(self, name: str, dim: int, initializer: specs.Initializer | None = None,
                   optimizer: specs.Optimizer | None = None, *, dtype: str = "float32",
                   expiry: float | None = None, min_count: int = 1,
                   consistency: str | None = None, stale_policy: str = "refuse",
                   scale_lr: bool = False, spread: int = 0,
                   timeout: float | None = None) -> None:
        """Create an embedding table (a no-op when it exists with the same dim and dtype).

        Rows are int64 ids, each a vector of ``dim``; a row is created by the first push that
        touches it, on the shard owning its partition, so the table spreads over every shard.
        A row not created yet reads as its initial value (``initializer``, default
        ``Normal(std=0.01)``; random rules are a function of the seed and the row id).
        ``optimizer``: ``SGD`` (no momentum), ``Adagrad`` (default, lr 0.05) or ``FTRL``.
        ``expiry``: seconds after which a row no push touched is dropped (off by default).
        ``min_count``: a row is created only once ``min_count`` pushes carried its id; the
        gradients before that are dropped (off by default). ``consistency``: ``"async"``
        (default) or ``"ssp:S"``: a push of rows read more than S table versions (pushes
        applied to the table) ago fails with StaleError; ``scale_lr`` scales each by
        1/staleness. Reads are always current, so ``stale_policy="delay"`` never waits.
        ``"bsp:N"``: a push is applied once N workers' pushes (or every connected worker's)
        for the step are in, and a read after a push waits until that step is applied.
        ``spread``: the number of partitions the rows are placed in (0, the default: all of
        them); fewer partitions mean fewer, larger messages per push and read, and so more
        rows per second, as long as they still cover the shards."""
        if not isinstance(name, str) or not name or "#" in name:
            raise ValueError(f"table names must be non-empty strings without '#', got {name!r}")
        init = (initializer or specs.Normal(std=0.01)).to_wire()
        opt = (optimizer or specs.Adagrad(lr=0.05)).to_wire()
        try:
            cons = specs.parse_consistency(consistency, stale_policy, scale_lr)
            cfg = specs.table_from_wire({"dim": dim, "dtype": dtype, "init": init, "opt": opt,
                                         "expiry": float(expiry or 0.0), "min_count": min_count,
                                         "cons": cons, "spread": spread})
        except WireError as e:
            raise ValueError(f"table {name}: {e.args[0]}") from None
        fut: Future = Future()
        self._send("msg", lambda msg: [wire.pack(wire.INIT, msg=msg, opt=opt, tensors=[],
                                                 tables=[{"name": name, **cfg}])], fut)
        fut.result(timeout or self.timeout)
        self._tables.pop(name, None)     # an existing table keeps its own settings
        self._table(name)

    def _table(self, name: str) -> dict:
        cfg = self._tables.get(name)
        if cfg is None:
            for t in self._request(wire.CATALOG, names=[name]).get("tables") or []:
                if isinstance(t, dict) and t.get("name") == name:
                    cfg = self._tables[name] = specs.table_from_wire(t)
            if cfg is None:
                raise error_from(Code.UNKNOWN_KEY.value, f"no such table: {name}")
        return cfg

    def pull_rows(self, name: str, ids, timeout: float | None = None) -> np.ndarray:
        """The rows ``ids`` (any integer array) of table ``name``, shape ``ids.shape + (dim,)``,
        read from their shards (one round trip per shard). Rows not created yet read as their
        initial value. A read sees every push this client sent before it."""
        cfg = self._table(name)
        shape = np.shape(ids)
        flat = rows_mod.as_ids(ids)
        uniq, inv, reqs = rows_mod.read_plan(name, flat, self.partitions, cfg["dim"]
                                             * tcodec.DTYPES[cfg["dtype"]].itemsize, cfg["spread"])
        # bsp: after a push, the broker holds the read until the step is applied
        step = {"min": self._bsp_next[name]} if name in self._bsp_next else {}
        futs = []
        for q, _ in reqs:
            fut: Future = Future()
            with self._lock:
                self._check_open()
                req = next(self._ids)
                self.agent.submit(("rows", req, [wire.pack(wire.ROWS, req=req, table=name,
                                                           q=q, **step)], fut))
            futs.append(fut)
        t = self.timeout if timeout is None else timeout
        replies = [f.result(t) for f in futs]
        if replies:
            self._pulled[name] = min(tv for _, tv in replies)
        out = rows_mod.assemble(name, uniq, reqs, [r for r, _ in replies], cfg["dim"],
                                cfg["dtype"])
        self.stats["rows_read"] += len(uniq)
        return out[inv].reshape(*shape, cfg["dim"])

    def push_rows(self, name: str, ids, grads, codec: str | None = None, acks: int | str = 1,
                  timeout: float | None = None) -> Future:
        """Send gradients for rows ``ids`` of table ``name`` (``grads``: one row of ``dim``
        per id; duplicate ids are summed). Returns a Future, like :meth:`push`; the shards
        apply one optimizer step per row on the sum of the gradients a batch holds for it.
        ``codec``: a dense chain (``raw``, ``bf16``, ``fp16``, ``int8``, ``|zstd``); rows
        get no error feedback."""
        if acks == "all":
            acks = wire.ACKS_ALL
        elif acks not in (0, 1):
            raise ValueError(f"acks must be 0, 1 or 'all', not {acks!r}")
        chain = codec or "raw"
        if tcodec.parse_stages(chain).sparsifier is not None:   # raises on a bad chain
            raise ValueError(f"rows take a dense codec chain, not {chain!r}")
        cfg = self._table(name)
        flat = rows_mod.as_ids(ids)
        g = np.asarray(grads)
        if g.size != len(flat) * cfg["dim"] or (g.ndim >= 1 and g.shape[-1] != cfg["dim"]):
            raise ValueError(f"{name}: {len(flat)} ids need gradients of shape "
                             f"[{len(flat)}, {cfg['dim']}], got {g.shape}")
        g = g.astype(cfg["dtype"], copy=False).reshape(len(flat), cfg["dim"])
        if not len(flat):
            done: Future = Future()
            done.set_result(None)
            return done
        uniq, summed = rows_mod.sum_duplicates(flat, g)
        descs, bufs = [], []
        for p, where in rows_mod.by_partition(name, uniq, self.partitions, cfg["spread"]):
            d, buf = wire.encode_tensor(row_key(name, p), np.ascontiguousarray(summed[where]),
                                        chain, rng=self._rng)
            d["ids"] = uniq[where].tobytes()
            descs.append(d)
            bufs.append(buf)
        modeled = cfg["cons"]["mode"] != "async"    # say which version the rows were read at
        ver = max(0, self._pulled.get(name, 0))
        fut = self._submit_push(descs, bufs, acks, timeout, {"ver": ver} if modeled else {})
        if cfg["cons"]["mode"] == "bsp":
            self._bsp_next[name] = ver + 1       # the next read waits for the step
        self.stats["rows_pushed"] += len(uniq)
        self.stats["push_raw_bytes"] += summed.nbytes
        return fut

    def pull(self, keys=None, min_version: int | None = None,
             timeout: float | None = None) -> dict[str, np.ndarray]:
        """The freshest local weights, at once. Tensors not yet followed are fetched first
        (subscribe, then snapshot). With ``min_version``, waits until every requested tensor has
        at least that many gradients applied. Arrays are read-only and never change."""
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        if isinstance(keys, str):
            keys = [keys]
        if keys is None:
            keys = list(self.cache.layouts)
            if not keys:
                keys = [t["name"] for t in self._request(wire.CATALOG)["tensors"]]
        names = list(keys)
        todo = [n for n in names if not self.cache.tracked(n)]
        if todo:
            layouts = self._layouts(todo)
            fut: Future = Future()
            with self._lock:
                self._check_open()
                self.agent.submit(("track", [layouts[n] for n in todo], fut))
            fut.result(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.agent.error is not None or self._closed:
                    self._check_open()
                ready = all(self.cache.tracked(n) for n in names)
                if ready and all(self.cache.version(n) >= self._needed(n, min_version)
                                 for n in names):
                    out = {n: self.cache.tensor(n) for n in names}
                    for n in names:
                        self._pulled[n] = self.cache.version(n)
                    return out
                if self._broker_silent:
                    raise BrokerUnavailableError(
                        f"the broker at {self.url} has been silent for over "
                        f"{timing.HEARTBEAT_INTERVAL * timing.LIVENESS:.1f}s")
                down = set().union(*(self.cache.unavailable(n) for n in names
                                     if n in self.cache.layouts))
                if down:
                    raise ShardUnavailableError(
                        f"partitions {sorted(down)[:8]} of {names} have no live shard")
                left = deadline - time.monotonic()
                if left <= 0:
                    have = {n: self.cache.version(n) for n in names if n in self.cache.layouts}
                    raise TimeoutError(f"weights not at version {min_version} after "
                                       f"{timeout}s (have {have})")
                self._cond.wait(min(left, 0.1))

    def _needed(self, name: str, min_version: int | None) -> int:
        """The version ``pull`` waits for: the caller's, raised by the tensor's consistency
        model (ssp with policy delay: at most S behind the broker's latest; bsp: past the step
        this client last pushed)."""
        need = -1 if min_version is None else min_version
        cons = self._cons.get(name)
        if cons is None or cons["mode"] == "async":
            return need
        if cons["mode"] == "ssp" and cons["policy"] == "delay" and name in self._server_versions:
            need = max(need, self._server_versions[name] - cons["n"])
        if cons["mode"] == "bsp":
            need = max(need, self._bsp_next.get(name, -1))
        return need

    @property
    def broker_alive(self) -> bool:
        """False once the broker has been silent (no heartbeat, no reply) past its liveness."""
        return not self._broker_silent

    def version(self, name: str) -> int:
        """Gradients applied to ``name`` in the freshest weights this client holds (-1 until it
        holds every block). UnknownKeyError for a name this client does not follow."""
        try:
            return self.cache.version(name)
        except KeyError:
            raise error_from(Code.UNKNOWN_KEY.value,
                             f"{name!r} is not followed by this client (pull it first)") from None

    def flush(self, timeout: float | None = None) -> None:
        """Send what local accumulation holds back, then wait until every push sent so far is
        acknowledged (applied or refused)."""
        held = self._flush_accumulated() if self._acc else []
        self._wait_acked(timeout)
        for f in held:   # what accumulation held back was refused: say so here, not silently
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _wait_acked(self, timeout: float | None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while self._credit_held:
                if self.agent.error is not None:
                    self._check_open()
                if self._broker_silent:
                    raise BrokerUnavailableError(
                        f"{len(self._credit_held)} pushes unacknowledged and the broker at "
                        f"{self.url} is silent")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._credit_held)} pushes unacknowledged")
                self._cond.wait(min(left, 0.1))

    def status(self, timeout: float | None = None) -> dict:
        """The broker's status map (shards, workers, tensors, counters)."""
        return self._request(wire.STATUS, timeout=timeout)["status"]

    def close(self, timeout: float = 10.0) -> None:
        """Flush (up to ``timeout``), then stop the I/O thread and close every socket."""
        if self._closed:
            return
        try:
            if self.agent.error is None:
                self.flush(timeout)
        except (TimeoutError, GradbusError) as e:
            # closing goes on: the pushes in question are reported, not raised from close()
            log.warning("closing with %d pushes unacknowledged or refused: %s",
                        len(self._credit_held), e)
        finally:
            with self._lock:
                self._closed = True
                try:
                    self.agent.submit(("stop",))
                except zmq.Again:
                    pass   # the agent has stopped already (it failed): nothing reads the pipe
            self.agent.join(timeout=5)
            self.agent.pipe_out.close(linger=0)
            self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(url: str | None = None, **kw) -> Client:
    """Connect to a broker's client URL (default ``$GRADBUS_BROKER`` or tcp://127.0.0.1:5555)."""
    return Client(url, **kw)


__all__ = ["Client", "connect", "DEFAULT_WINDOW", "DEFAULT_WINDOW_BYTES"]
