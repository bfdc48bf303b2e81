"""Applying one partition's part of a BATCH: the entries checked and decoded, resends skipped,
each key's gradients summed in batch order and its optimizer stepped once on the sum.

:meth:`Applier.apply_part` runs the steps in order and returns a :class:`PartApplied`:

1. a re-delivery (seq and epoch not past the partition's) applies nothing;
2. each entry in batch order: INIT creates a block or a table's rows (a no-op if present);
   a dense PUSH is checked (known key, matching shape) and either kept for the streamed sum
   (raw, fp16, bf16 frames on the host) or decoded whole, checked (finite values) and kept;
   a rows PUSH is checked, decoded and kept for the batch's rows; a bad entry is an error for
   its index and touches nothing else;
3. each key's streamed frames are summed in one pass with their checksums;
4. each key's optimizer runs once on the sum of its gradients (the streamed sum first, then
   the others in batch order);
5. the rows' gradients are queued on the message's :class:`~gradbus.shards.rows.RowBatch`.

The reduction order of a key's gradients is fixed by the batch, so every replica fed the same
batches holds bit-identical state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradbus.codecs import device, stats, values, wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.messages import BatchPart, DropEntry, InitEntry, PushEntry, TableInitEntry
from gradbus.codecs.partition import split_key
from gradbus.codecs.passes import Passes

from . import backend as backend_mod
from .imports import Imports
from .rows import RowBatch
from .store import ParameterStore, PartitionState


@dataclass(slots=True)
class PartApplied:
    """What applying one partition's part of a batch did: its APPLIED entry and UPDATE are
    built from it (:meth:`gradbus.shards.publish.Publisher.result`)."""
    p: int
    seq: int
    epoch: int
    errors: list              # [entry index, code, message] per refused entry
    changed: dict             # key -> Block created or stepped (published by a primary)
    tables: dict              # row key -> RowTable whose rows changed (never published)
    duplicate: bool = False   # a batch applied before, delivered again: nothing applied
    publish: bool = True      # this shard is the part's primary (a standby only applies)


@dataclass(slots=True)
class _Work:
    """One part's entries on their way to the optimizer."""
    p: int
    pst: PartitionState
    publish: bool             # this shard publishes the part: its steps may go onto the board
    errors: list = field(default_factory=list)
    changed: dict = field(default_factory=dict)
    # key -> [(indices or None, values, gradients summed, pushes)], in batch order
    sums: dict = field(default_factory=dict)
    # row key -> [(ids, rows, ts)], in batch order
    rsums: dict = field(default_factory=dict)
    # key -> [(entry index, entry, desc, frame, TensorStream)], summed in one pass per key
    streams: dict = field(default_factory=dict)
    stepped: int = 0    # pushes applied by steps taken while their gradients were read


def _ident(ent: PushEntry, desc) -> tuple | None:
    """A pushed gradient's identity, (client, msg, key), for skipping a resend; None when the
    entry carries no msg id."""
    return None if ent.m is None else (ent.c, ent.m, desc.key)


def _peeker(stream, at: int):
    """``stream``'s values read from element ``at`` on, unhashed: ``read(lo, hi, buf)`` for a
    piece of a block that starts there (see :meth:`Applier._split`)."""
    return lambda lo, hi, buf: stream.peek(at + lo, at + hi, buf)


def _sum_chunks(acc: np.ndarray, reads: list, first: int, scratch, step: int) -> None:
    """``acc`` set (``first`` 0) or added to the values ``reads`` give (``(read(lo, hi, buf),
    scale or None)`` each), a chunk of ``step`` values at a time, each chunk's reads in list
    order while it is in cache; ``scratch``: two chunks' worth."""
    m = min(step, acc.size)
    s1, s2 = scratch[:m], scratch[m:2 * m]
    for lo in range(0, acc.size, step):
        hi = min(lo + step, acc.size)
        o = acc[lo:hi]
        for j, (read, w) in enumerate(reads, first):
            v = read(lo, hi, s1)
            if w is not None:
                v = np.multiply(v, w, out=s2[:hi - lo])
            if j:
                np.add(o, v, out=o)
            else:
                np.copyto(o, v)


