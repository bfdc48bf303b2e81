"""The client of a broker tier (protocol section 24): one :class:`~.client.Client` per member,
each name's init, pushes, pulls and rows sent to the member that holds it.

The tier's map (WELCOME's ``tier``) gives every tensor and table one member, by the home
partition of its name (:mod:`gradbus.codecs.tier`). A push of tensors held by several members
goes as one push to each, in parallel, under one Future that resolves when every part is
acknowledged (or fails with the first part that failed); a push of one member's tensors is
that member's push, nothing added. Each member client keeps its own credit window, duplicate
window and weights, so every guarantee of one broker holds per member.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent import futures
from concurrent.futures import Future

from gradbus.codecs.tier import TierMap

from .client import Client


class JoinedFuture(Future):
    """Resolved once every part is: with the parts' results in order, or with the first
    exception a part raised. ``result()`` waits on each part in turn, so a part that reads its
    answer off a local link in the caller's thread still does."""

    def __init__(self, parts: list):
        super().__init__()
        self.parts = parts
        self._left = len(parts)
        self._mu = threading.Lock()
        for f in parts:
            f.add_done_callback(self._part_done)

    def _part_done(self, f: Future) -> None:
        with self._mu:
            self._left -= 1
            if self.done():
                return
            err = f.exception()
            if err is not None:
                self.set_exception(err)
            elif self._left == 0:
                self.set_result({"kind": "ACK", "parts": [p.result() for p in self.parts]})

    def result(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self.parts:
            try:
                f.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except (TimeoutError, futures.TimeoutError):
                raise
            except BaseException:
                break       # this Future carries it
        return super().result(None if deadline is None
                              else max(0.0, deadline - time.monotonic()))


class TierClient:
    """A connection to every member of a broker tier; the same calls as :class:`Client`.
    ``gradbus.connect`` returns one when the broker it reaches is a tier member."""

    def __init__(self, first: Client, options: dict | None = None):
        tm = first.tier_map
        if tm is None:
            raise ValueError("not a tier member's client: its WELCOME named no tier")
        self.tier: TierMap = tm
        opts = dict(options or {})
        opts["client_id"] = first.client_id      # one worker, the same id at every member
        self.members: list[Client | None] = [None] * len(tm.members)
        self.members[first.tier_at] = first
        try:
            for i in range(len(tm.members)):
                if self.members[i] is None:
                    c = self.members[i] = Client(tm.url(i), **opts)
                    if c.tier_map is None or c.tier_map.members != tm.members \
                            or c.tier_at != i:
                        raise ValueError(f"tier member {i} ({tm.url(i)}) answers another "
                                         "tier map: start every member with the same --tier")
        except BaseException:
            for c in self.members:
                if c is not None:
                    c.close(timeout=1.0)
            raise
        self.client_id = first.client_id

    # -- routing ---------------------------------------------------------------------------
    def owner(self, name: str) -> Client:
        """The member client holding tensor or table ``name``."""
        return self.members[self.tier.owner(name)]

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
            out.update(self.members[i].init(part, optimizer, timeout, consistency,
                                            stale_policy, scale_lr))
        return {n: out[n] for n in tensors}

    def push(self, grads: dict, codec: str | None = None, acks: int | str = 1,
             version: int | None = None, timeout: float | None = None) -> Future:
        if not isinstance(grads, dict) or not grads:
            raise ValueError("push takes a non-empty dict of name -> gradient array")
        parts = self._split(grads)
        if len(parts) == 1:
            (i, part), = parts.items()
            return self.members[i].push(part, codec, acks, version, timeout)
        return JoinedFuture([self.members[i].push(part, codec, acks, version, timeout)
                             for i, part in parts.items()])

    def pull(self, keys=None, min_version: int | None = None, timeout: float | None = None,
             out: dict | None = None) -> dict:
        if isinstance(keys, str):
            keys = [keys]
        if keys is None and out:
            keys = list(out)
        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict = {}
        if keys is None:
            groups = {i: None for i in range(len(self.members))}
        else:
            groups = {i: list(p) for i, p in self._split(dict.fromkeys(keys)).items()}
        for i, names in groups.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            sub = {n: a for n, a in (out or {}).items() if n in names} if names else None
            got.update(self.members[i].pull(names, min_version, left, sub or None))
        return got if keys is None else {n: got[n] for n in keys}

    def version(self, name: str) -> int:
        return self.owner(name).version(name)

    def gradient_buffer(self, name: str):
        return self.owner(name).gradient_buffer(name)

    def init_table(self, name: str, *args, **kw):
        return self.owner(name).init_table(name, *args, **kw)

    def pull_rows(self, name: str, *args, **kw):
        return self.owner(name).pull_rows(name, *args, **kw)

    def push_rows(self, name: str, *args, **kw):
        return self.owner(name).push_rows(name, *args, **kw)

    def accumulate(self, every: int = 1, threshold: float | None = None) -> None:
        for c in self.members:
            c.accumulate(every, threshold)

    @property
    def accumulating(self) -> bool:
        return self.members[0].accumulating

    @property
    def codec(self) -> str:
        return self.members[0].codec

    @property
    def stats(self) -> collections.Counter:
        """The members' counters, summed."""
        total: collections.Counter = collections.Counter()
        for c in self.members:
            total.update(c.stats)
        return total

    def broker_alive(self) -> bool:
        return all(c.broker_alive() for c in self.members)

    def flush(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for c in self.members:
            c.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def status(self, timeout: float | None = None) -> dict:
        """Every member's status map, in the tier's order: ``{"tier": ..., "members": [...]}``."""
        return {"tier": {"version": self.tier.version, "members": self.tier.describe()},
                "members": [c.status(timeout) for c in self.members]}

    def close(self, timeout: float = 10.0) -> None:
        """Close every member client (each flushes first, up to ``timeout``)."""
        for c in self.members:
            c.close(timeout)

    def __enter__(self) -> "TierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["TierClient", "JoinedFuture"]
