"""One-shot requests for ops commands (status) over a short-lived DEALER."""
from __future__ import annotations

import itertools

import zmq

from gradbus.codecs import net, wire
from gradbus.codecs.errors import GradbusError, error_from

_ids = itertools.count(1)


def request(url: str, kind: str, timeout: float = 5.0, **fields) -> dict:
    """Send one request to the broker's frontend and return the reply header."""
    net.split_url(url)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(url)
        req = next(_ids)
        s.send(wire.pack(kind, req=req, **fields))
        while True:
            if not s.poll(int(timeout * 1000), zmq.POLLIN):
                raise GradbusError(f"no reply from the broker at {url} within {timeout:.1f}s")
            frames = s.recv_multipart()
            h = wire.unpack_header(frames[0], wire.CLIENT_KINDS)
            if h.get("req") != req:
                continue
            if h["kind"] == wire.ERROR:
                raise error_from(h["code"], h["message"])
            return h
    finally:
        s.close(linger=0)


def status(url: str, timeout: float = 5.0) -> dict:
    return request(url, wire.STATUS, timeout)["status"]
