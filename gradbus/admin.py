"""One-shot requests for ops commands (status) over a short-lived DEALER."""
from __future__ import annotations

import itertools

import zmq

from gradbus.codecs import net, wire
from gradbus.codecs.errors import GradbusError, error_from

_ids = itertools.count(1)


def request(url: str, kind: str, timeout: float = 5.0, **fields) -> dict:
    """Send one request to the broker's frontend and return the reply header."""
    return request_all(url, kind, timeout, **fields)[0]


def request_all(url: str, kind: str, timeout: float = 5.0, **fields) -> list[dict]:
    """Send one request and return every reply header to it (a reply's ``of`` says how many
    parts the answer comes in, as for a digest that each shard answers)."""
    net.split_url(url)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(url)
        req = next(_ids)
        s.send(wire.pack(kind, req=req, **fields))
        replies: list[dict] = []
        while True:
            if not s.poll(int(timeout * 1000), zmq.POLLIN):
                raise GradbusError(f"no reply from the broker at {url} within {timeout:.1f}s")
            frames = s.recv_multipart()
            h = wire.unpack_header(frames[0], wire.CLIENT_KINDS)
            if h.get("req") != req:
                continue
            if h["kind"] == wire.ERROR:
                raise error_from(h["code"], h["message"])
            replies.append(h)
            of = h.get("of", 1)
            if not isinstance(of, int) or len(replies) >= of:
                return replies
    finally:
        s.close(linger=0)


def status(url: str, timeout: float = 5.0) -> dict:
    return request(url, wire.STATUS, timeout)["status"]


def partitions(url: str, timeout: float = 5.0) -> dict:
    """The broker's partition table: ``owners``, ``standbys``, ``syncing``, ``epochs``,
    ``seqs`` and ``down``, each indexed by partition."""
    return request(url, wire.STATUS, timeout, table=True)["status"]["table"]


def digest(url: str, partitions: list[int] | None = None,
           timeout: float = 10.0) -> dict[str, dict[int, tuple[int, str]]]:
    """``{shard: {partition: (seq, digest)}}`` from every live shard holding the partitions
    (all partitions by default): replicas of a partition at the same seq have equal digests."""
    fields = {"ps": list(partitions)} if partitions is not None else {}
    out: dict[str, dict[int, tuple[int, str]]] = {}
    for h in request_all(url, wire.DIGEST, timeout, **fields):
        if h["shard"]:
            out[h["shard"]] = {int(p): (int(seq), str(d)) for p, seq, d in h["parts"]}
    return out
