"""The shard's state machine: fed decoded messages from the broker, returns messages to send.

No sockets here. :meth:`ShardCore.handle` takes the frames of one message (header first) and
returns a list of outgoing messages (each a list of frames) for the broker's backend. The core
dispatches each kind to the part that owns it:

* :mod:`.apply`: a BATCH's partition parts applied to the store (entries checked and decoded,
  resends skipped, each key's gradients summed in batch order, its optimizer stepped once);
* :mod:`.publish`: the APPLIED reply and each part's UPDATE event with ``(epoch, seq)`` (every
  part a primary applies, even one whose entries all failed, produces one, so subscribers can
  detect gaps), and the SNAPSHOT and ROWS replies;
* :mod:`.replication`: ADOPT, STATE_REQ, STATE, DROP and DIGEST (a standby's catch-up, moves,
  replica digests), and what REGISTER reports;

and :meth:`ShardCore.validate_state` checks the invariants of all of them.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from gradbus.codecs import cores, hops, jit, messages, stats, wire
from gradbus.codecs import passes as passes_mod
from gradbus.codecs.errors import WireError
from gradbus.codecs.partition import split_row_key

from . import backend as backend_mod
from .apply import Applier
from .publish import Publisher
from .replication import Replication
from .rows import RowBatch
from .store import RECENT_WINDOW, ParameterStore

log = logging.getLogger("gradbus.shard")

NAN_POLICIES = ("refuse", "allow")


class ShardCore:
    def __init__(self, shard_id: str, *, weights_codec: str = "raw",
                 max_tensor_bytes: int = wire.MAX_TENSOR_BYTES, nan_policy: str = "refuse",
                 backend=None, threads: int | None = 1):
        """``threads``: the threads a big block's passes are split over
        (:mod:`gradbus.codecs.passes`; None or 0: from the host's cores,
        :func:`gradbus.codecs.cores.pass_threads`), a pool shared by the shards of this
        process; :meth:`close` gives it back."""
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}")
        self.shard_id = shard_id
        # Chosen (and any JIT compiled) here, before the shard's loop starts heartbeating.
        self.backend = backend or backend_mod.load()
        log.info("%s: %s backend on %s", shard_id, self.backend.name, self.backend.device)
        # The codecs' numba loops (a batch's frames are summed with them) are built now, before
        # the shard registers: compiled inside the loop, on a cold cache, they would silence the
        # shard for seconds and the broker would declare it dead.
        jit.loops()
        self.store = ParameterStore(self.backend)
        self.weights_codec = weights_codec
        self.max_tensor_bytes = max_tensor_bytes
        self.nan_policy = nan_policy
        self.stats = {"batches": 0, "pushes_applied": 0, "pushes_refused": 0, "snapshots": 0,
                      "errors": 0, "syncs": 0, "states_sent": 0, "dropped": 0}
        self.h_apply = stats.Histogram()                     # seconds per batch message
        n = cores.pass_threads(threads) if self.backend.xp is np else 1
        self.passes = passes_mod.shared(n) if n > 1 else passes_mod.Passes(1)
        self._closed = False
        self.applier = Applier(shard_id, self.store, self.backend, self.stats,
                               nan_policy=nan_policy, max_tensor_bytes=max_tensor_bytes,
                               passes=self.passes)
        self.publisher = Publisher(self.store, self.backend, self.stats, weights_codec)
        self.replication = Replication(self.store, self.backend, self.stats,
                                       max_tensor_bytes=max_tensor_bytes,
                                       forget=self.applier.forget)

    def close(self) -> None:
        """Give back the pass threads (the last shard of the process ends them)."""
        if self.passes.threads > 1 and not self._closed:
            self._closed = True
            passes_mod.release(self.passes)

    @property
    def installing(self) -> dict[int, list]:
        """Partitions being caught up on (ADOPT seen, STATE not yet): their held batch parts."""
        return self.replication.installing

    # -- entry point -------------------------------------------------------------------------
    def handle(self, frames: list, header=None) -> list[list]:
        """Handle one message from the broker; return messages to send back. ``header``: the
        message already unpacked and typed (:mod:`gradbus.codecs.messages`), when the caller
        has it."""
        try:
            m = header or messages.unpack(frames[0], wire.SHARD_KINDS)
            descs = wire.parse_descs(m.kind, getattr(m, "t", []), frames[1:],
                                     self.max_tensor_bytes)
        except WireError as e:
            self.stats["errors"] += 1
            log.warning("bad message from broker: %s", e)
            return [[wire.error(e.code, str(e.args[0]))]]
        kind = m.kind
        if kind == wire.BATCH:
            return [self._batch(m, descs, frames[1:])]
        if kind == wire.SNAPSHOT:
            return [self.publisher.snapshot(m)]
        if kind == wire.ROWS:
            return [self.publisher.rows(m)]
        if kind == wire.ADOPT:
            self.replication.adopt(m.p)
            return []
        if kind == wire.STATE_REQ:
            return [self.replication.export(m.p, m.to,
                                            self.publisher.replies if m.shm else None,
                                            m.names, m.req)]
        if kind == wire.STATE:
            return self.replication.install(m, descs, frames[1:], self._apply_now)
        if kind == wire.DROP:
            self.replication.drop(m.ps)
            return []
        if kind == wire.DIGEST:
            return [self.replication.digest_reply(m, self.shard_id)]
        return []  # REGISTERED / HEARTBEAT / ERROR are the loop's business

    def _batch(self, m, descs, frames) -> list:
        """Every part applied (those of partitions being caught up on held back), the rows of
        all of them updated together, then the APPLIED reply and the parts' UPDATEs."""
        t0 = time.perf_counter()
        if hops.ON:
            msgs = [e.m for part in m.parts for e in part.e if getattr(e, "m", None) is not None]
            hops.stamp_woke("shard_wake", msgs)
            hops.stamp("shard_in", msgs)
        out_parts, tail, done = [], [], []
        rows = RowBatch()     # every partition's table rows, updated together
        for part in m.parts:
            if not self.replication.hold(part, descs, frames):
                done.append(self.applier.apply_part(part, descs, frames, rows))
        rows.apply()
        if hops.ON:
            hops.stamp("applied", msgs)
        for applied in done:
            res, pub = self.publisher.result(applied)
            out_parts.append(res)
            tail.extend(pub)
        if hops.ON:
            hops.stamp("shard_out", msgs)
        self.stats["batches"] += 1
        self.h_apply.observe(time.perf_counter() - t0)
        return [wire.pack(wire.APPLIED, parts=out_parts, shard=self.shard_id), *tail]

    def _apply_now(self, part, descs, frames):
        """One held part, applied on its own (after its partition's state was installed)."""
        rows = RowBatch()
        applied = self.applier.apply_part(part, descs, frames, rows)
        rows.apply()
        return self.publisher.result(applied)

    # -- replication, for the server loop and checkpoints ------------------------------------
    def install_state(self, h, descs, frames) -> int:
        """Replace partition ``h.p`` with an exported state (from a primary, or a checkpoint:
        a STATE header as unpacked, typed here); returns its seq."""
        if isinstance(h, dict):
            h = messages.from_header(h)
        return self.replication.install_state(h, descs, frames)

    def states(self) -> list[list]:
        """Every settled partition's STATE message (for a checkpoint)."""
        return self.replication.states()

    def register_fields(self) -> dict:
        """What REGISTER tells the broker (see :meth:`Replication.holdings`)."""
        return self.replication.holdings()

    def partition_digest(self, p: int) -> str:
        """A hash of partition ``p``: every block's value, version and optimizer state."""
        return self.replication.partition_digest(p)

    # -- invariants --------------------------------------------------------------------------
    def validate_state(self) -> None:
        """Raise AssertionError naming the first broken invariant of the shard's state: each
        partition's (epoch, seq) and duplicate window; every block and table held by exactly
        one partition, and every key a partition names held; blocks shaped as their layouts
        say, versions counting up from 0; counters not negative; then each part's own
        (accumulators, published values, held batches). One pass over partitions, blocks and
        tables: cheap enough to call after every message in tests."""
        st = self.store
        owner: dict[str, int] = {}
        towner: dict[str, int] = {}
        for p, pst in st.partitions.items():
            if pst.p != p:
                raise AssertionError(f"partition {p} holds the state of partition {pst.p}")
            for name, v in (("seq", pst.seq), ("epoch", pst.epoch)):
                if not isinstance(v, int) or v < 0:
                    raise AssertionError(f"partition {p}: {name} {v!r}")
            if len(pst.recent) > RECENT_WINDOW:
                raise AssertionError(f"partition {p}: {len(pst.recent)} gradient identities "
                                     f"remembered, window {RECENT_WINDOW}")
            for keys, owners in ((pst.keys, owner), (pst.tables, towner)):
                for key in keys:
                    if key in owners:
                        raise AssertionError(f"{key} in partitions {owners[key]} and {p}")
                    owners[key] = p
        for what, owners, held in (("block", owner, st.blocks), ("table", towner, st.tables)):
            if owners.keys() != held.keys():
                raise AssertionError(
                    f"{what}s named by no partition: {sorted(held.keys() - owners.keys())}; "
                    f"named but not held: {sorted(owners.keys() - held.keys())}")
        for key, blk in st.blocks.items():
            a, b = blk.layout.block_range(blk.index)
            if blk.key != key or blk.p != owner[key]:
                raise AssertionError(f"{key}: block {blk.key} of partition {blk.p} stored as "
                                     f"{key} of partition {owner[key]}")
            held = blk.held      # read without settling: a live block stays live
            if held.shape != (b - a,) or held.dtype != np.dtype(blk.layout.dtype):
                raise AssertionError(f"{key}: values {held.dtype}{held.shape}, layout "
                                     f"{blk.layout.dtype}[{b - a}]")
            if blk.live is not None:
                self._check_live(blk, held)
            if not isinstance(blk.version, int) or blk.version < 0:
                raise AssertionError(f"{key}: version {blk.version!r}")
        for key, tbl in st.tables.items():
            if not isinstance(tbl.version, int) or tbl.version < 0:
                raise AssertionError(f"{key}: version {tbl.version!r}")
            if st.pools.get(split_row_key(key)[0]) is not tbl.pool:
                raise AssertionError(f"{key}: rows outside the store's pool for the table")
        bad = {k: v for k, v in self.stats.items() if not isinstance(v, int) or v < 0}
        if bad:
            raise AssertionError(f"counters: {bad}")
        self.applier.validate()
        self.publisher.validate()
        self.replication.validate()

    def _check_live(self, blk, held) -> None:
        """A block whose values live on the board: the store's board holds its version, and
        its values are that version's bytes there."""
        board = self.store.board
        if board is None or not board.holds(blk.key, blk.version):
            raise AssertionError(f"{blk.key}: values live on a board that does not hold "
                                 f"version {blk.version}")
        view = np.frombuffer(board.newest(blk.key)[0], held.dtype)
        if (blk.live.shape != held.shape or blk.live.dtype != held.dtype
                or blk.live.ctypes.data != view.ctypes.data):
            raise AssertionError(f"{blk.key}: live values are not the board's newest version")

    # -- introspection -----------------------------------------------------------------------
    def info(self) -> dict:
        return {"backend": self.backend.name, "device": self.backend.device,
                "keys": len(self.store.blocks), "bytes": self.store.nbytes,
                "rows": self.store.rows, **self._row_stats(),
                "partitions": len(self.store.partitions), **self.stats}

    def _row_stats(self) -> dict:
        """Table rows created, expired and filtered (gradients dropped by the frequency
        filter), over the tables held now."""
        out = dict.fromkeys(("rows_created", "rows_expired", "rows_filtered"), 0)
        for tbl in self.store.tables.values():
            for k in out:
                out[k] += tbl.stats[k]
        return out

    def metrics(self) -> dict:
        """A snapshot for the Prometheus exporter."""
        st = self.stats
        m = {f"gradbus_shard_{k}": stats.counter(help_, st.get(k, 0)) for k, help_ in (
            ("batches", "Batch messages applied."),
            ("pushes_applied", "Gradients applied."),
            ("pushes_refused", "Gradients refused (bad shape, not finite, unknown key)."),
            ("duplicates_skipped", "Gradients received again and not applied again."),
            ("steps_in_one_pass", "Block steps whose gradients were checksummed, summed, "
             "checked finite and stepped in one pass over their bytes (plain SGD onto the "
             "weights board)."),
            ("snapshots", "Snapshot requests served."),
            ("row_reads", "Table row reads served."),
            ("syncs", "Partitions installed from a primary's state (catch-up)."),
            ("states_sent", "Partition states exported to a catching-up standby."),
            ("checkpoints", "Checkpoints written."),
            ("shm_replies", "Replies (snapshots, rows, states) written into the reply area for "
             "readers of shared memory."),
            ("shm_replies_full", "Replies to readers of shared memory sent as frames: larger "
             "than the reply area may grow ($GRADBUS_SHM_REPLY_MB)."),
            ("errors", "Messages that failed validation or handling."))}
        m["gradbus_shard_info"] = ("gauge", "The shard's compute backend (numpy, cupy) and the "
                                   "device its parameters live on; always 1.",
                                   {(("backend", self.backend.name),
                                     ("device", self.backend.device)): 1})
        m["gradbus_shard_parameter_bytes"] = stats.gauge("Bytes of parameters held.",
                                                         self.store.nbytes)
        m["gradbus_shard_table_rows"] = stats.gauge("Embedding table rows held.",
                                                    self.store.rows)
        rs = self._row_stats()
        m["gradbus_shard_rows_expired"] = stats.counter(
            "Table rows dropped by expiry (tables held now).", rs["rows_expired"])
        m["gradbus_shard_rows_filtered"] = stats.counter(
            "Row gradients dropped by the frequency filter (tables held now).",
            rs["rows_filtered"])
        m["gradbus_shard_partitions"] = stats.gauge("Partitions held.",
                                                    len(self.store.partitions))
        m["gradbus_shard_partitions_catching_up"] = stats.gauge(
            "Partitions being installed from a primary.", len(self.installing))
        m["gradbus_shard_apply_seconds"] = stats.histogram(
            "Time to apply one batch message (decode, sum, optimizer step, encode weights).",
            self.h_apply)
        m["gradbus_shard_batch_gradients"] = stats.histogram(
            "Gradients summed into one optimizer step of a block.", self.applier.h_pushes)
        return m
