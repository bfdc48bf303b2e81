"""Small socket helpers shared by every process: address parsing and the discovery handshake.

Every process needs only the broker's client URL; a HELLO on it returns the other ports.
"""
from __future__ import annotations

import itertools
import os
import time
from urllib.parse import urlsplit

import numpy as np
import zmq

from . import cores, security, timing, wire
from .errors import BrokerUnavailableError, Code, GradbusError

DEFAULT_BROKER = "tcp://127.0.0.1:5555"
# poll event bits as plain ints, for loops that test them every turn: zmq's are IntFlags, and
# each ``&`` or ``|`` on one is several Python calls
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
#: Frames below this are copied by pyzmq even with copy=False. Zero-copy sends cost a
#: notification through pyzmq's garbage-collector thread per frame, which outweighs a memcpy
#: for frames up to a few hundred KiB (measured: 17% of a shard's CPU at 64 KiB pushes).
COPY_THRESHOLD = 256 << 10


def poll_spinning(poller: zmq.Poller, timeout: float, spin: float) -> dict:
    """``poller.poll`` for up to ``timeout`` seconds, as a dict; first, for up to ``spin``
    seconds of that, polled again and again without blocking (:func:`cores.spin_then_block`).
    A message that arrives within the spin is taken by a loop that never slept: no wake-up
    (tens of microseconds on a virtual machine) and caches still warm, for the CPU the spin
    burns."""
    return dict(cores.spin_then_block(poller.poll, timeout, spin))


def detach(buf, src):
    """A frame buffer that does not alias ``src``. Frames are sent zero-copy, later, from
    another thread, so memory its owner may change must not go out as it is: small frames are
    copied once, straight into a ZeroMQ message; larger ones into a new array."""
    if isinstance(buf, np.ndarray) and np.may_share_memory(buf, src):
        return zmq.Frame(buf, copy=True) if buf.nbytes < COPY_THRESHOLD else buf.copy()
    return buf


def tune(sock: zmq.Socket) -> zmq.Socket:
    """Options every gradbus socket gets: no linger on close, the copy threshold above."""
    sock.linger = 0
    sock.copy_threshold = COPY_THRESHOLD
    return sock


_monitors = itertools.count()


def watch_closing(sock: zmq.Socket) -> zmq.Socket:
    """A monitor socket that is readable once ``sock``'s connection closes (its peer's
    process went away). A socket has one monitor at a time; each gets its own inproc
    address, since libzmq may not have released the last one yet."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED,
                                   f"inproc://gradbus-closing-{os.getpid()}-{next(_monitors)}")


def stop_watching(sock: zmq.Socket, mon: zmq.Socket | None) -> None:
    """End :func:`watch_closing`'s monitor ``mon`` of ``sock`` (None: there is none)."""
    if mon is not None:
        sock.disable_monitor()
        mon.close(linger=0)


def default_broker() -> str:
    return os.environ.get("GRADBUS_BROKER") or DEFAULT_BROKER


def broker_urls(urls: str) -> list[str]:
    """A broker URL, or a comma-separated list of a broker pair's (protocol section 23):
    each checked as :func:`split_url` does, distinct."""
    out = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else list(urls)
    if not out or not all(out):
        raise GradbusError(f"broker URLs must be tcp://HOST:PORT[,tcp://HOST:PORT], got "
                           f"{urls!r}")
    for u in out:
        split_url(u)
    if len(set(out)) != len(out):
        raise GradbusError(f"a broker URL is named twice in {urls!r}")
    return out


