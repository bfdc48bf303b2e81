"""The shard process: one DEALER to the broker's backend around :class:`ShardCore`.

It finds the backend port with a HELLO on the broker's client URL, registers, heartbeats every
``HEARTBEAT_INTERVAL`` and re-registers (after a fresh HELLO, with back-off) when the broker is
silent for ``LIVENESS`` intervals.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

import zmq

from gradbus.codecs import net, timing, wire
from gradbus.codecs.errors import Code, WireError

from .core import ShardCore

log = logging.getLogger("gradbus.shard")

DRAIN_MAX = 64


class ShardServer:
    def __init__(self, broker_url: str, shard_id: str | None = None, *, clock=time.monotonic,
                 ctx: zmq.Context | None = None, hello_timeout: float = 30.0,
                 heartbeat_interval: float = timing.HEARTBEAT_INTERVAL,
                 liveness: int = timing.LIVENESS, apply_delay: float = 0.0, **core_kw):
        net.split_url(broker_url)
        self.broker_url = broker_url
        self.shard_id = shard_id or f"shard-{uuid.uuid4().hex[:8]}"
        self.core = ShardCore(self.shard_id, **core_kw)
        self.clock = clock
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.hello_timeout = hello_timeout
        self.hb_interval = heartbeat_interval
        self.liveness = liveness
        self.apply_delay = apply_delay   # fault injection: a slow shard (seconds per message)
        self.stopping = threading.Event()
        self.registered = threading.Event()
        self.sock = None
        self._registered_at = float("-inf")

    def _connect(self) -> None:
        host, _ = net.split_url(self.broker_url)
        welcome = net.hello(self.ctx, self.broker_url, "shard", self.hello_timeout)
        self.sock = self.ctx.socket(zmq.DEALER)
        net.tune(self.sock)
        self.sock.setsockopt(zmq.ROUTING_ID, self.shard_id.encode())
        self.sock.connect(net.url(host, welcome["backend"]))
        self._register()

    def _register(self) -> None:
        self._registered_at = self.clock()
        st = self.core.store.partitions
        self.sock.send(wire.pack(wire.REGISTER, shard=self.shard_id,
                                 holds=[[p, st[p].epoch, st[p].seq] for p in sorted(st)
                                        if p not in self.core.installing]))

    def run(self) -> None:
        try:
            self._connect()
            last_heard = last_sent = self.clock()
            while not self.stopping.is_set():
                if self.sock.poll(int(min(self.hb_interval, 0.05) * 1000), zmq.POLLIN):
                    for _ in range(DRAIN_MAX):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        last_heard = self.clock()
                        if not frames:
                            continue
                        head = _peek(frames[0])
                        kind = head.get("kind")
                        if kind == wire.REGISTERED:
                            self.registered.set()
                            log.info("%s registered with %s", self.shard_id, self.broker_url)
                            continue
                        if kind == wire.ERROR and head.get("code") == Code.NOT_REGISTERED.value:
                            # declared dead while alive (a stall): register again, once per
                            # liveness window (several messages sent meanwhile each get one)
                            self.registered.clear()
                            if self.clock() - self._registered_at > self.hb_interval * self.liveness:
                                self._register()
                            continue
                        if kind in (wire.HEARTBEAT, wire.ERROR):
                            if kind == wire.ERROR:
                                log.warning("broker error: %s", head.get("message"))
                            continue
                        if self.apply_delay:
                            time.sleep(self.apply_delay)
                        try:
                            outs = self.core.handle(frames, head or None)
                        except Exception:   # a bug must not take the shard down
                            log.exception("%s failed handling a %s", self.shard_id, kind)
                            self.core.stats["errors"] += 1
                            continue
                        for out in outs:
                            self.sock.send_multipart(out, copy=False)
                            last_sent = self.clock()
                        if self.clock() - last_sent >= self.hb_interval:
                            break   # a slow shard still heartbeats between messages
                now = self.clock()
                if now - last_sent >= self.hb_interval:
                    self.sock.send(wire.pack(wire.HEARTBEAT, info=self.core.info()))
                    last_sent = now
                if now - last_heard > self.hb_interval * self.liveness:
                    log.warning("%s: broker silent for %.2fs, reconnecting", self.shard_id,
                                now - last_heard)
                    self.registered.clear()
                    self.sock.close(linger=0)
                    self._connect()
                    last_heard = self.clock()
        finally:
            self.close()

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name=f"gradbus-{self.shard_id}", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.send(wire.pack(wire.BYE), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()


def _peek(frame) -> dict:
    """The header of a message from the broker, or {} if it does not parse (the core will
    report it)."""
    try:
        return wire.unpack_header(frame, wire.SHARD_KINDS)
    except WireError:
        return {}
