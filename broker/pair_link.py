"""The sockets of a broker pair's link (protocol section 23): a PUB this broker binds, on which
it says its role every heartbeat interval, and a SUB connected to the peer's, watched by a
socket monitor so that a peer whose process went away (its connection closed) is known at
once, not only after its silence.

It moves PAIR messages and link events; what they mean is :class:`~.pair.Pair`'s.
"""
from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

from gradbus.codecs import messages, net, security, wire
from gradbus.codecs.errors import WireError

log = logging.getLogger("gradbus.broker")

_PAIR = frozenset({wire.PAIR})
DRAIN_MAX = 64


class PairLink:
    def __init__(self, ctx: zmq.Context, host: str, port: int, peer: str,
                 curve: security.Curve | None = None, auth=None):
        """``curve``: the broker's CURVE settings; both brokers of a pair hold the same key
        pair, and the pair link admits that key alone (``auth``, the broker's
        :class:`~gradbus.codecs.security.Authenticator`)."""
        net.split_url(peer)
        self.peer = peer
        self.pub = self.sub = self.mon = None
        try:
            self.pub = ctx.socket(zmq.PUB)
            net.tune(self.pub)
            self.pub.sndhwm = 16
            if curve is not None:
                auth.admit_pair(curve.public)
                security.server_setup(self.pub, curve, security.PAIR_ZAP_DOMAIN)
            if port == 0:
                self.port = self.pub.bind_to_random_port(f"tcp://{host}")
            else:
                self.pub.bind(f"tcp://{host}:{port}")
                self.port = port
            self.sub = ctx.socket(zmq.SUB)
            net.tune(self.sub)
            self.sub.rcvhwm = 16
            self.sub.subscribe(b"")
            if curve is not None:
                security.client_setup(self.sub, security.Curve(curve.public, curve.secret,
                                                               server_key=curve.public))
            self.mon = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED
                                                   | zmq.EVENT_DISCONNECTED)
            self.sub.connect(peer)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """This broker's pair address (what its peer's ``--peer`` names)."""
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def beat(self, fields: dict) -> None:
        try:
            self.pub.send(wire.pack(wire.PAIR, **fields), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def heard(self) -> list:
        """The PAIR messages waiting (valid ones), oldest first."""
        out = []
        for _ in range(DRAIN_MAX):
            try:
                frame = self.sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(messages.unpack(frame, _PAIR))
            except WireError as e:
                log.warning("pair link: a bad message from %s: %s", self.peer, e)
        return out

    def events(self) -> list[bool]:
        """The link's ups (True) and downs (False) since the last call, in order."""
        out = []
        for _ in range(DRAIN_MAX):
            try:
                ev = recv_monitor_message(self.mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(ev["event"] == zmq.EVENT_CONNECTED)
        return out

    def close(self) -> None:
        if self.sub is not None and self.mon is not None:
            try:
                self.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for s in (self.mon, self.sub, self.pub):
            if s is not None:
                s.close(linger=0)