def split_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port), with a clear error for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise GradbusError(f"broker URL must look like tcp://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


def url(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def send_before(sock: zmq.Socket, msg, deadline: float,
                watch: security.HandshakeWatch | None = None) -> bool:
    """Send ``msg`` (one frame) on a fresh connection once it can take it, before ``deadline``
    (``time.monotonic()``); False if it could not by then. A plain ``send`` may block for
    ever: a connection whose handshake libzmq failed (a key the broker refused, a peer that
    does not speak ZMTP) has no pipe left to queue into. ``watch``: its handshake failures are
    raised (:class:`~gradbus.codecs.errors.SecurityError`) as soon as they show."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLOUT)
    if watch is not None:
        poller.register(watch.mon, zmq.POLLIN)
    while True:
        try:
            sock.send(msg, zmq.NOBLOCK)
            return True
        except zmq.Again:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready = dict(poller.poll(max(1, int(left * 1000))))
        if watch is not None and watch.mon in ready:
            watch.check()
            if watch.refused:
                return False      # nothing listens there (a watch that counts refusals)


#: Seconds a wait that can be given up (``stop``) runs before it looks at its stop event again.
STOP_STEP = 0.1
#: A broker pair's first HELLO round and back-off (doubling to RECONNECT_MAX): each attempt
#: costs a round trip to a live broker or a refused connection to a dead one.
PAIR_RETRY_MIN = 0.025


class Stopped(GradbusError):
    """A wait given up because its caller is stopping (its ``stop`` event was set)."""


def _ask(s: zmq.Socket, watch: security.HandshakeWatch, msg, end: float, stop=None):
    """Send ``msg`` and wait for a reply until ``end``: the reply's frame, or None. With
    ``stop`` (an event), in steps of :data:`STOP_STEP`, raising :class:`Stopped` once set."""
    sent = False
    while True:
        if stop is not None and stop.is_set():
            raise Stopped("stopped while waiting for the broker")
        step = end if stop is None else min(end, time.monotonic() + STOP_STEP)
        if not sent:
            sent = send_before(s, msg, step, watch)
            if watch.refused:
                return None
        elif watch.poll(int(max(0.0, step - time.monotonic()) * 1000)):
            return s.recv()
        if watch.refused or time.monotonic() >= end:
            return None


def what_to_check(urls: list) -> str:
    """What a user whose broker does not answer should check, for the message that says so."""
    where = ("the URL (--broker, or $GRADBUS_BROKER where none is given) and that a broker "
             "runs there, reachable from this host")
    if len(urls) > 1:
        return (f"check {where}; of a broker pair, that one of its two brokers is up and on "
                f"this side of the network, and that the list names both")
    return (f"check {where}; of a broker pair, name both brokers' addresses, comma-separated "
            f"(the other may be the active one)")


def hello(ctx: zmq.Context, broker_url: str, role: str, timeout: float,
          configure=None, curve: security.Curve | None = None, stop=None) -> dict:
    """Ask the broker for its ports. Retries with back-off until ``timeout`` seconds pass.
    ``curve``: this process's CURVE keys (None: CURVE off); a handshake the broker refuses
    raises :class:`~gradbus.codecs.errors.SecurityError` at once. Nothing here waits past
    ``timeout``: not the HELLO's send either (see :func:`send_before`). ``stop``: an event
    (a server's stopping flag); once it is set, hello raises :class:`Stopped` within
    :data:`STOP_STEP` seconds. ``broker_url`` may name a broker pair: see :func:`hello_any`."""
    return hello_any(ctx, broker_urls(broker_url), 0, role, timeout, configure, curve,
                     stop)[1]


def hello_any(ctx: zmq.Context, urls: list, first: int, role: str, timeout: float,
              configure=None, curve: security.Curve | None = None, stop=None) -> tuple:
    """:func:`hello` on a list of brokers (a pair), from ``urls[first]`` on, in turn: the
    index of the one that answered and its WELCOME. A standby's ``NOT_ACTIVE`` sends it on
    to the next; so does an attempt that got no answer (the back-off grows once per round),
    and, of several, one whose connection was refused, at once (a broker of a pair that is
    down); a round that ended sooner than its back-off waits out the rest. Of a pair, the
    back-off starts at :data:`PAIR_RETRY_MIN`: a standby that said ``NOT_ACTIVE`` may be
    taking over right now."""
    deadline = time.monotonic() + timeout
    wait = timing.RECONNECT_MIN if len(urls) == 1 else PAIR_RETRY_MIN
    failures = 0   # failed security handshakes, over every attempt
    i = first % len(urls)
    round_start = time.monotonic()
    standby: set = set()       # the URLs whose broker said it is a standby
    while True:
        broker_url = urls[i]
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        if curve is not None:
            security.client_setup(s, curve)
        if configure:
            configure(s)
        watch = security.HandshakeWatch(s, curve, broker_url, failures,
                                        refusals=len(urls) > 1)
        try:
            s.connect(broker_url)
            attempt_end = time.monotonic() + max(0.0, min(wait, deadline - time.monotonic()))
            reply = _ask(s, watch, wire.pack(wire.HELLO, role=role), attempt_end, stop)
            if reply is not None:
                h = wire.unpack_header(reply, frozenset({wire.WELCOME, wire.ERROR}))
                if h["kind"] == wire.WELCOME:
                    return i, h
                if h["code"] != Code.NOT_ACTIVE.value or len(urls) == 1:
                    raise GradbusError(h["message"], h["code"])
                standby.add(broker_url)
        finally:
            failures = watch.failures
            watch.close()
            s.close()
        if time.monotonic() >= deadline:
            if standby:
                raise GradbusError(
                    f"no active broker at {','.join(urls)} within {timeout:.1f}s: "
                    f"{', '.join(sorted(standby))} answered as the standby (a pair serves once "
                    f"a shard has registered with one of them), or as an active broker "
                    f"without the votes to act (a network cut: see the broker's log)",
                    Code.NOT_ACTIVE)
            raise BrokerUnavailableError(f"no broker answered at {','.join(urls)} within "
                                         f"{timeout:.1f}s; {what_to_check(urls)}")
        i = (i + 1) % len(urls)
        if i == first % len(urls):
            rest = min(wait - (time.monotonic() - round_start), deadline - time.monotonic())
            if rest > 0 and (stop.wait(rest) if stop is not None else time.sleep(rest)):
                raise Stopped("stopped while waiting for the broker")
            wait = min(wait * 2, timing.RECONNECT_MAX)
            round_start = time.monotonic()
