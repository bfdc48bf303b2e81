"""How a CuPy shard's bytes reach the GPU and come back without an allocation per push: the
host memory they come from and go to is pinned once, and the device memory they land in is
reused batch after batch. The host waits twice per batch part: for its uploads before the shard
replies (a ring's bytes are read in place, and the reply gives them back to their client), and
for a primary's copies into the board before their versions are published.

* :class:`HostPins`: host ranges registered with the CUDA driver (``cudaHostRegister``) once:
  the clients' push rings a shard maps (read-only), its weights board. A copy from or to a
  registered range is a DMA on a stream, asynchronous to the host; from anywhere else (a ZeroMQ
  frame) the bytes are first copied into a pinned slot of the shard's own.
* :class:`DeviceTransfers`: a batch's coded gradients uploaded on their own non-blocking stream
  into device slots (kept and reused: grown only when a batch needs more than any before), the
  compute stream made to wait for them on an event; weights copied back on another stream
  straight into the board, and published once that copy's event completed.

Only a CuPy backend makes these (:class:`gradbus.shards.backend.CupyBackend`); the numpy path
never sees them.
"""
from __future__ import annotations

import bisect
import collections
import logging
import os

import numpy as np

log = logging.getLogger("gradbus.shard")

REGISTER_READ_ONLY = 8      # cudaHostRegisterReadOnly: a peer's segment is mapped read-only
REGISTER_DEFAULT = 0

_forked = False


def _mark_forked() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_mark_forked)


def forked() -> bool:
    """Whether this process was forked from one that may have started CUDA: a CUDA context
    does not survive a fork, so shards are spawned (a fresh interpreter), never forked."""
    return _forked


def _address(buf) -> tuple[int, int]:
    a = np.frombuffer(buf, np.uint8)
    return a.ctypes.data, a.nbytes


class HostPins:
    """Host ranges registered with the driver, each once (by its start address)."""

    def __init__(self, cupy):
        self.rt = cupy.cuda.runtime
        self.starts: list[int] = []        # sorted
        self.ends: dict[int, int] = {}
        self.stats = collections.Counter()

    def pin(self, buf, read_only: bool = False) -> bool:
        """Register ``buf``'s memory (a memoryview or array of a mapping); False, logged once,
        where the driver refuses (the copies from it are staged then)."""
        ptr, n = _address(buf)
        if ptr in self.ends or not n:
            return ptr in self.ends
        try:
            self.rt.hostRegister(ptr, n, REGISTER_READ_ONLY if read_only else REGISTER_DEFAULT)
        except Exception as e:       # the driver's error: no pinning, the copies are staged
            if not self.stats["pin_refused"]:
                log.warning("could not pin %d bytes of host memory for the GPU: %s", n, e)
            self.stats["pin_refused"] += 1
            return False
        bisect.insort(self.starts, ptr)
        self.ends[ptr] = ptr + n
        self.stats["pinned"] += 1
        return True

    def unpin(self, buf) -> None:
        """Unregister ``buf``'s memory (before it is unmapped), if it was registered."""
        ptr, _ = _address(buf)
        if self.ends.pop(ptr, None) is None:
            return
        self.starts.remove(ptr)
        try:
            self.rt.hostUnregister(ptr)
        except Exception as e:
            log.warning("could not unpin host memory: %s", e)

    def holds(self, a: np.ndarray) -> bool:
        """Whether all of ``a``'s bytes lie in one registered range."""
        ptr = a.ctypes.data
        i = bisect.bisect_right(self.starts, ptr) - 1
        return i >= 0 and ptr + a.nbytes <= self.ends[self.starts[i]]

    def close(self) -> None:
        for ptr in list(self.starts):
            try:
                self.rt.hostUnregister(ptr)
            except Exception:
                pass
        self.starts.clear()
        self.ends.clear()


class DeviceTransfers:
    """A shard's uploads into reused device slots and downloads into pinned host memory."""

    def __init__(self, cupy, pins: HostPins):
        self.cp = cupy
        self.pins = pins
        self.up = cupy.cuda.Stream(non_blocking=True)
        self.down = cupy.cuda.Stream(non_blocking=True)
        self.dev: list = []          # device slots (uint8), in the order a batch takes them
        self.host: list = []         # pinned host slots, where a pageable source is staged
        self.used = [0, 0]           # device and host slots taken by this batch
        self.last_up = None          # the event of the last upload (the pinned slots' reuse)
        self.stats = collections.Counter()

    def begin(self) -> None:
        """A batch starts: its uploads reuse the last batch's slots, so they wait for what was
        queued on the compute stream so far (that batch's steps read them); the staging slots
        are free (the last batch's :meth:`end` waited for the copies out of them)."""
        if forked():
            raise RuntimeError("a CUDA backend in a forked process: shards are spawned")
        self.used = [0, 0]
        self.up.wait_event(self.cp.cuda.get_current_stream().record())

    def end(self) -> None:
        """The batch's uploads done (the host waits for its last one): the memory they were
        read from may be given back (a ring slot, to its client)."""
        if self.last_up is not None:
            self.last_up.synchronize()

    def _take(self, which: int, n: int):
        """This batch's next device (0) or pinned host (1) slot, of at least ``n`` bytes."""
        slots, i = (self.dev, self.host)[which], self.used[which]
        self.used[which] += 1
        if i == len(slots):
            slots.append(None)
        if slots[i] is None or slots[i].nbytes < n:
            m = max(n, 256)
            slots[i] = self.cp.empty(m, np.uint8) if which == 0 else self._pinned(m)
            self.stats["slots_grown"] += 1
        return slots[i]

    def upload(self, a: np.ndarray):
        """``a`` (a host array, C-contiguous) as a device array in this batch's next slot, its
        copy queued on the upload stream and the compute stream made to wait for it."""
        a = np.ascontiguousarray(a)
        n = a.nbytes
        dev = self._take(0, n)[:n]
        src = a.reshape(-1).view(np.uint8)
        if self.pins.holds(a):
            self.stats["uploads_pinned"] += 1
        else:                  # pageable (a frame): through a pinned slot of the shard's own
            host = self._take(1, n)[:n]
            np.copyto(host, src)
            src = host
            self.stats["uploads_staged"] += 1
        dev.set(src, stream=self.up)
        self.last_up = self.up.record()
        self.cp.cuda.get_current_stream().wait_event(self.last_up)
        return dev.view(a.dtype)

    def _pinned(self, n: int) -> np.ndarray:
        """``n`` bytes of page-locked host memory of the driver's own (cudaHostAlloc)."""
        self.stats["pinned_slots"] += 1
        return np.frombuffer(self.cp.cuda.alloc_pinned_memory(n), np.uint8, n)

    def scratch(self, n: int, dtype):
        """A device array of ``n`` values in this batch's next slot (a decoder's output)."""
        dt = np.dtype(dtype)
        return self._take(0, n * dt.itemsize)[:n * dt.itemsize].view(dt)

    def download(self, a, out: np.ndarray):
        """Queue the copy of device array ``a`` into host array ``out`` on the download
        stream, after what the compute stream has queued (the steps that wrote ``a``); returns
        its event. ``out`` is best pinned (the board is): else the copy waits on the host."""
        self.down.wait_event(self.cp.cuda.get_current_stream().record())
        if not self.pins.holds(out):
            self.stats["downloads_pageable"] += 1
        a.get(stream=self.down, out=out, blocking=False)
        return self.down.record()
