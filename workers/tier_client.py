"""The client of a broker tier (protocol section 24): one :class:`~.client.Client` per member,
each name's init, pushes, pulls and rows sent to the member that holds it.

The tier's map (WELCOME's ``tier``) gives every tensor and table one member, by the home
partition of its name (:mod:`gradbus.codecs.tier`). A push of tensors held by several members
goes as one push to each, in parallel, under one Future that resolves when every part is
acknowledged (or fails with the first part that failed); a push of one member's tensors is
that member's push, nothing added. Each member client keeps its own credit window, duplicate
window and weights, so every guarantee of one broker holds per member.

A member that does not answer when the client starts does not stop it: the other members'
names are served, and the member is connected at the first call that needs it (a call that
finds it still silent raises :class:`~gradbus.codecs.errors.BrokerUnavailableError`).
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from concurrent.futures import Future

from gradbus.codecs.errors import BrokerUnavailableError, Code, GradbusError, MovedError
from gradbus.codecs.tier import TierMap

from .client import DEFAULT_TIMEOUT, Client
from .tier_routes import FollowsMoves, JoinedFuture, Reroutes, RoutedFuture

log = logging.getLogger("gradbus.client")
REACH_TIMEOUT = 5.0      # seconds a member not yet connected is given to answer a HELLO


class TierClient(FollowsMoves):
    """A connection to every member of a broker tier; the same calls as :class:`Client`.
    ``gradbus.connect`` returns one when the broker it reaches is a tier member."""

    def __init__(self, first: Client, options: dict | None = None):
        tm = first.tier_map
        if tm is None:
            raise ValueError("not a tier member's client: its WELCOME named no tier")
        self.tier: TierMap = tm
        self.maps_followed = 0     # newer maps taken (a move, a member joining)
        self.stats_moved = 0       # pushes refused MOVED and sent again where their names went
        self.reroutes = Reroutes()
        opts = dict(options or {})
        opts["client_id"] = first.client_id      # one worker, the same id at every member
        self._opts = opts
        self._lock = threading.Lock()            # members connected later, one at a time
        self._accumulate: tuple | None = None    # what accumulate() set, for those too
        self.first = first.tier_at
        self.members: list[Client | None] = [None] * len(tm.members)
        self.members[first.tier_at] = first
        try:
            for i in range(len(tm.members)):
                if self.members[i] is None:
                    try:
                        self._connect(i)
                    except BrokerUnavailableError as e:
                        # its names wait for it; every other member's are served meanwhile
                        log.warning("tier member %d did not answer (%s); its names are "
                                    "reached once it does", i, e)
        except BaseException:
            self.close(1.0)
            raise
        self.client_id = first.client_id

    def _connect(self, i: int) -> Client:
        """Member ``i``'s client, connected now (under the lock, or while starting)."""
        # a member that does not answer is told soon: its names' calls fail fast meanwhile
        timeout = self._opts.get("timeout", DEFAULT_TIMEOUT)
        c = Client(self.tier.url(i), **{**self._opts, "timeout": min(timeout, REACH_TIMEOUT)})
        c.timeout = timeout
        tm = c.tier_map
        n = min(len(tm.members), len(self.tier.members)) if tm is not None else 0
        if tm is None or tm.members[:n] != self.tier.members[:n] or c.tier_at != i:
            c.close(timeout=1.0)
            raise ValueError(f"tier member {i} ({self.tier.url(i)}) answers another tier "
                             "map: start every member with the same --tier")
        if self._accumulate is not None:
            c.accumulate(*self._accumulate)
        self.members[i] = c
        if tm.version > self.tier.version:
            self._take(tm)
        return c

    def member(self, i: int) -> Client:
        """Member ``i``'s client; one that did not answer before is connected now, or
        :class:`BrokerUnavailableError` says, within :data:`REACH_TIMEOUT`, that it still
        does not answer."""
        c = self.members[i]
        if c is not None:
            return c
        with self._lock:
            c = self.members[i]
            return c if c is not None else self._connect(i)

    def _live(self) -> list[Client]:
        return [c for c in self.members if c is not None]

    # -- routing ---------------------------------------------------------------------------
    def owner(self, name: str) -> Client:
        """The member client holding tensor or table ``name``."""
        return self.member(self.tier.owner(name))

    def _split(self, d: dict) -> dict[int, dict]:
        parts: dict[int, dict] = {}
        for name, v in d.items():
            parts.setdefault(self.tier.owner(name), {})[name] = v
        return parts

    # -- the Client calls --------------------------------------------------------------------
    def init(self, tensors: dict, optimizer=None, timeout: float | None = None,
             consistency: str | None = None, stale_policy: str = "refuse",
             scale_lr: bool = False) -> dict:
        if not isinstance(tensors, dict) or not tensors:
            raise ValueError("init takes a non-empty dict of name -> array or initializer")
        out: dict = {}
        for i, part in self._split(tensors).items():
            out.update(self.member(i).init(part, optimizer, timeout, consistency,
                                            stale_policy, scale_lr))
        return {n: out[n] for n in tensors}

    def push(self, grads: dict, codec: str | None = None, acks: int | str = 1,
             version: int | None = None, timeout: float | None = None) -> Future:
        if not isinstance(grads, dict) or not grads:
            raise ValueError("push takes a non-empty dict of name -> gradient array")
        self._follow()
        futs = [RoutedFuture(self, self._member_push(i, part, codec, acks, version, timeout),
                             timeout)
                for i, part in self._split(grads).items()]
        return futs[0] if len(futs) == 1 else JoinedFuture(futs)

    def pull(self, keys=None, min_version: int | None = None, timeout: float | None = None,
             out: dict | None = None) -> dict:
        if isinstance(keys, str):
            keys = [keys]
        if keys is None and out:
            keys = list(out)
        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict = {}
        self._follow()
        if keys is None:
            for i in range(len(self.members)):
                got.update(self.member(i).pull(None, min_version, self._left(deadline)))
            return got
        todo = list(keys)
        while todo:
            name = todo[0]
            i = self.tier.owner(name)
            names = [n for n in todo if self.tier.owner(n) == i]
            sub = {n: a for n, a in (out or {}).items() if n in names}
            since = self.tier.version
            try:
                got.update(self.member(i).pull(names, min_version, self._left(deadline),
                                               sub or None))
            except MovedError as e:         # moved since this client's map: follow it
                self._moved(since)
                self._wait_or_raise(deadline, e)
                continue
            except GradbusError as e:       # arriving at the member now holding them
                if e.code != Code.RECOVERING:
                    raise
                self._wait_or_raise(deadline, e)
                continue
            todo = [n for n in todo if n not in names]
        return {n: got[n] for n in keys}

    def version(self, name: str) -> int:
        return self._on_owner(name, lambda c: c.version(name))

    def gradient_buffer(self, name: str):
        return self._on_owner(name, lambda c: c.gradient_buffer(name))

    def init_table(self, name: str, *args, **kw):
        return self._on_owner(name, lambda c: c.init_table(name, *args, **kw))

    def pull_rows(self, name: str, *args, **kw):
        return self._on_owner(name, lambda c: c.pull_rows(name, *args, **kw))

    def push_rows(self, name: str, *args, **kw):
        return RoutedFuture(self, self._on_owner(name, lambda c: c.push_rows(name, *args, **kw)),
                            kw.get("timeout"))

    def accumulate(self, every: int = 1, threshold: float | None = None) -> None:
        with self._lock:
            for c in self._live():
                c.accumulate(every, threshold)
            self._accumulate = (every, threshold)

    @property
    def accumulating(self) -> bool:
        return self.members[self.first].accumulating

    @property
    def codec(self) -> str:
        return self.members[self.first].codec

    @property
    def url(self) -> str:
        """The member this client reached first (its ``gradbus.connect`` URL's)."""
        return self.members[self.first].url

    window = property(lambda self: self.members[self.first].window)
    window_bytes = property(lambda self: self.members[self.first].window_bytes)
    error_feedback = property(lambda self: self.members[self.first].error_feedback)

    def compression_stats(self) -> dict:
        """The members' :meth:`Client.compression_stats` together: bytes and keys summed,
        the residuals' norm over all of them."""
        parts = [c.compression_stats() for c in self._live()]
        out = {k: sum(p[k] for p in parts) for k in ("push_bytes", "push_raw_bytes",
                                                      "error_feedback_keys",
                                                      "accumulating_keys")}
        out["ratio"] = out["push_raw_bytes"] / out["push_bytes"] if out["push_bytes"] else None
        out["error_feedback_norm"] = math.sqrt(sum(p["error_feedback_norm"] ** 2 for p in parts))
        return out

    @property
    def cache_stats(self) -> dict:
        """The members' weights-cache counters, summed (:attr:`Client.cache_stats`)."""
        total: collections.Counter = collections.Counter()
        for c in self._live():
            total.update(c.cache_stats)
        return dict(total)

    @property
    def stats(self) -> collections.Counter:
        """The members' counters, summed."""
        total: collections.Counter = collections.Counter()
        for c in self._live():
            total.update(c.stats)
        return total

    @property
    def broker_alive(self) -> bool:
        """Every member connected and heard within its silence window."""
        return all(c is not None and c.broker_alive for c in self.members)

    def flush(self, timeout: float | None = None) -> None:
        """Every member's pushes acknowledged, those refused MOVED (a move) included: their
        copies are waited for until handed to their new member, and that member flushed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            started = self.reroutes.started
            self.reroutes.wait(deadline)
            for c in self._live():
                c.flush(self._left(deadline))
            if self.reroutes.started == started and not self.reroutes.busy:
                return

    def status(self, timeout: float | None = None) -> dict:
        """Every member's status map, in the tier's order: ``{"tier": ..., "members": [...]}``;
        a member that does not answer is ``{"error": why}``."""
        out = []
        for i in range(len(self.members)):
            try:
                out.append(self.member(i).status(timeout))
            except BrokerUnavailableError as e:
                out.append({"error": str(e)})
        return {"tier": {"version": self.tier.version, "members": self.tier.describe(),
                         "map": self.tier.to_wire()},
                "members": out}

    def close(self, timeout: float = 10.0) -> None:
        """Close every member client (each flushes first, up to ``timeout``; pushes refused
        MOVED are sent on to their new member first)."""
        try:
            self.flush(timeout)
        except (TimeoutError, GradbusError) as e:
            log.warning("closing the tier client: %s", e)
        for c in self._live():
            c.close(timeout)

    def __enter__(self) -> "TierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def member_statuses(st: dict) -> list[dict]:
    """The broker status maps in ``st``, what :meth:`Client.status` (one) or
    :meth:`TierClient.status` (one per member, a member that did not answer left out)
    returned."""
    if "tier" in st and isinstance(st.get("members"), list) and "counters" not in st:
        return [m for m in st["members"] if "error" not in m]
    return [st]


__all__ = ["TierClient", "JoinedFuture", "member_statuses"]
