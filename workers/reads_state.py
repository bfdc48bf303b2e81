"""The reads the client's agent has asked for and not had whole yet: snapshots (a waiter's,
or its own re-snapshots after a gap) and table rows, as parts arrive from each shard, their
retries after an error, and a read asked again, with frames, after its reply was torn in a
shard's reply area. Part of :class:`~.agent_state.AgentState` (``agent.reads``), which it reads
its futures, output, cache and counters from; no socket, the agent's clock.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError, error_from

from .actions import Send

log = logging.getLogger("gradbus.client")

SNAPSHOT_RETRY = 1.0         # seconds before a failed re-snapshot is tried again, doubling ...
SNAPSHOT_RETRY_MAX = 30.0    # ... up to this


class ReadState:
    def __init__(self, agent):
        self.a = agent                              # the AgentState this is part of
        self.snap_parts: dict[int, list] = {}       # req -> [replies...]
        self.snap_keys: dict[int, list] = {}        # req -> the keys it asked for
        self.row_parts: dict[int, dict] = {}        # req -> rows, versions, missing so far
        self.internal: dict[int, list[str]] = {}    # req -> keys of a re-snapshot with no waiter
        self.retries: list = []                     # (when, keys) re-snapshots to try again
        self.retry_count: dict[str, int] = {}       # first key -> failed attempts in a row

    def snapshot(self, keys: list[str], fut: Future | None, frames: bool = False) -> None:
        """Ask for ``keys``; ``frames``: with frames only (asked again after a torn reply)."""
        a = self.a
        req = a.next_id()
        if fut is not None:
            a.req_futures[req] = fut
        else:
            self.internal[req] = keys
        self.snap_parts[req] = []
        self.snap_keys[req] = keys
        shm = {} if a.shm is None else {"shm": not frames}
        a.out.append(Send([wire.pack(wire.SNAPSHOT, req=req, keys=keys, **shm)]))

    def rows(self, req: int, frames: list) -> None:
        """A table read sent (its parts gathered under ``req``)."""
        self.row_parts[req] = {"rows": [], "tv": [], "missing": [], "ask": frames[0]}

    def due(self, now: float) -> None:
        """Re-snapshots whose retry time came."""
        if self.retries and self.retries[0][0] <= now:
            _, keys = self.retries.pop(0)
            self.snapshot(keys, None)

    def answered(self, kind: str, h) -> bool:
        """A reply or ERROR to request ``h.req``: its read parts dropped, a failed re-snapshot
        scheduled again. True when it was a torn read asked again (nothing else to do)."""
        req = h.req
        if kind == wire.ERROR and h.code == Code.SHM_TORN.value and self.reask(req):
            return True
        self.snap_parts.pop(req, None)
        self.snap_keys.pop(req, None)
        self.row_parts.pop(req, None)
        keys = self.internal.pop(req, None)
        if keys is not None and kind == wire.ERROR:
            # a re-snapshot failed (e.g. the shard is down): try again later
            n = self.retry_count.get(keys[0], 0) + 1 if keys else 1
            if keys:
                self.retry_count[keys[0]] = n
            delay = min(SNAPSHOT_RETRY * 2 ** (n - 1), SNAPSHOT_RETRY_MAX)
            self.retries.append((self.a.clock() + delay, keys))
            self.retries.sort(key=lambda r: r[0])
        return False

    def resolved(self, h, frames) -> bool:
        """A reply's tensors that reference a shard's reply area copied into ``frames``; False
        when one was rewritten (or its segment is gone) before it was read whole."""
        if not wire.has_refs(h.t):
            return True
        try:      # (refs to a client that reads no shared memory: asked again, with frames)
            ok = self.a.shm is not None and self.a.shm.resolve(h, frames)
        except WireError as e:
            log.warning("shared memory: %s", e)
            ok = False
        if ok:
            self.a.stats["shm_replies"] += 1
        else:
            self.a.stats["shm_torn_replies"] += 1
        return ok

    def in_flight(self) -> list[int]:
        """The reads asked for and not answered whole."""
        return [*self.snap_parts, *self.row_parts]

    def reask(self, req: int, frames: bool = True) -> bool:
        """A read whose reply (or one of its parts) was torn (``frames``: asked with frames
        only), or lost with a broker that restarted: asked again under a new id, for the same
        waiter; the parts already in are dropped (late ones too). False when ``req`` is no
        read waiting."""
        fut = self.a.req_futures.pop(req, None)
        if req in self.snap_parts:
            del self.snap_parts[req]
            self.internal.pop(req, None)       # (a waiter's or not, as it was)
            self.snapshot(self.snap_keys.pop(req), fut, frames=frames)
            return True
        rows = self.row_parts.pop(req, None)
        if rows is None:
            if fut is not None:
                self.a.req_futures[req] = fut
            return False
        new = self.a.next_id()
        ask = wire.with_fields(rows["ask"], req=new, **({"shm": False} if frames else {}))
        self.row_parts[new] = {"rows": [], "tv": [], "missing": [], "ask": ask}
        if fut is not None:
            self.a.req_futures[new] = fut
        self.a.out.append(Send([ask]))
        return True

    def on_snapshot(self, h, frames) -> None:
        req = h.req
        got = self.snap_parts.get(req)
        if got is None:
            return   # a late reply to a request already answered or failed: nothing to decode
        if not self.resolved(h, frames):
            self.reask(req)
            return
        blocks = self.a.decode_blocks(h, frames)
        got.append((dict(h.parts), blocks, h.missing))
        if len(got) < h.of:
            return
        del self.snap_parts[req]
        del self.snap_keys[req]
        keys = self.internal.pop(req, None)
        if keys:
            self.retry_count.pop(keys[0], None)
        missing = [m for _, _, ms in got for m in ms]
        with self.a.cond:
            again = set()
            for parts, blocks, _ in got:
                again.update(self.a.cache.on_snapshot(parts, blocks))
            self.a.cond.notify_all()
        for p in again:
            self.snapshot(self.a.cache.resync_keys(p), None)
        self.a.follows.went_live()
        fut = self.a.req_futures.pop(req, None)
        if fut is not None and not fut.done():
            if missing:
                fut.set_exception(error_from(Code.UNKNOWN_KEY.value,
                                             f"not held by any shard: {missing[:5]}"))
            else:
                fut.set_result(None)

    def on_rows(self, h, frames) -> None:
        """One shard's part of a table read; the Future resolves once every part is in."""
        req = h.req
        got = self.row_parts.get(req)
        if got is None:
            return
        if not self.resolved(h, frames):
            self.reask(req)
            return
        mtb = self.a.max_tensor_bytes
        descs = h.descs(frames, mtb)
        # rows copied out of a reply area under matching stamps are not hashed again
        got["rows"].extend((d, wire.decode_tensor(d, f, mtb, verify=d.ref is None))
                           for d, f in zip(descs, frames))
        got["tv"].append(-1 if h.tv is None else h.tv)   # one per reply
        got["missing"] += h.missing
        if len(got["tv"]) < h.of:
            return
        del self.row_parts[req]
        fut = self.a.req_futures.pop(req, None)
        if fut is not None and not fut.done():
            if got["missing"]:
                fut.set_exception(error_from(Code.UNKNOWN_KEY.value, f"partitions "
                                             f"{got['missing'][:8]} of the table are not held"))
            else:     # the rows, and the table's version when the broker sent the read
                fut.set_result((got["rows"], min(got["tv"])))

    def clear(self) -> None:
        for waiting in (self.snap_parts, self.snap_keys, self.row_parts, self.internal):
            waiting.clear()

    def validate_state(self) -> None:
        assert self.row_parts.keys() <= self.a.req_futures.keys(), "rows read without a waiter"
        assert self.snap_keys.keys() == self.snap_parts.keys(), "snapshot keys not kept"
        assert not (self.internal.keys() & self.a.req_futures.keys())
        assert [r[0] for r in self.retries] == sorted(r[0] for r in self.retries)
