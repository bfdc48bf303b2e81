"""The client's push calls (push, gradient buffers, local accumulation), mixed into
:class:`~gradbus.workers.client.Client`: gradients are encoded by the client's
:class:`~.pipeline.PushPipeline`, take credit from its window and go to the agent thread, their
bytes through the push ring where the client has shared memory (:mod:`.shm_io`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from gradbus.codecs import device, hops, wire
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.partition import partition_of

from .commands import Forward, SendMessage
from .reader import ReadingFuture


class PushMethods:
    """Needs from the class it is mixed into: ``_layouts``, ``_check_open``, ``_lock``,
    ``_ids``, ``agent``, ``state``, ``credit``, ``cache``, ``versions``, ``pipeline``,
    ``shm``, ``codec``, ``timeout``, ``stats``, ``partitions``."""

    def push(self, grads: dict, codec: str | None = None, acks: int | str = 1,
             version: int | None = None, timeout: float | None = None) -> Future:
        """Send gradients; returns a Future at once (resolved on ack, or at send for acks=0).

        The arrays are encoded (or copied) before this returns: the caller may reuse them.
        Blocks while ``window`` pushes are unacknowledged; after ``timeout`` seconds raises
        :class:`BackPressureError`. With a lossy ``codec`` the part of each gradient that was
        not sent is kept per key and added to the next push (error feedback; by default not for
        plain bf16, see the ``error_feedback`` argument of :class:`Client`). With local
        accumulation on (:meth:`accumulate`), gradients are summed here and sent only when a
        key is due; the Future then covers the keys sent by this call (None if none were).
        """
        t_in = time.monotonic_ns() if hops.ON else None
        if acks == "all":
            acks = wire.ACKS_ALL
        elif acks not in (0, 1):
            raise ValueError(f"acks must be 0, 1 or 'all', not {acks!r}")
        chain = codec or self.codec
        tcodec.parse_chain(chain)
        if not isinstance(grads, dict) or not grads:
            raise ValueError("push takes a non-empty dict of name -> gradient array")
        if self.state.async_errors:
            raise self.state.async_errors.pop(0)
        layouts = self._layouts(list(grads))
        flats = {}
        accumulating = self.pipeline.accumulating
        for name, g in grads.items():
            layout = layouts[name]
            if device.is_device(g) and not accumulating:
                # a GPU gradient stays on the GPU: it is encoded there (codecs/device.py) and
                # only the compressed bytes are copied to the host
                if g.shape != layout.shape and g.size != layout.size:
                    raise ValueError(f"{name}: gradient shape {g.shape} does not match "
                                     f"{layout.shape}")
                flats[name] = g.astype(layout.dtype, copy=False).reshape(-1)
                continue
            arr = device.to_host(g) if device.is_device(g) else np.asarray(g)
            if arr.shape != layout.shape and arr.size != layout.size:
                raise ValueError(f"{name}: gradient shape {arr.shape} does not match "
                                 f"{layout.shape}")
            flats[name] = arr.astype(layout.dtype, copy=False).reshape(-1)
        own = self.shm.in_place(grads, flats, chain, accumulating) if self.shm else {}
        cache = self.cache
        version = self.versions.push_version(
            list(grads), version, lambda n: cache.version(n) if cache.tracked(n) else 0)
        if accumulating:
            flats, counts = self.pipeline.add(flats, chain, acks, self.stats)
            if not flats:
                fut: Future = Future()
                fut.set_result(None)
                return fut
            try:
                return self._send_push(flats, layouts, chain, acks, version, timeout, counts)
            except BaseException:
                self.pipeline.hold_back(flats, counts, chain, acks)   # not sent: keep the sums
                raise
        for name in own:
            grads[name].flags.writeable = False     # its bytes are the push's from now on
        try:
            return self._send_push(flats, layouts, chain, acks, version, timeout, own=own,
                                   t_in=t_in)
        except BaseException:
            for name in own:
                if self.shm.reserved(flats[name]) is not None:   # not taken: still the caller's
                    grads[name].flags.writeable = True
            raise

    def gradient_buffer(self, name: str) -> np.ndarray:
        """A writable array of tensor ``name``'s shape and dtype to compute the next gradient
        into, for a push that copies nothing.

        Where this client pushes through shared memory, the array lives in its push ring: a
        raw push of it sends references to where it is. Its contents start undefined (write
        every element). Once pushed it is read-only and no longer the caller's (the ring reuses
        the memory after every replica applied it): take a new one for each step. Pushed with
        another codec or while accumulating, or on a client without shared memory (or with a
        full ring), it is an ordinary array, encoded or copied as any other; one dropped
        without a push gives its memory back."""
        self._check_open()
        layout = self._layouts([name])[name]
        buf = self.shm.gradient_buffer(layout.shape, layout.dtype) if self.shm is not None \
            else None
        if buf is None:
            return np.empty(layout.shape, layout.dtype)
        self.stats["gradient_buffers"] += 1
        return buf

    def _send_push(self, flats: dict, layouts: dict, chain: str, acks: int,
                   version: int | None, timeout: float | None,
                   counts: dict | None = None, own: dict | None = None,
                   t_in: int | None = None) -> Future:
        descs, bufs, residuals = self.pipeline.encode(flats, layouts, chain, counts,
                                                      detach=self.shm is None)
        extra = {"ver": int(version)} if version is not None else {}
        fut = self._submit_push(descs, bufs, acks, timeout, extra, own, t_in)
        self.pipeline.commit(residuals)    # only now is the push really on its way
        self.stats["push_raw_bytes"] += sum(f.nbytes for f in flats.values())
        return fut

    def _submit_push(self, descs: list, bufs: list, acks: int, timeout: float | None,
                     extra: dict, own: dict | None = None, t_in: int | None = None) -> Future:
        """Take credit for an encoded push and hand it to the agent; returns its Future.
        ``own``: gradient buffers it sends in place (name -> reservation)."""
        nbytes = sum(d["n"] for d in descs)
        if self.credit.full(nbytes):
            self.agent.reader.recall()      # the answers that free credit: the agent's to read
        msg = self.credit.take(nbytes, self.timeout if timeout is None else timeout,
                               self._ids.__next__, self._check_open, self.stats)
        if t_in is not None:
            hops.stamp("push", msg, t_in)
        # its waiter reads the answer off the local link itself (workers/reader.py)
        fut: Future = ReadingFuture(self.agent.reader) if acks else Future()
        # conflated delivery: the push's own weights come back for these partitions
        parts = frozenset(partition_of(d["k"], self.partitions) for d in descs
                          if "ids" not in d) if self.shm is None else frozenset()
        try:
            with self._lock:
                self._check_open()
                if self.shm is not None:
                    bufs = self.shm.place(msg, descs, bufs, list(own.values()) if own else ())
                frames = [wire.pack(wire.PUSH, descs, msg=msg, acks=acks, **extra), *bufs]
                agent = self.agent
                if agent.link is not None:
                    # written here, on the local link: the agent only notes it (not woken)
                    agent.note(SendMessage(msg, frames, fut if acks else None, sent=True,
                                           parts=parts))
                    if hops.ON:     # before the write: the broker may stamp its hop first
                        hops.stamp("agent_send", msg)
                    if not agent.direct(frames):
                        agent.submit(Forward(frames))
                else:
                    agent.submit(SendMessage(msg, frames, fut if acks else None,
                                             parts=parts))
        except BaseException:
            self.credit.release((msg,))
            if self.shm is not None:
                self.shm.free((msg,))
            raise
        self.stats["pushes"] += 1
        self.stats["push_bytes"] += nbytes
        if acks == 0:
            fut.set_result(None)
        return fut

    # -- local accumulation ---------------------------------------------------------------
    def accumulate(self, every: int = 1, threshold: float | None = None) -> None:
        """Sum gradients locally and push a key only when it is due: after ``every`` pushes,
        or (with ``threshold``) once the summed gradient's norm reaches ``threshold`` times the
        norm of the key's current weights (the "significantly modified" filter). What is held
        back is sent by :meth:`flush` and :meth:`close`, never dropped. ``every=1`` and no
        threshold turns accumulation off."""
        pending = self.pipeline.pending()
        self.pipeline.configure(every, threshold)   # raises on bad settings, changing nothing
        if pending:
            self._flush_accumulated()

    @property
    def accumulating(self) -> bool:
        """Whether local accumulation is on (:meth:`accumulate` with ``every > 1`` or a
        ``threshold``): gradients are then summed on the host, so a GPU gradient is copied
        there whole rather than encoded where it lives."""
        return self.pipeline.accumulating

    def _flush_accumulated(self) -> list[Future]:
        futs = []
        for (chain, acks), items in self.pipeline.take_all().items():
            flats = {n: f for n, (f, _) in items.items()}
            futs.append(self._send_push(flats, self._layouts(list(flats)), chain, acks, None,
                                        None, {n: c for n, (_, c) in items.items()}))
        return futs

    def compression_stats(self) -> dict:
        """Bytes pushed on the wire against their decoded size, and the error-feedback state."""
        raw, wire_b = self.stats["push_raw_bytes"], self.stats["push_bytes"]
        return {"push_bytes": wire_b, "push_raw_bytes": raw,
                "ratio": (raw / wire_b) if wire_b else None, **self.pipeline.stats()}
