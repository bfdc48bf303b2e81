"""One-shot requests for ops commands (status) over a short-lived DEALER.

Every request takes ``curve``: the ops tool's CURVE keys (a
:class:`~gradbus.codecs.security.Curve` with the broker's public key) when the broker has
CURVE on, else None. A refused key raises :class:`~gradbus.codecs.errors.SecurityError`."""
from __future__ import annotations

import itertools
import time

import zmq

from gradbus.codecs import net, security, wire
from gradbus.codecs.errors import BrokerUnavailableError, Code, GradbusError, error_from

_ids = itertools.count(1)


class Unanswered(BrokerUnavailableError):
    """No broker took the request, or none replied, in time."""


def request(url: str, kind: str, timeout: float = 5.0, *,
            curve: security.Curve | None = None, **fields) -> dict:
    """Send one request to the broker's frontend and return the reply header."""
    return request_all(url, kind, timeout, curve=curve, **fields)[0]


def request_all(url: str, kind: str, timeout: float = 5.0, *,
                curve: security.Curve | None = None, **fields) -> list[dict]:
    """Send one request and return every reply header to it (a reply's ``of`` says how many
    parts the answer comes in, as for a digest that each shard answers). ``url`` may name a
    broker pair's two (comma-separated): the request goes to each in turn until one that is
    not the standby answers."""
    urls = net.broker_urls(url)
    for i, one in enumerate(urls):
        try:
            return _request_all(one, kind, timeout, curve, fields, refused_fast=len(urls) > 1)
        except GradbusError as e:
            last = i == len(urls) - 1
            if last and isinstance(e, Unanswered):
                raise Unanswered(f"{e.args[0]}; {net.what_to_check(urls)}") from None
            if last or not (e.code == Code.NOT_ACTIVE or isinstance(e, Unanswered)):
                raise
    raise AssertionError("unreachable")


def _request_all(url: str, kind: str, timeout: float, curve, fields,
                 refused_fast: bool = False) -> list[dict]:
    """One broker's replies. ``refused_fast`` (a broker of a pair): a refused connection
    (nothing listens there) is Unanswered at once, not at the timeout."""
    net.split_url(url)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if curve is not None:
        security.client_setup(s, curve)
    watch = security.HandshakeWatch(s, curve, url, refusals=refused_fast)
    deadline = time.monotonic() + timeout
    try:
        s.connect(url)
        req = next(_ids)
        if not net.send_before(s, wire.pack(kind, req=req, **fields), deadline, watch):
            _raise_if_refused(watch, url)
            raise Unanswered(f"could not send to the broker at {url} within {timeout:.1f}s: "
                               f"no connection took the request (is the broker up there, "
                               f"and does it accept this process's keys?)")
        replies: list[dict] = []
        while True:
            if not watch.poll(int(timeout * 1000)):
                _raise_if_refused(watch, url)
                raise Unanswered(f"no reply from the broker at {url} within {timeout:.1f}s")
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
        watch.close()
        s.close(linger=0)


def _raise_if_refused(watch: security.HandshakeWatch, url: str) -> None:
    if watch.refused:
        raise Unanswered(f"nothing listens at {url}: the connection was refused")


def status(url: str, timeout: float = 5.0, curve: security.Curve | None = None) -> dict:
    """The broker's status. Of a broker pair (``url`` naming both): the active one's, with
    ``brokers`` listing each broker's URL, role and epoch (or the error asking it gave)."""
    urls = net.broker_urls(url)
    if len(urls) == 1:
        return request(url, wire.STATUS, timeout, curve=curve)["status"]
    got, brokers = [], []
    for one in urls:
        try:
            st = _request_all(one, wire.STATUS, timeout, curve, {}, refused_fast=True)[0]["status"]
        except GradbusError as e:
            brokers.append({"url": one, "role": "unreachable", "error": str(e)})
            continue
        pair = st.get("pair") or {}
        brokers.append({"url": one, "role": pair.get("role", "single"),
                        "epoch": pair.get("epoch"), "takeovers": pair.get("takeovers")})
        got.append((pair.get("role") == "active", st))
    if not got:
        raise Unanswered(f"no broker of {url} answered: "
                         + "; ".join(b["error"] for b in brokers)
                         + f"; {net.what_to_check(urls)}")
    st = max(got, key=lambda x: x[0])[1]
    return {**st, "brokers": brokers}


def partitions(url: str, timeout: float = 5.0, curve: security.Curve | None = None) -> dict:
    """The broker's partition table: ``owners``, ``standbys``, ``syncing``, ``epochs``,
    ``seqs`` and ``down``, each indexed by partition."""
    return request(url, wire.STATUS, timeout, curve=curve, table=True)["status"]["table"]


def digest(url: str, partitions: list[int] | None = None,
           timeout: float = 10.0, curve: security.Curve | None = None
           ) -> dict[str, dict[int, tuple[int, str]]]:
    """``{shard: {partition: (seq, digest)}}`` from every live shard holding the partitions
    (all partitions by default): replicas of a partition at the same seq have equal digests."""
    fields = {"ps": list(partitions)} if partitions is not None else {}
    out: dict[str, dict[int, tuple[int, str]]] = {}
    for h in request_all(url, wire.DIGEST, timeout, curve=curve, **fields):
        if h["shard"]:
            out[h["shard"]] = {int(p): (int(seq), str(d)) for p, seq, d in h["parts"]}
    return out


def tier_urls(url: str, timeout: float = 5.0,
              curve: security.Curve | None = None) -> list[str]:
    """Every member's URL (a pair's two comma-separated) of the broker tier ``url`` is a
    member of, in the tier's order (protocol section 24); ``[url]`` for a broker of no tier."""
    tier = status(url, timeout, curve).get("tier")
    return [",".join(m["urls"]) for m in tier["members"]] if tier else [url]


def checkpoint(url: str, timeout: float = 60.0,
               curve: security.Curve | None = None) -> list[dict]:
    """Have every live shard write a checkpoint now (of a broker tier: every member's
    shards): one ``{shard, path, time, partitions}`` (or ``{shard, error}``) per shard."""
    out = []
    for member in tier_urls(url, min(timeout, 10.0), curve):
        for h in request_all(member, wire.CHECKPOINT, timeout, curve=curve):
            if h["shard"]:
                out.append({k: h[k] for k in ("shard", "path", "time", "partitions", "error")
                            if k in h})
    return sorted(out, key=lambda r: r["shard"])


def rebalance(url: str, timeout: float = 5.0, **kw) -> dict:
    """Ask the broker to even out bytes per shard by moving partitions (returns at once; the
    moves show in status and the partition table as they happen)."""
    return request(url, wire.ADMIN, timeout, op="rebalance", **kw)["result"]


def drain(url: str, shard: str, timeout: float = 5.0, **kw) -> dict:
    """Move every partition off ``shard``; it stops once it holds nothing."""
    return request(url, wire.ADMIN, timeout, op="drain", shard=shard, **kw)["result"]
