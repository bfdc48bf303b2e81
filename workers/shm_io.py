"""The client's side of shared memory: its push ring and its reads of shards' weights boards.

A client takes up the broker's offer (WELCOME ``shm``) when it can open the broker's probe
segment (:func:`gradbus.codecs.shm.accept`); then a push's encoded tensors are copied into
slots of its ring and the PUSH carries references, each slot held until the broker's FREE for
that push; the partitions it follows are read on the ``r`` topics, whose UPDATEs may reference
shards' boards. A ring with no room for a push sends that push as frames, as a client without
shared memory does.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from gradbus.codecs import shm, wire
from gradbus.codecs import tensor as tcodec

from .cache import BoardBlock

RING_SLACK = 1.5     # ring bytes per byte of credit window: slots wait for FREE after the ACK


class ClientShm:
    def __init__(self, cluster: str, window_bytes: int, passes=None):
        """``passes``: a :class:`gradbus.codecs.passes.Passes` that copies big tensors into
        the ring and out of boards in pieces at once (None: one thread)."""
        self.cluster = cluster
        self.ring = shm.Ring(cluster, int(window_bytes * RING_SLACK) + shm.MIN_RING_SEGMENT)
        self.mapper = shm.Mapper()
        if passes is not None and passes.threads > 1:
            self.ring.passes = self.mapper.passes = passes
        self.lock = threading.Lock()
        # address -> (token, bytes, segment, offset, address): the gradient buffers not pushed
        self.buffers: dict[int, tuple] = {}
        self.handed_out = False                # whether a gradient buffer was ever made

    # -- gradient buffers ------------------------------------------------------------------------
    def gradient_buffer(self, shape: tuple, dtype) -> np.ndarray | None:
        """A writable array in a reserved ring slot, or None when the ring has no room. An
        array dropped without being pushed gives its slot back."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        got = self.ring.reserve(count * dtype.itemsize)
        if got is None:
            return None
        seg, off, token = got
        self.handed_out = True
        whole = np.frombuffer(seg.mm, dtype, count, off)
        addr = whole.ctypes.data
        with self.lock:
            self.buffers[addr] = (token, whole.nbytes, seg.name, off, addr)
        # on the array every view of the buffer has as its base: the slot outlives them all
        weakref.finalize(whole, self._dropped, addr, token)
        return whole.reshape(shape)

    def in_place(self, grads: dict, flats: dict, chain: str, accumulating: bool) -> dict:
        """The gradient buffers among ``grads`` (``flats``: the same, flat) that a push
        sends where they are (raw, not accumulated): name -> reservation. A buffer pushed
        before is refused: its memory may hold another push's bytes by now."""
        own = {}
        if not self.handed_out:      # no gradient buffer ever: nothing to look for
            return own
        for name, flat in flats.items():
            ent = self.reserved(flat)
            if ent is None:
                if self.in_ring(flat):
                    raise ValueError(f"{name}: this gradient buffer was pushed already; take "
                                     f"a new one with gradient_buffer() for each push")
            elif chain == "raw" and not accumulating:
                own[name] = ent
        return own

    def reserved(self, flat: np.ndarray) -> tuple | None:
        """The reservation ``flat`` is the whole of (a gradient buffer, not yet pushed)."""
        if not isinstance(flat, np.ndarray) or not flat.flags.c_contiguous:
            return None
        with self.lock:
            ent = self.buffers.get(flat.ctypes.data)
        return ent if ent is not None and ent[1] == flat.nbytes else None

    def in_ring(self, arr: np.ndarray) -> bool:
        """Whether ``arr``'s memory lies in this client's ring (a spent gradient buffer)."""
        if not isinstance(arr, np.ndarray) or not arr.size:
            return False
        addr = arr.__array_interface__["data"][0]
        return any(a.seg.address <= addr < a.seg.address + a.seg.size
                   for a in list(self.ring.arenas))

    def _dropped(self, addr: int, token: int) -> None:
        with self.lock:
            ent = self.buffers.get(addr)
            if ent is not None and ent[0] == token:
                del self.buffers[addr]
        self.ring.unreserve(token)

    def _spend(self, ents) -> None:
        """These buffers are pushed: no longer the caller's to push again."""
        with self.lock:
            for ent in ents:
                if self.buffers.get(ent[4]) is ent:
                    del self.buffers[ent[4]]

    def _in_place(self, buf, ents):
        """The ref of ``buf`` when it lies inside one of the reservations ``ents``."""
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            return None
        addr = buf.ctypes.data
        for _token, n, seg, off, base in ents:
            if base <= addr and addr + buf.nbytes <= base + n:
                return [seg, off + addr - base]
        return None

    @classmethod
    def offered(cls, welcome: dict, wanted: bool, window_bytes: int,
                passes=None) -> ClientShm | None:
        """``welcome``: the WELCOME header (a dict, as ``net.hello`` returns it)."""
        if not wanted:
            return None
        cluster = shm.accept(welcome.get("shm"))
        if cluster is None:
            return None
        try:
            return cls(cluster, window_bytes, passes)
        except OSError:      # no room even for the first segment: logged, frames then
            return None

    def place(self, msg: int, descs: list, bufs: list, own=()) -> list:
        """The frames of push ``msg``: empty where its bytes went into the ring (its
        descriptors then carry the refs), the buffers themselves when the ring is full.
        ``own``: reservations (:meth:`reserved`) whose bytes are sent where they are, copied
        nowhere; they are held for ``msg`` from now on. A descriptor whose checksum is None
        (``Pipeline.encode``) gets it here: of its bytes as
        the ring copies them, or where they are."""
        inplace = {}
        if own:
            for i, b in enumerate(bufs):
                ref = self._in_place(b, own)
                if ref is not None:
                    inplace[i] = ref
        copies = [i for i in range(len(bufs)) if i not in inplace]
        digests = [descs[i]["x"] for i in copies]
        refs = self.ring.place(msg, [bufs[i] for i in copies], digests)
        if own:
            self._spend(own)
        if refs is None:     # frames after all: never the caller's own memory (not detached)
            self.ring.stats["pushes_as_frames"] += 1
            for ent in own:
                self.ring.unreserve(ent[0])
            self._hash_where_they_are(descs, bufs, range(len(bufs)))
            return [b.copy() if isinstance(b, np.ndarray) and not b.flags.owndata else b
                    for b in bufs]
        for i, x in zip(copies, digests):
            descs[i]["x"] = x
        self._hash_where_they_are(descs, bufs, inplace)
        if own:
            self.ring.bind(msg, [ent[0] for ent in own])
        copied = iter(refs)
        for i, d in enumerate(descs):
            d["r"] = inplace[i] if i in inplace else next(copied)
        self.ring.stats["in_place_blocks"] += len(inplace)
        return [b""] * len(bufs)

    @staticmethod
    def _hash_where_they_are(descs: list, bufs: list, which) -> None:
        for i in which:
            if descs[i]["x"] is None:
                descs[i]["x"] = wire.checksum(bufs[i])

    def free(self, msgs) -> int:
        return self.ring.free(msgs)

    def board_blocks(self, t, frames: list, max_tensor_bytes: int) -> list | None:
        """An UPDATE's blocks as ``(desc, BoardBlock)``, their bytes left in the shard's
        board until a pull reads them, when every one of them is raw there (else None: the
        update is read now, as frames or copies). A malformed descriptor raises WireError."""
        if not t or type(t) is not list or len(t) != len(frames):
            return None
        out = []
        for d, f in zip(t, frames):
            if (type(d) is not dict or d.get("c") != "raw" or "base" in d
                    or type(d.get("r")) is not list or len(d["r"]) != 3 or wire.frame_len(f)):
                return None
            desc = wire.parse_desc(d, max_tensor_bytes)   # raw: n is the shape's bytes
            size = desc.nbytes // tcodec.DTYPES[desc.dtype].itemsize
            # mapped now: a board whose shard dies and is swept stays readable while mapped,
            # so the cache keeps serving the last weights it published
            self.mapper.segment(desc.ref[0])
            out.append((desc, BoardBlock(self.mapper, desc.ref, tcodec.DTYPES[desc.dtype],
                                         size)))
        return out

    def resolve(self, h, frames: list) -> bool:
        """An UPDATE's board blocks copied into its frames; False when one was rewritten
        before it was read (a later update, or a snapshot, brings it)."""
        return wire.resolve_refs(h.t, frames, self.mapper)

    def close(self) -> None:
        self.mapper.close()
        self.ring.close()
