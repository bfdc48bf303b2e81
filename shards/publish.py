"""What a shard sends toward clients: the APPLIED entry and UPDATE event of each applied part,
and the replies to SNAPSHOT and ROWS reads.

A primary publishes the blocks a part changed on the events socket with the part's
``(epoch, seq)``, encoded with the shard's weights codec chain; with a ``delta|`` chain it
publishes the change since the block's last publish. A standby applies and publishes nothing.
Table rows are never published: clients read them with ROWS. A read the broker marks
``shm`` is answered through the shard's reply area when it has one (:func:`.shm_io.place_reply`).
"""
from __future__ import annotations

import numpy as np

from gradbus.codecs import net, wire
from gradbus.codecs.partition import row_key, split_row_key

from .apply import PartApplied
from .shm_io import place_reply
from .store import ParameterStore


def host_copy(backend, value) -> np.ndarray:
    """``value`` as a host array that no later step will write to (frames are sent
    zero-copy)."""
    host = backend.to_host(value)
    return host.copy() if host is value else host


class Publisher:
    """Encodes weights for subscribers and readers; owns what a delta chain's subscribers
    hold (each block's ``published`` and ``pub_seq``)."""

    def __init__(self, store: ParameterStore, backend, counters: dict, weights_codec: str):
        self.delta, self.weights_chain = wire.split_weights_codec(weights_codec)
        self.store = store
        self.backend = backend
        self.stats = counters          # the shard's counters (shared with the other parts)
        self._board = None             # a shm.Board to publish blocks into (the loop sets it)
        # a device backend's copy into host memory on a stream of its own (CuPy's)
        self._download = getattr(backend, "download", None)
        self.replies = None            # a shm.ReplyArea for replies to readers of shared memory

    @property
    def board(self):
        return self._board

    @board.setter
    def board(self, board) -> None:
        """Publish blocks into ``board`` (None: as frames only). With raw weights a step may
        write a block straight into it (:meth:`ParameterStore.step`); a delta chain needs every
        block's values in hand to publish its change."""
        self._board = board
        self.store.use_board(None if self.delta else board)

    # -- after a batch -------------------------------------------------------------------------
    def result(self, done: PartApplied) -> tuple[dict, list]:
        """The part's entry in the APPLIED reply, and its UPDATE message (empty when this
        shard does not publish the part)."""
        vers = {blk.key: blk.version for blk in done.changed.values()}
        res = {"p": done.p, "seq": done.seq, "epoch": done.epoch, "errors": done.errors,
               "vers": vers}
        if done.tables:    # a table's rows are read on request (ROWS), never published
            vers.update({key: tbl.version for key, tbl in done.tables.items()})
            res["tr"] = {split_row_key(key)[0]: [tbl.rows, tbl.nbytes]
                         for key, tbl in done.tables.items()}
        if done.duplicate:
            res["dup"] = True
        if not done.publish:   # a standby applies, the primary publishes
            res["n"] = -1
            return res, []
        descs, bufs = [], []
        board, raw = self.board, self.weights_chain == "raw" and not self.delta
        copied = (self._copy_out(board, done) if board is not None and self._download
                  else {})
        for blk in done.changed.values():
            # the board always holds the raw weights: readers on this host read the newest
            # whenever they read (a copy into the board, not into a frame, unless the step
            # wrote them there itself)
            if blk.key in copied:
                host, ref = copied[blk.key]
            elif board is not None and blk.live is not None and board.holds(blk.key,
                                                                            blk.version):
                host, ref = blk.live, board.newest(blk.key)[1]
            else:
                host = self.backend.to_host(blk.value)
                ref = board.write(blk.key, host, blk.version, done.seq) if board is not None \
                    else None
            if self.delta:
                d, buf = self._encode_delta(blk, done.seq)
            elif ref is not None and raw:
                # the UPDATE references it: readers copy it out under its stamps, unhashed
                d, _ = wire.encode_tensor(blk.key, host, "raw", blk.version, hashed=False)
                d["r"], buf = ref, b""
            else:
                d, buf = wire.encode_tensor(blk.key, host, self.weights_chain, blk.version)
                buf = net.detach(buf, host)     # the next step writes the block in place
            descs.append(d)
            bufs.append(buf)
        pub = wire.pack(wire.UPDATE, descs, p=done.p, seq=done.seq, epoch=done.epoch)
        res["n"] = len(bufs)
        return res, [pub, *bufs]

    def _copy_out(self, board, done: PartApplied) -> dict:
        """A device backend's changed blocks copied from the device straight into their next
        version on the board (pinned host memory; no host array in between): every copy queued
        on the backend's download stream first, then each version published once the copies'
        event completed. ``key -> (the board's bytes as an array, ref)``; a block the board
        has no room for is left out (published as the host path does)."""
        for arena in board.arenas:           # pinned once each (a new segment when it grew)
            self.backend.pins.pin(arena.seg.view)
        views, last = {}, None
        for blk in done.changed.values():
            dst = board.begin(blk.key, blk.held.nbytes)
            if dst is None:
                continue
            host = views[blk.key] = np.frombuffer(dst, blk.held.dtype)
            last = self._download(blk.value, host)
        if last is not None:
            last.synchronize()     # the copies are done: their versions may be read now
        return {key: (host, board.commit(key, done.changed[key].version, done.seq))
                for key, host in views.items()}

    def _encode_delta(self, blk, seq: int):
        """Publish the change since the block's last publish (the first publish is whole).
        ``published`` advances by exactly what subscribers decode, so a lossy chain's error
        is carried into the next delta rather than accumulating on the subscribers."""
        value = self.backend.to_host(blk.value)
        if blk.published is None:
            d, buf, decoded = wire.encode_tensor_lossy(blk.key, value.copy(), self.weights_chain,
                                                       version=blk.version)
            blk.published = np.array(decoded, dtype=value.dtype, copy=True)
        else:
            change = np.subtract(value, blk.published)
            d, buf, decoded = wire.encode_tensor_lossy(blk.key, change, self.weights_chain,
                                                       version=blk.version)
            d["base"] = blk.pub_seq
            blk.published += decoded
        blk.pub_seq = seq
        return d, buf

    # -- reads ---------------------------------------------------------------------------------
    def snapshot(self, h) -> list:
        """The blocks asked for, as subscribers' updates build on them (a delta chain's
        ``published``), with each one's partition seq; unknown keys listed as missing."""
        self.stats["snapshots"] += 1
        area = self.replies if h.shm else None
        board = self.board if h.shm else None
        frames = area is None          # frames go out later: they must not alias live values
        descs, bufs, missing, parts = [], [], [], {}
        for key in h.keys:
            blk = self.store.blocks.get(key)
            if blk is None:
                missing.append(key)
                continue
            live = None
            if board is not None:      # where a reader on this host finds the newest, always
                if not board.holds(key, blk.version):
                    board.write(key, self.backend.to_host(blk.value), blk.version,
                                self.store.partition(blk.p).seq)
                live = board.live_ref(key)
            if self.delta and blk.published is not None:   # what subscribers' deltas build on
                d, buf = wire.encode_tensor(key, blk.published.copy() if frames else
                                            blk.published, "raw", blk.version, hashed=frames)
                d["base"] = blk.pub_seq
            else:
                value = host_copy(self.backend, blk.newest) if frames else \
                    self.backend.to_host(blk.newest)
                d, buf = wire.encode_tensor(key, value, "raw", blk.version, hashed=frames)
            if live is not None:
                d["b"] = live
            descs.append(d)
            bufs.append(buf)
            parts[blk.p] = self.store.partition(blk.p).seq
        bufs = place_reply(area, descs, bufs, self.stats)
        fields = {"req": h.req, **{k: v for k in ("client", "of")
                                   if (v := getattr(h, k)) is not None}}
        return [wire.pack(wire.SNAPSHOT_REPLY, descs, parts=sorted(parts.items()), missing=missing,
                          **fields), *bufs]

    def rows(self, h) -> list:
        """Rows of a table, by partition: stored values, or for rows not created yet (never
        pushed, or filtered) their initial values. Never creates a row."""
        self.stats["row_reads"] = self.stats.get("row_reads", 0) + 1
        area = self.replies if h.shm else None
        descs, bufs, missing = [], [], []
        for q in h.q:       # malformed pairs were left out when the message was unpacked
            key = row_key(h.table, q[0])
            tbl = self.store.tables.get(key)
            if tbl is None:
                missing.append(q[0])
                continue
            d, buf = wire.encode_tensor(key, tbl.lookup(wire.row_ids(q[1])),
                                        "raw", tbl.version, hashed=area is None)
            descs.append(d)
            bufs.append(buf)
        bufs = place_reply(area, descs, bufs, self.stats, fresh=True)   # lookup's own arrays
        fields = {"req": h.req, **{k: v for k in ("client", "of", "tv")
                                   if (v := getattr(h, k)) is not None}}
        return [wire.pack(wire.ROWS_REPLY, descs, missing=missing, **fields), *bufs]

    def validate(self) -> None:
        """What subscribers hold: only with a delta chain, shaped like the block, with the
        seq of its publish."""
        for key, blk in self.store.blocks.items():
            if blk.published is None:
                if blk.pub_seq is not None:
                    raise AssertionError(f"{key}: pub_seq {blk.pub_seq} without published values")
                continue
            if not self.delta:
                raise AssertionError(f"{key}: published values without a delta chain")
            if blk.published.shape != blk.value.shape or blk.published.dtype != blk.value.dtype:
                raise AssertionError(f"{key}: published {blk.published.dtype}"
                                     f"{blk.published.shape} vs value {blk.value.dtype}"
                                     f"{blk.value.shape}")
            if not isinstance(blk.pub_seq, int):
                raise AssertionError(f"{key}: published values without the seq of the publish")