def _weight(ent: PushEntry, dtype) -> np.ndarray | None:
    """A push's staleness scale ``w`` (0 < w < 1) as a 0-d array of ``dtype``, else None."""
    w = ent.w
    return None if w is None else np.asarray(w, dtype=dtype)


class Applier:
    """Applies batch parts to a :class:`ParameterStore`; owns the reusable buffers (one
    accumulator per block, one scratch buffer per dtype) so sums never allocate after a key's
    first batch, and the histogram of gradients summed per step."""

    def __init__(self, shard_id: str, store: ParameterStore, backend, counters: dict, *,
                 nan_policy: str, max_tensor_bytes: int, passes: Passes | None = None):
        """``passes``: the threads a big block's passes are split over (None: one thread,
        nothing split); only the host backend splits (its steps write out of place)."""
        self.shard_id = shard_id
        self.passes = passes if passes is not None else Passes(1)
        self._splits = backend.xp is np and self.passes.threads > 1
        self.store = store
        self.backend = backend
        self.stats = counters          # the shard's counters (shared with the other parts)
        self.nan_policy = nan_policy
        self.max_tensor_bytes = max_tensor_bytes
        self._on_host = backend.xp is np   # raw/fp16/bf16 frames summed as they are read
        self._scratch: dict = {}        # by dtype (its .name is slow to compute)
        self._accs: dict[str, np.ndarray] = {}
        self.imports = Imports(store, backend, max_tensor_bytes)
        self.h_pushes = stats.Histogram(stats.COUNT_BUCKETS)  # gradients summed per key

    # -- the steps ---------------------------------------------------------------------------
    def apply_part(self, part: BatchPart, descs, frames, rows: RowBatch) -> PartApplied:
        """Apply one partition's part of a batch (checked when it was unpacked); table rows go
        to ``rows``, applied by the caller once every part of the message is in."""
        p, seq, epoch = part.p, part.seq, part.epoch
        publish = part.o is None or part.o == self.shard_id
        pst = self.store.partition(p)
        if seq <= pst.seq and epoch <= pst.epoch:
            # Re-delivery of a batch already applied: apply nothing, report success again.
            return PartApplied(p, seq, epoch, [], {}, {}, duplicate=True, publish=publish)
        pst.seq, pst.epoch = seq, max(epoch, pst.epoch)
        self.backend.begin_batch()
        work = _Work(p, pst, publish)
        for idx, ent in enumerate(part.e):
            self._entry(idx, ent, descs, frames, work)
        for key, items in work.streams.items():
            self._sum_streams(key, items, work)
        applied = self._step_blocks(work) + work.stepped
        touched = self._queue_rows(work, rows)
        applied += sum(len(g) for g in work.rsums.values())
        self.backend.end_batch()
        self.stats["pushes_applied"] += applied
        self.stats["pushes_refused"] += len(work.errors)
        return PartApplied(p, seq, epoch, work.errors, work.changed, touched, publish=publish)

    def _entry(self, idx: int, ent, descs, frames, work: _Work) -> None:
        """One entry, in batch order (its fields were checked when the batch was unpacked; a
        malformed one is an Invalid); a bad one becomes an error for its index."""
        try:
            t = type(ent)
            if t is PushEntry:
                i = ent.i
                if descs[i].ids is not None:
                    self._push_rows(descs[i], frames[i], ent, work)
                else:
                    self._push_dense(idx, ent, descs[i], frames[i], work)
            elif t is TableInitEntry:
                if ent.st is not None:
                    self.imports.table(ent, descs, frames, work.p)
                else:
                    self.store.create_table(ent.key, work.p, ent.table)
            elif t is InitEntry:
                if ent.st is not None:
                    blk = self.imports.block(ent, descs, frames, work.p)
                    work.changed[blk.key] = blk
                else:
                    self._init_block(ent, descs, frames, work)
            elif t is DropEntry:
                self.forget(self.store.drop_key(ent.key))
            else:
                ent.raise_()
        except WireError as e:
            work.errors.append([idx, e.code.value, str(e.args[0])])

    def _init_block(self, ent: InitEntry, descs, frames, work: _Work) -> None:
        layout = ent.layout
        given = None
        if ent.rule["name"] == "given":
            i = ent.i
            start, stop = layout.block_range(split_key(ent.key)[1])
            if i is None or descs[i].shape != (stop - start,):
                raise WireError(Code.BAD_SHAPE, f"{ent.key}: initial values missing or not "
                                                f"[{stop - start}]")
            given = wire.decode_tensor(descs[i], frames[i], self.max_tensor_bytes)
        blk, created = self.store.create(ent.key, work.p, layout, ent.rule, ent.opt, given)
        if created:
            work.changed[blk.key] = blk

    def _push_dense(self, idx: int, ent: PushEntry, desc, frame, work: _Work) -> None:
        """Check a dense gradient against its block; keep it for the streamed sum, or decode
        it whole and keep it."""
        blk = self.store.blocks.get(desc.key)
        if blk is None:
            raise WireError(Code.UNKNOWN_KEY, f"{desc.key} is not held here")
        held = blk.held                      # its size and dtype (not its values)
        if desc.shape != (held.size,) or np.dtype(desc.dtype) != held.dtype:
            raise WireError(Code.BAD_SHAPE,
                            f"{desc.key}: gradient {desc.dtype}{list(desc.shape)} does "
                            f"not match {held.dtype}[{held.size}]")
        stream = (wire.stream_tensor(desc, frame, self.max_tensor_bytes)
                  if self._on_host else None)
        if stream is not None:    # summed by _sum_streams, in one pass with its checksum
            work.streams.setdefault(desc.key, []).append((idx, ent, desc, frame, stream))
        else:
            self._keep(ent, desc, frame, work)

    def _keep(self, ent: PushEntry, desc, frame, work: _Work) -> None:
        """Decode a dense gradient whole and keep it for its key's sum (unless refused or a
        resend)."""
        at, vals = self._decode(desc, frame)
        vals = self._accepted(desc, vals, ent, work.pst)
        if vals is not None:
            work.sums.setdefault(desc.key, []).append((at, vals, desc.count, 1))

    def _push_rows(self, desc, frame, ent: PushEntry, work: _Work) -> None:
        """Check and decode one pushed rows frame; kept for the batch's sum per row."""
        tbl = self.store.tables.get(desc.key)
        if tbl is None:
            raise WireError(Code.UNKNOWN_KEY, f"{desc.key} is not held here")
        if desc.shape[1] != tbl.dim or desc.dtype != tbl.cfg["dtype"]:
            raise WireError(Code.BAD_SHAPE, f"{desc.key}: rows {desc.dtype}{list(desc.shape)} "
                                            f"do not match {tbl.dtype}[n, {tbl.dim}]")
        vals = self._accepted(desc, wire.decode_tensor(desc, frame, self.max_tensor_bytes)
                              .reshape(desc.shape), ent, work.pst)
        if vals is None:
            return
        work.rsums.setdefault(desc.key, []).append((desc.row_ids(), vals, ent.ts))

    def _sum_streams(self, key: str, items: list, work: _Work) -> None:
        """A key's dense gradients whose frames decode piece by piece (raw, fp16, bf16): after
        the duplicates are skipped, their sum in one pass (:meth:`_sum_pieces`), kept first
        in the key's sum. When a checksum does not match or the sum is not finite, the key's
        gradients go through :meth:`_accepted` one at a time instead, which refuses exactly
        the bad ones (the sum is the same either way). One raw frame is used as it is. Where
        the key's rule can, its step is taken while the frames are read instead
        (:meth:`_step_reading`). A big block's passes are split over the pass threads."""
        fresh, idents = self._unseen(items, work.pst)
        if not fresh:
            return
        stepped = self._step_reading(key, fresh, idents, work)
        if stepped:
            return
        acc = None
        if stepped is None and self._pieces(key) > 1:       # split over the pass threads
            one = fresh[0] if len(fresh) == 1 else None
            acc = (self._checked_split(key, one[4])          # one raw frame, as it is
                   if one and one[4].pieces.coder == "raw" and one[1].w is None
                   else self._sum_pieces_split(key, fresh))
        elif stepped is None and (len(fresh) > 1 or fresh[0][4].pieces.coder != "raw"):
            acc = self._sum_pieces(key, fresh)
        if acc is not None:
            for ident in idents:
                work.pst.seen(ident)
            # first: the step's sum adds any other gradients of the key into this buffer
            work.sums.setdefault(key, []).insert(
                0, (None, acc, sum(item[2].count for item in fresh), len(fresh)))
            return
        for idx, ent, desc, frame, _ in fresh:
            try:
                self._keep(ent, desc, frame, work)
            except WireError as e:
                work.errors.append([idx, e.code.value, str(e.args[0])])

    def _step_reading(self, key: str, fresh: list, idents: set, work: _Work) -> bool | None:
        """A key whose only gradients are these streams, stepped onto the weights board while
        they are read: each piece checksummed, summed, checked finite and stepped while in
        cache (the rule's ``step_reading``: plain SGD on numba's loop). True once published,
        which it is only when every checksum matched and (nan_policy refuse) the sum was
        finite; else False, the board's new version left unpublished and the streams spent:
        the caller decodes the frames one at a time, refusing exactly the bad gradients.
        None, nothing read, where the rule, the backend or the board cannot."""
        blk = self.store.blocks[key]
        stepper = getattr(blk.rule, "step_reading", None)
        if stepper is None or key in work.sums:
            return None
        out = self.store.board_target(blk, work.publish)
        if out is None:
            return None
        held = blk.held
        step = self.backend.chunk_len(held.dtype)
        pieces = self._pieces(key)
        if pieces > 1:
            finite, whole = self._step_reading_split(stepper, blk.newest, out, fresh, pieces)
        else:
            reads = [(item[4].read, _weight(item[1], held.dtype)) for item in fresh]
            finite = stepper(blk.newest, reads, out,
                             self._scratch_for(2 * min(step, held.size), held.dtype))
            whole = finite is not None and all(item[4].verified() for item in fresh)
        if finite is None:
            return None
        if not whole or (not finite and self.nan_policy == "refuse"):
            return False
        self.h_pushes.observe(len(fresh))
        self.store.publish_step(blk, out, sum(item[2].count for item in fresh), work.pst.seq)
        for ident in idents:
            work.pst.seen(ident)
        work.changed[key] = blk
        work.stepped += len(fresh)
        self.stats["steps_in_one_pass"] = self.stats.get("steps_in_one_pass", 0) + 1
        return True

    # -- a big block's passes split over the pass threads (gradbus.codecs.passes) ---------
    def _pieces(self, key: str) -> int:
        """How many pieces ``key``'s passes are cut into (1: one thread, as without a pool)."""
        return self.passes.pieces(self.store.blocks[key].held.nbytes) if self._splits else 1

    def _split(self, n: int, dtype, pieces: int, piece, checks=()) -> list:
        """``piece(sl, scratch)`` for each of ``pieces`` slices of ``range(n)`` (each with
        scratch of its own, two chunks of ``dtype``), and each of ``checks`` (callables), all at
        once on the pass threads; their results, the pieces' first."""
        ranges = self.passes.ranges(n, pieces, self.backend.chunk_len(dtype))
        two = 2 * min(self.backend.chunk_len(dtype), n)
        tasks = [(lambda sl=sl, i=i: piece(sl, self._scratch_for(two, dtype, i)))
                 for i, sl in enumerate(ranges)]
        return self.passes.run([*tasks, *checks])

    def _step_reading_split(self, stepper, w, out, fresh: list, pieces: int):
        """:meth:`_step_reading`'s step in pieces at once, each frame hashed whole beside
        them: ``(finite, every checksum matched)``; finite is None where the rule cannot."""
        dt = w.dtype
        ws = [_weight(item[1], dt) for item in fresh]

        def piece(sl, scratch):
            reads = [(_peeker(item[4], sl.start), wt) for item, wt in zip(fresh, ws)]
            return stepper(w[sl], reads, out[sl], scratch)
        got = self._split(w.size, dt, pieces, piece, [item[4].matches for item in fresh])
        steps, sums = got[:len(got) - len(fresh)], got[len(got) - len(fresh):]
        if any(f is None for f in steps):
            return None, False
        return all(steps), all(sums)

    def _sum_pieces_split(self, key: str, fresh: list):
        """:meth:`_sum_pieces` in pieces at once, each frame hashed whole beside them."""
        acc = self._acc_for(key, self.store.blocks[key].held)
        dt = acc.dtype
        ws = [_weight(item[1], dt) for item in fresh]
        check = self.nan_policy == "refuse"

        def piece(sl, scratch):
            o = acc[sl]
            _sum_chunks(o, [(_peeker(item[4], sl.start), w) for item, w in zip(fresh, ws)],
                        0, scratch, self.backend.chunk_len(dt))
            return not check or values.all_finite(o)
        got = self._split(acc.size, dt, self._pieces(key), piece,
                          [item[4].matches for item in fresh])
        return acc if all(got) else None

    def _checked_split(self, key: str, stream):
        """One raw frame's values as they are (a view), checked in pieces at once (its
        checksum whole beside them, finiteness by piece); None where either fails."""
        vals = stream.peek(0, self.store.blocks[key].held.size, None)
        check = self.nan_policy == "refuse"
        got = self._split(vals.size, vals.dtype, self._pieces(key),
                          lambda sl, _: not check or values.all_finite(vals[sl]),
                          [stream.matches])
        return vals if all(got) else None

    def _step_split(self, pieces: int, held):
        """A block's ``split`` for :meth:`ParameterStore.step` (None: one piece)."""
        if pieces <= 1:
            return None
        return lambda run: self._split(held.size, held.dtype, pieces, run)

    def _unseen(self, items: list, pst: PartitionState) -> tuple[list, set]:
        """The streamed gradients not applied before (nor earlier in this batch), and their
        identities (recorded only once the sum is accepted)."""
        fresh, idents = [], set()
        for item in items:
            ident = _ident(item[1], item[2])
            if ident is not None:
                if ident in pst.recent or ident in idents:
                    self._skipped_duplicate()
                    continue
                idents.add(ident)
            fresh.append(item)
        return fresh, idents

    def _sum_pieces(self, key: str, fresh: list):
        """Each piece of every frame checksummed, decoded, scaled and added into the key's
        accumulator while it is in cache: one pass over the frames where checking, decoding
        and summing apart take three. The accumulator, or None when a frame's checksum does
        not match or (nan_policy refuse) the sum is not finite."""
        streams = [item[4] for item in fresh]
        acc = self._acc_for(key, self.store.blocks[key].held)
        n, dt = acc.size, acc.dtype
        step = self.backend.chunk_len(dt)
        scratch = self._scratch_for(2 * min(step, n), dt)
        ws = [_weight(item[1], dt) for item in fresh]
        # leading half-precision frames: each decoded and added in one pass (numba's loop)
        done = 0
        while done < len(streams) and streams[done].add_into(acc, not done, ws[done]):
            done += 1
        rest = [(st.read, w) for st, w in zip(streams, ws)][done:]   # a chunk at a time
        if rest:
            _sum_chunks(acc, rest, done, scratch, step)
        if all(st.verified() for st in streams) and (
                self.nan_policy != "refuse" or values.all_finite(acc)):
            return acc
        return None

    def _step_blocks(self, work: _Work) -> int:
        """Each key's optimizer once on the sum of its gradients; returns the pushes applied."""
        applied = 0
        for key, grads in work.sums.items():
            n = sum(c for *_, c in grads)      # pushes summed
            self.h_pushes.observe(n)
            applied += n
            blk = self.store.blocks[key]
            k = sum(c for _, _, c, _ in grads)   # gradients summed, local steps included
            held = blk.held                      # its size and dtype (not its values)
            pieces = self._pieces(key)
            self.store.step(blk, self._summed(key, held, grads, pieces), k,
                            self._scratch_for(held.size, held.dtype), work.pst.seq,
                            work.publish, self._step_split(pieces, held))
            work.changed[key] = blk
        return applied

    def _summed(self, key: str, value, grads: list, pieces: int = 1):
        """What a key's step gets: its one dense gradient as it is; up to SUM_GROUP dense ones
        as a list where the backend sums inside its step (one pass for both); else their sum
        in one pass over the dense ones, then the sparse ones added."""
        be = self.backend
        dense = [be.asarray(v) for idx, v, _, _ in grads if idx is None]
        sparse = [(be.asarray(idx), be.asarray(v)) for idx, v, _, _ in grads
                  if idx is not None]
        if len(dense) == 1 and not sparse:
            return dense[0]
        if not sparse and be.sums_in_step and len(dense) <= backend_mod.SUM_GROUP:
            return dense
        g = self._acc_for(key, value)
        if dense and pieces > 1 and len(dense) > 1:
            self._split(g.size, g.dtype, pieces,
                        lambda sl, _: be.sum_into(g[sl], [d[sl] for d in dense]))
        elif dense:
            be.sum_into(g, dense)
        else:
            g.fill(0)
        for idx, v in sparse:
            be.scatter_add(g, idx, v, unique=True)
        return g

    def _queue_rows(self, work: _Work, rows: RowBatch) -> dict:
        """The part's row gradients onto the message's rows batch; returns the tables touched."""
        touched = {}
        for key, grads in work.rsums.items():
            tbl = touched[key] = self.store.tables[key]
            for ids, vals, ts in grads:
                rows.add(tbl, ids, vals, ts)
            tbl.version += len(grads)
        return touched

    # -- decoding and acceptance -------------------------------------------------------------
    def _decode(self, desc, frame):
        """A pushed gradient as ``(indices or None, values)`` in the backend's memory: sparse
        chains are scatter-added, never densified, and the values are decoded by the backend
        (on a GPU from the coded bytes, so int8 or sign crosses as a quarter or a
        thirty-second of float32)."""
        idx, arrays, coder, dt, k = wire.decode_tensor_staged(desc, frame, self.max_tensor_bytes)
        return idx, self.backend.decode_values(arrays, coder, dt, k)

    def _accepted(self, desc, vals, ent: dict, pst: PartitionState):
        """A decoded gradient's values as they are to be summed: NOT_FINITE when it holds NaN
        or Inf (nan_policy refuse), None when it was applied before (a resend through a
        restarted broker), scaled by the entry's ``w`` (staleness-scaled step)."""
        if self.nan_policy == "refuse" and not values.all_finite(vals):
            raise WireError(Code.NOT_FINITE, f"{desc.key}: gradient has NaN or Inf")
        ident = _ident(ent, desc)
        if ident is not None and pst.seen(ident):
            self._skipped_duplicate()
            return None
        w = _weight(ent, vals.dtype)
        return vals if w is None else vals * device.array_module(vals).asarray(w)

    def _skipped_duplicate(self) -> None:
        """A gradient applied before (a resend through a restarted broker) was not again."""
        self.stats["duplicates_skipped"] = self.stats.get("duplicates_skipped", 0) + 1

    # -- buffers -----------------------------------------------------------------------------
    def _scratch_for(self, n: int, dtype, slot: int = 0) -> np.ndarray:
        """Scratch of ``n`` values of ``dtype``; ``slot``: one per piece of a split pass."""
        at = (dtype, slot) if slot else dtype
        buf = self._scratch.get(at)
        if buf is None or buf.size < n:
            buf = self._scratch[at] = self.backend.xp.empty(max(n, 1), dtype)
        return buf[:n]

    def _acc_for(self, key: str, like: np.ndarray) -> np.ndarray:
        """A reusable accumulator per block (sums never allocate after the first batch)."""
        buf = self._accs.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._accs[key] = self.backend.xp.empty_like(like)
        return buf

    def forget(self, keys) -> None:
        """Blocks dropped from the store: their accumulators go too."""
        for key in keys:
            self._accs.pop(key, None)

    def validate(self) -> None:
        """Accumulators only for blocks held."""
        stray = set(self._accs) - set(self.store.blocks)
        if stray:
            raise AssertionError(f"accumulators for blocks not held: {sorted(stray)}")
