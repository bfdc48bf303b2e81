"""How a tier client follows a move (protocol 24.4): the newest map a member named, and a
push a member refused with MOVED sent again, unchanged, to the member that holds its names
now. A push refused so keeps its place in no window: it takes credit again where it goes."""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from concurrent.futures import Future

from gradbus.codecs.errors import BrokerUnavailableError, Code, GradbusError, MovedError
from gradbus.codecs.tier import TierMap, name_of

log = logging.getLogger("gradbus.client")
MAX_HOPS = 8       # a push moved more often than this fails with the last MOVED


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


def _nothing(_f) -> None:
    pass


class Reroutes:
    """Pushes refused MOVED whose copy is not yet handed to the member holding their names:
    the tier client's ``flush`` waits for them, then flushes that member too."""

    def __init__(self):
        self.cv = threading.Condition()
        self.busy = 0
        self.started = 0

    def begin(self) -> None:
        with self.cv:
            self.busy += 1
            self.started += 1

    def end(self) -> None:
        with self.cv:
            self.busy -= 1
            self.cv.notify_all()

    def wait(self, deadline: float | None) -> None:
        with self.cv:
            while self.busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self.busy} pushes refused MOVED not yet sent on")
                self.cv.wait(left)


class RoutedFuture(Future):
    """A member push's Future that, refused with MOVED, resolves with the same push sent to
    the member holding its names now. ``result()`` waits on the member's Future first, so
    one that reads its answer off a local link in the caller's thread still does."""

    def __init__(self, tier, inner: Future, timeout, hops: int = 0):
        super().__init__()
        self._tier, self._timeout, self._hops = tier, timeout, hops
        self._since = tier.tier.version      # the map this push was routed by
        self._inner = inner
        # Future's own add_done_callback: a local link's reader is not called back to the
        # I/O thread for it (a caller waiting in result() reads its answer itself); one
        # waiting only through a callback of this Future asks for that (add_done_callback)
        Future.add_done_callback(inner, self._done)

    def add_done_callback(self, fn) -> None:
        super().add_done_callback(fn)
        if not self.done():
            self._inner.add_done_callback(_nothing)    # the answer read without a caller

    def _done(self, f: Future) -> None:
        err = f.exception()
        if err is None:
            self.set_result(f.result())
            return
        moved = getattr(err, "moved_push", None)
        if not isinstance(err, MovedError) or moved is None or self._hops >= MAX_HOPS:
            self.set_exception(err)
            return
        # sent again from a thread of its own: the member's I/O thread must not wait for
        # another member's credit; flush() waits until it is handed to its member
        self._tier.reroutes.begin()
        threading.Thread(target=self._again, args=(moved,), daemon=True,
                         name="gradbus-tier-route").start()

    def _again(self, moved: dict) -> None:
        try:
            fut = self._tier.send_moved(moved, self._timeout, self._hops + 1, self._since)
        except BaseException as e:   # noqa: BLE001 - the caller's Future carries it
            self.set_exception(e)
            return
        finally:
            self._tier.reroutes.end()
        self._inner = fut
        fut.add_done_callback(lambda f: self.set_exception(f.exception())
                              if f.exception() is not None else self.set_result(f.result()))

    def result(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._inner.result(timeout)
        except (TimeoutError, futures.TimeoutError):
            raise
        except BaseException:   # noqa: BLE001 - this Future carries it, or a resend's
            pass
        return super().result(None if deadline is None
                              else max(0.0, deadline - time.monotonic()))


class FollowsMoves:
    """The tier client's side of a move, mixed into :class:`~.tier_client.TierClient`:
    needs its ``tier``, ``members``, ``first``, ``member()`` and ``_lock``."""

    # -- following moves (protocol 24.4) -----------------------------------------------------
    def _take(self, tm: TierMap) -> None:
        """A newer map: names are sent where it says from now on (members it adds are
        connected when first needed)."""
        if tm.version <= self.tier.version:
            return
        if tm.members[:len(self.tier.members)] != self.tier.members:
            log.warning("tier map v%d drops or reorders members: not followed", tm.version)
            return
        self.members += [None] * (len(tm.members) - len(self.members))
        self.tier = tm
        self.maps_followed += 1

    def _follow(self) -> None:
        """Take the newest map a member's TABLE named, if newer than this client's."""
        v = self.tier.version
        for c in self.members:
            w = c.cache.tier if c is not None else None
            if w is not None and w.get("v", 0) > v:
                try:
                    self._take(TierMap.from_wire(w))
                except ValueError:
                    continue
                v = self.tier.version

    def refresh(self, i: int | None = None) -> TierMap:
        """Ask member ``i`` (every member: None) for its map and take it if newer."""
        for j in (range(len(self.members)) if i is None else (i,)):
            try:
                st = self.member(j).status()
            except BrokerUnavailableError:
                continue
            w = (st.get("tier") or {}).get("map")
            if w is not None:
                self._take(TierMap.from_wire(w))
        return self.tier

    def _moved(self, since: int) -> None:
        """After a MOVED of a call routed by map ``since``: a newer map a member's TABLE
        named, else the members are asked (the refusing member's TABLE may come later)."""
        self._follow()
        if self.tier.version <= since:
            self.refresh()

    def send_moved(self, moved: dict, timeout, hops: int, since: int) -> Future:
        """A push refused with MOVED (routed by map ``since``), sent again to the members
        holding its names now."""
        self._moved(since)
        parts = split_moved(moved, self.tier.owner)
        self.stats_moved += 1
        futs = [RoutedFuture(self, self.member(i)._submit_push(
                    descs, bufs, moved["acks"], timeout, dict(moved["extra"])), timeout, hops)
                for i, (descs, bufs) in parts.items()]
        return futs[0] if len(futs) == 1 else JoinedFuture(futs)

    def _member_push(self, i: int, part: dict, codec, acks, version, timeout) -> Future:
        """Member ``i``'s push; a MOVED an earlier acks=0 push left to raise is sent on
        where its names went first."""
        while True:
            since = self.tier.version
            try:
                return self.member(i).push(part, codec, acks, version, timeout)
            except MovedError as e:
                moved = getattr(e, "moved_push", None)
                if moved is None:
                    raise
                self.send_moved(moved, timeout, 1, since)

    @staticmethod
    def _left(deadline):
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    @staticmethod
    def _wait_or_raise(deadline, e) -> None:
        if deadline is not None and time.monotonic() + 0.1 > deadline:
            raise e
        time.sleep(0.1)

    def _on_owner(self, name: str, call):
        """``call`` on the client of the member holding ``name``; one moved since this
        client's map is followed, one arriving at its member is asked again shortly."""
        self._follow()
        deadline = time.monotonic() + self.members[self.first].timeout
        while True:
            since = self.tier.version
            try:
                return call(self.owner(name))
            except MovedError as e:
                self._moved(since)
                self._wait_or_raise(deadline, e)
            except GradbusError as e:
                if e.code != Code.RECOVERING:
                    raise
                self._wait_or_raise(deadline, e)



def split_moved(moved: dict, owner) -> dict[int, tuple[list, list]]:
    """A moved push's descriptors and bytes by the member ``owner(name)`` gives them now."""
    out: dict[int, tuple[list, list]] = {}
    for d, b in zip(moved["descs"], moved["bufs"]):
        descs, bufs = out.setdefault(owner(name_of(d["k"])), ([], []))
        descs.append(d)
        bufs.append(b)
    return out
