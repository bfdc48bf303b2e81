"""The shard's state machine: fed decoded messages from the broker, returns messages to send.

No sockets here. :meth:`ShardCore.handle` takes the frames of one message (header first) and
returns a list of outgoing messages (each a list of frames) for the broker's backend.

A BATCH carries, per partition, the next sequenced group of entries. For each partition the shard
applies entries in order: INIT entries create blocks (a no-op if present); PUSH entries are decoded
(checksum verified), checked (known key, matching shape, finite values) and summed per key in
batch order; then each key's optimizer runs once on the sum, one pass. Every partition part, even
one whose entries all failed, produces one UPDATE for the events socket carrying the changed
blocks with ``(epoch, seq)``, so subscribers can detect gaps.
"""
from __future__ import annotations

import logging
import math

import numpy as np

import time

from gradbus.codecs import device, net, stats, wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import TensorLayout, row_key, split_row_key

from . import backend as backend_mod
from .rows import RowBatch, RowTable
from .store import ParameterStore

log = logging.getLogger("gradbus.shard")

NAN_POLICIES = ("refuse", "allow")


def _ident(ent: dict, desc) -> tuple | None:
    """A pushed gradient's identity, (client, msg, key), for skipping a resend; None when the
    entry carries no msg id."""
    return (ent.get("c"), ent["m"], desc.key) if "m" in ent else None


def _all_finite(vals) -> bool:
    """No NaN or Inf in ``vals`` (numpy or CuPy): one reduction first (a sum is finite when
    every value is), the exact check only when the sum is not."""
    xp = device.array_module(vals)
    return math.isfinite(xp.add.reduce(vals, axis=None)) or bool(xp.isfinite(vals).all())


def _weight(ent: dict, dtype) -> np.ndarray | None:
    """A push's staleness scale ``w`` (0 < w < 1) as a 0-d array of ``dtype``, else None."""
    w = ent.get("w")
    return np.asarray(w, dtype=dtype) if isinstance(w, float) and 0.0 < w < 1.0 else None


class ShardCore:
    def __init__(self, shard_id: str, *, weights_codec: str = "raw",
                 max_tensor_bytes: int = wire.MAX_TENSOR_BYTES, nan_policy: str = "refuse",
                 backend=None):
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}")
        self.delta, self.weights_chain = wire.split_weights_codec(weights_codec)
        self.shard_id = shard_id
        # Chosen (and any JIT compiled) here, before the shard's loop starts heartbeating.
        self.backend = backend or backend_mod.load()
        self.store = ParameterStore(self.backend)
        self._on_host = self.backend.xp is np   # raw/fp16/bf16 frames summed as they are read
        self.weights_codec = weights_codec
        self.max_tensor_bytes = max_tensor_bytes
        self.nan_policy = nan_policy
        self._scratch: dict[str, np.ndarray] = {}
        self._accs: dict[str, np.ndarray] = {}
        # Partitions this shard is catching up on (ADOPT seen, STATE not yet): batch parts for
        # them are kept, in order, and applied after the state is installed.
        self.installing: dict[int, list] = {}
        self.stats = {"batches": 0, "pushes_applied": 0, "pushes_refused": 0, "snapshots": 0,
                      "errors": 0, "syncs": 0, "states_sent": 0, "dropped": 0}
        self.h_apply = stats.Histogram()                     # seconds per batch message
        self.h_pushes = stats.Histogram(stats.COUNT_BUCKETS)  # gradients summed per key

    # -- entry point -------------------------------------------------------------------------
    def handle(self, frames: list, header: dict | None = None) -> list[list]:
        """Handle one message from the broker; return messages to send back. ``header``: the
        already unpacked and validated header frame, when the caller has it."""
        try:
            h = header or wire.unpack_header(frames[0], wire.SHARD_KINDS)
            descs = wire.parse_tensors(h, frames[1:], self.max_tensor_bytes)
        except WireError as e:
            self.stats["errors"] += 1
            log.warning("bad message from broker: %s", e)
            return [[wire.error(e.code, str(e.args[0]))]]
        kind = h["kind"]
        if kind == wire.BATCH:
            return [self._batch(h, descs, frames[1:])]
        if kind == wire.SNAPSHOT:
            return [self._snapshot(h)]
        if kind == wire.ROWS:
            return [self._rows(h)]
        if kind == wire.ADOPT:
            self.installing[int(h["p"])] = []
            return []
        if kind == wire.STATE_REQ:
            return [self._export(int(h["p"]), h["to"])]
        if kind == wire.STATE:
            return self._install(h, descs, frames[1:])
        if kind == wire.DROP:
            for p in h["ps"]:
                if isinstance(p, int):
                    self.installing.pop(p, None)
                    for key in self.store.drop(p):
                        self._accs.pop(key, None)
                    self.stats["dropped"] += 1
            return []
        if kind == wire.DIGEST:
            return [self._digest_reply(h)]
        return []  # REGISTERED / HEARTBEAT / ERROR are the loop's business

    # -- batches -----------------------------------------------------------------------------
    def _scratch_for(self, n: int, dtype) -> np.ndarray:
        buf = self._scratch.get(dtype.name)
        if buf is None or buf.size < n:
            buf = self._scratch[dtype.name] = self.backend.xp.empty(max(n, 1), dtype)
        return buf[:n]

    def _acc_for(self, key: str, like: np.ndarray) -> np.ndarray:
        """A reusable accumulator per block (sums never allocate after the first batch)."""
        buf = self._accs.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._accs[key] = self.backend.xp.empty_like(like)
        return buf

    def _batch(self, h: dict, descs, frames) -> list:
        t0 = time.perf_counter()
        out_parts, tail, done = [], [], []
        rows = RowBatch()     # every partition's table rows, updated together
        for part in h["parts"]:
            held = self.installing.get(int(part["p"]))
            if held is not None:   # catching up: apply after the state arrives
                held.append((part, descs, frames))
                continue
            done.append(self._apply_part(part, descs, frames, rows))
        rows.apply()
        for args in done:
            res, pub = self._result(*args)
            out_parts.append(res)
            tail.extend(pub)
        self.stats["batches"] += 1
        self.h_apply.observe(time.perf_counter() - t0)
        return [wire.pack(wire.APPLIED, parts=out_parts, shard=self.shard_id), *tail]

    def _apply_now(self, part, descs, frames):
        rows = RowBatch()
        args = self._apply_part(part, descs, frames, rows)
        rows.apply()
        return self._result(*args)

    def _apply_part(self, part, descs, frames, rows: RowBatch) -> tuple:
        """Apply one partition's part of a batch (table rows go to ``rows``, applied by the
        caller); returns the arguments of its :meth:`_result`."""
        p, seq, epoch = int(part["p"]), int(part["seq"]), int(part["epoch"])
        publish = part.get("o", self.shard_id) == self.shard_id
        pst = self.store.partition(p)
        errors: list = []
        changed: dict[str, object] = {}
        if seq <= pst.seq and epoch <= pst.epoch:
            # Re-delivery of a batch already applied: apply nothing, report success again.
            return p, seq, epoch, errors, {}, True, publish
        pst.seq, pst.epoch = seq, max(epoch, pst.epoch)
        sums: dict[str, list] = {}
        rsums: dict[str, list] = {}
        streams: dict[str, list] = {}
        for idx, ent in enumerate(part["e"]):
            try:
                op = ent.get("op")
                if op == "push" and descs[ent["i"]].ids is not None:
                    self._row_grad(descs[ent["i"]], frames[ent["i"]], ent, pst, rsums)
                elif op == "init" and "table" in ent:
                    self.store.create_table(ent["key"], p, ent["table"])
                elif op == "push":
                    i = ent["i"]
                    desc = descs[i]
                    blk = self.store.blocks.get(desc.key)
                    if blk is None:
                        raise WireError(Code.UNKNOWN_KEY, f"{desc.key} is not held here")
                    if desc.shape != (blk.value.size,) or np.dtype(desc.dtype) != blk.value.dtype:
                        raise WireError(Code.BAD_SHAPE,
                                        f"{desc.key}: gradient {desc.dtype}{list(desc.shape)} does "
                                        f"not match {blk.value.dtype}[{blk.value.size}]")
                    stream = (wire.stream_tensor(desc, frames[i], self.max_tensor_bytes)
                              if self._on_host else None)
                    if stream is not None:    # summed below, in one pass with its checksum
                        streams.setdefault(desc.key, []).append((idx, ent, desc, frames[i],
                                                                 stream))
                        continue
                    at, vals = self._decode(desc, frames[i])
                    vals = self._accepted(desc, vals, ent, pst)
                    if vals is not None:
                        sums.setdefault(desc.key, []).append((at, vals, desc.count, 1))
                elif op == "init":
                    layout = TensorLayout.from_wire(ent["layout"])
                    given = None
                    if ent.get("i", -1) >= 0:
                        i = ent["i"]
                        given = wire.decode_tensor(descs[i], frames[i], self.max_tensor_bytes)
                    blk, created = self.store.create(ent["key"], p, layout, ent["rule"], ent["opt"],
                                                     given)
                    if created:
                        changed[blk.key] = blk
                else:
                    raise WireError(Code.BAD_FIELD, f"unknown entry op {op!r}")
            except WireError as e:
                errors.append([idx, e.code.value, str(e.args[0])])
            except (KeyError, TypeError, ValueError, IndexError) as e:
                errors.append([idx, Code.BAD_FIELD.value, f"bad entry: {e}"])
        for key, items in streams.items():
            self._sum_streams(key, items, pst, sums, errors)
        applied = 0
        be = self.backend
        for key, grads in sums.items():
            n = sum(c for *_, c in grads)      # pushes summed
            self.h_pushes.observe(n)
            applied += n
            blk = self.store.blocks[key]
            dense = [be.asarray(v) for idx, v, _, _ in grads if idx is None]
            sparse = [(be.asarray(idx), be.asarray(v)) for idx, v, _, _ in grads
                      if idx is not None]
            k = sum(c for _, _, c, _ in grads)   # gradients summed, local steps included
            if len(dense) == 1 and not sparse:
                g = dense[0]
            elif not sparse and be.sums_in_step and len(dense) <= backend_mod.SUM_GROUP:
                g = dense       # summed inside the step's kernel: one pass for both
            else:   # the batch's sum in one pass over the dense ones, then the sparse added
                g = self._acc_for(key, blk.value)
                if dense:
                    be.sum_into(g, dense)
                else:
                    g.fill(0)
                for idx, v in sparse:
                    be.scatter_add(g, idx, v, unique=True)
            blk.rule.step(blk.value, g, k, blk.state,
                          self._scratch_for(blk.value.size, blk.value.dtype))
            blk.version += k
            changed[key] = blk
        touched = {}
        for key, grads in rsums.items():
            tbl = touched[key] = self.store.tables[key]
            for ids, vals, ts in grads:
                rows.add(tbl, ids, vals, ts)
            tbl.version += len(grads)
        applied += sum(len(g) for g in rsums.values())
        self.stats["pushes_applied"] += applied
        self.stats["pushes_refused"] += sum(1 for e in errors)
        return p, seq, epoch, errors, changed, False, publish, touched

    def _sum_streams(self, key: str, items: list, pst, sums: dict, errors: list) -> None:
        """A key's dense gradients whose frames decode piece by piece (raw, fp16, bf16): after
        the duplicates are skipped, each piece of every frame is checksummed, decoded, scaled
        and added into the key's accumulator while it is in cache, one pass over the frames
        where checking, decoding and summing apart take three. When a checksum does not match
        or the sum is not finite, the key's gradients go through :meth:`_accepted` one at a
        time instead, which refuses exactly the bad ones (the sum is the same either way)."""
        fresh, idents = [], set()
        for item in items:
            ident = _ident(item[1], item[2])
            if ident is not None:
                if ident in pst.recent or ident in idents:
                    self._skipped_duplicate()
                    continue
                idents.add(ident)
            fresh.append(item)
        if not fresh:
            return
        streams = [item[4] for item in fresh]
        if len(fresh) > 1 or streams[0].pieces.coder != "raw":   # one raw frame: used as it is
            acc = self._acc_for(key, self.store.blocks[key].value)
            n, dt = acc.size, acc.dtype
            step = self.backend.chunk_len(dt)
            scratch = self._scratch_for(2 * min(step, n), dt)
            s1, s2 = scratch[:min(step, n)], scratch[min(step, n):]
            ws = [_weight(item[1], dt) for item in fresh]
            # leading half-precision frames: each decoded and added in one pass (numba's loop)
            done = 0
            while done < len(streams) and streams[done].add_into(acc, not done, ws[done]):
                done += 1
            rest = list(zip(streams, ws))[done:]     # the others, a cache-sized piece at a time
            for lo in range(0, n, step) if rest else ():
                hi = min(lo + step, n)
                o = acc[lo:hi]
                for j, (stream, w) in enumerate(rest, done):
                    v = stream.read(lo, hi, s1)
                    if w is not None:
                        v = np.multiply(v, w, out=s2[:hi - lo])
                    if j:
                        np.add(o, v, out=o)
                    else:
                        np.copyto(o, v)
            if all(st.verified() for st in streams) and (
                    self.nan_policy != "refuse" or _all_finite(acc)):
                for ident in idents:
                    pst.seen(ident)
                # first: the sum below adds any other gradients of the key into this buffer
                sums.setdefault(key, []).insert(0, (None, acc, sum(item[2].count for item in
                                                                   fresh), len(fresh)))
                return
        for idx, ent, desc, frame, _ in fresh:
            try:
                at, vals = self._decode(desc, frame)
                vals = self._accepted(desc, vals, ent, pst)
            except WireError as e:
                errors.append([idx, e.code.value, str(e.args[0])])
                continue
            if vals is not None:
                sums.setdefault(key, []).append((at, vals, desc.count, 1))

    def _decode(self, desc, frame):
        """A pushed gradient as ``(indices or None, values)`` in the backend's memory: sparse
        chains are scatter-added, never densified, and the values are decoded by the backend
        (on a GPU from the coded bytes, so int8 or sign crosses as a quarter or a
        thirty-second of float32)."""
        idx, arrays, coder, dt, k = wire.decode_tensor_staged(desc, frame, self.max_tensor_bytes)
        return idx, self.backend.decode_values(arrays, coder, dt, k)

    def _accepted(self, desc, vals, ent: dict, pst):
        """A decoded gradient's values as they are to be summed: NOT_FINITE when it holds NaN
        or Inf (nan_policy refuse), None when it was applied before (a resend through a
        restarted broker), scaled by the entry's ``w`` (staleness-scaled step)."""
        if self.nan_policy == "refuse" and not _all_finite(vals):
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

    def _row_grad(self, desc, frame, ent: dict, pst, rsums: dict) -> None:
        """Check and decode one pushed rows frame; kept for the batch's sum per row."""
        tbl = self.store.tables.get(desc.key)
        if tbl is None:
            raise WireError(Code.UNKNOWN_KEY, f"{desc.key} is not held here")
        if desc.shape[1] != tbl.dim or desc.dtype != tbl.cfg["dtype"]:
            raise WireError(Code.BAD_SHAPE, f"{desc.key}: rows {desc.dtype}{list(desc.shape)} "
                                            f"do not match {tbl.dtype}[n, {tbl.dim}]")
        vals = self._accepted(desc, wire.decode_tensor(desc, frame, self.max_tensor_bytes)
                              .reshape(desc.shape), ent, pst)
        if vals is None:
            return
        ts = ent.get("ts", 0.0)
        rsums.setdefault(desc.key, []).append(
            (desc.row_ids(), vals, float(ts) if isinstance(ts, (int, float)) else 0.0))

    def _result(self, p, seq, epoch, errors, changed, duplicate=False, publish=True, rows=None):
        vers = {blk.key: blk.version for blk in changed.values()}
        res = {"p": p, "seq": seq, "epoch": epoch, "errors": errors, "vers": vers}
        if rows:    # a table's rows are read on request (ROWS), never published
            vers.update({key: tbl.version for key, tbl in rows.items()})
            res["tr"] = {split_row_key(key)[0]: [tbl.rows, tbl.nbytes]
                         for key, tbl in rows.items()}
        if duplicate:
            res["dup"] = True
        if not publish:   # a standby applies, the primary publishes
            res["n"] = -1
            return res, []
        descs, bufs = [], []
        for blk in changed.values():
            if self.delta:
                d, buf = self._encode_delta(blk, seq)
            else:
                host = self.backend.to_host(blk.value)
                d, buf = wire.encode_tensor(blk.key, host, self.weights_chain, blk.version)
                buf = net.detach(buf, host)   # the next step writes the block in place
            descs.append(d)
            bufs.append(buf)
        pub = wire.pack(wire.UPDATE, descs, p=p, seq=seq, epoch=epoch)
        res["n"] = len(bufs)
        return res, [pub, *bufs]

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

    def _host_copy(self, value):
        """A host array that no later step will write to (frames are sent zero-copy)."""
        host = self.backend.to_host(value)
        return host.copy() if host is value else host

    # -- snapshots ---------------------------------------------------------------------------
    def _snapshot(self, h: dict) -> list:
        self.stats["snapshots"] += 1
        descs, bufs, missing, parts = [], [], [], {}
        for key in h["keys"]:
            blk = self.store.blocks.get(key) if isinstance(key, str) else None
            if blk is None:
                missing.append(key)
                continue
            if self.delta and blk.published is not None:   # what subscribers' deltas build on
                d, buf = wire.encode_tensor(key, blk.published.copy(), "raw", blk.version)
                d["base"] = blk.pub_seq
            else:
                d, buf = wire.encode_tensor(key, self._host_copy(blk.value), "raw", blk.version)
            descs.append(d)
            bufs.append(buf)
            parts[blk.p] = self.store.partition(blk.p).seq
        fields = {k: h[k] for k in ("req", "client", "of") if k in h}
        return [wire.pack(wire.SNAPSHOT_REPLY, descs, parts=sorted(parts.items()), missing=missing,
                          **fields), *bufs]

    def _rows(self, h: dict) -> list:
        """Rows of a table, by partition: stored values, or for rows not created yet (never
        pushed, or filtered) their initial values. Never creates a row."""
        self.stats["row_reads"] = self.stats.get("row_reads", 0) + 1
        descs, bufs, missing = [], [], []
        for q in h["q"]:
            if not (isinstance(q, list) and len(q) == 2 and isinstance(q[0], int)
                    and isinstance(q[1], bytes) and len(q[1]) % 8 == 0):
                continue
            key = row_key(h["table"], q[0])
            tbl = self.store.tables.get(key)
            if tbl is None:
                missing.append(q[0])
                continue
            d, buf = wire.encode_tensor(key, tbl.lookup(wire.row_ids(q[1])),
                                        "raw", tbl.version)
            descs.append(d)
            bufs.append(buf)
        fields = {k: h[k] for k in ("req", "client", "of", "tv") if k in h}
        return [wire.pack(wire.ROWS_REPLY, descs, missing=missing, **fields), *bufs]

    # -- replication: a standby's catch-up ----------------------------------------------------
    def _export(self, p: int, to: str) -> list:
        """The whole state of partition ``p`` (values, optimizer state, versions, seq) for the
        standby ``to``: installed there, it equals this shard's state as of this seq."""
        pst = self.store.partition(p)
        metas, descs, bufs = [], [], []
        for key in sorted(pst.keys):
            blk = self.store.blocks[key]
            arrays = sorted(k for k, v in blk.state.items() if not isinstance(v, (int, float)))
            scalars = {k: v for k, v in blk.state.items() if isinstance(v, (int, float))}
            metas.append({"key": key, "layout": blk.layout.to_wire(), "opt": blk.opt,
                          "version": blk.version, "arrays": arrays, "scalars": scalars})
            for name, arr in [("", blk.value)] + [(a, blk.state[a]) for a in arrays]:
                d, buf = wire.encode_tensor(key, self._host_copy(arr), "raw")
                descs.append(d)
                bufs.append(buf)
        for key in sorted(pst.tables):
            scalars, arrays = self.store.tables[key].export()
            metas.append({"key": key, "table": self.store.tables[key].cfg, "scalars": scalars,
                          "arrays": [name for name, _ in arrays]})
            for _, arr in arrays:
                d, buf = wire.encode_tensor(key, np.ascontiguousarray(arr), "raw")
                descs.append(d)
                bufs.append(buf)
        self.stats["states_sent"] += 1
        return [wire.pack(wire.STATE, descs, p=p, to=to, seq=pst.seq, epoch=pst.epoch,
                          blocks=metas, recent=[list(r) for r in pst.recent]), *bufs]

    def _install(self, h: dict, descs, frames) -> list:
        """Replace partition ``p`` with the state a primary exported at seq S, then apply the
        batches held back since ADOPT (those after S); answer SYNCED."""
        p = int(h["p"])
        held = self.installing.pop(p, None)
        if held is None:
            log.warning("state for partition %d that was not adopted: ignored", p)
            return []
        seq = self.install_state(h, descs, frames)
        for part, bdescs, bframes in held:
            if int(part["seq"]) > seq:
                self._apply_now(part, bdescs, bframes)
        self.stats["syncs"] += 1
        return [[wire.pack(wire.SYNCED, p=p, seq=self.store.partition(p).seq)]]

    def install_state(self, h: dict, descs, frames) -> int:
        """Replace partition ``h['p']`` with an exported state (from a primary, or a
        checkpoint); returns its seq."""
        p, seq, epoch = int(h["p"]), int(h["seq"]), int(h["epoch"])
        for key in self.store.drop(p):
            self._accs.pop(key, None)
        pst = self.store.partition(p)
        pos = 0
        for meta in h["blocks"]:
            if "table" in meta:
                n = len(meta["arrays"])
                arrs = {name: np.array(wire.decode_tensor(d, f, self.max_tensor_bytes))
                        for name, d, f in zip(meta["arrays"], descs[pos:pos + n],
                                              frames[pos:pos + n])}
                pos += n
                pool = self.store.pool(meta["key"], meta["table"])
                self.store.install_table(meta["key"], p, RowTable.install(
                    meta["table"], meta["scalars"], arrs, pool))
                continue
            layout = TensorLayout.from_wire(meta["layout"])
            n = 1 + len(meta["arrays"])
            arrs = [wire.decode_tensor(d, f, self.max_tensor_bytes)
                    for d, f in zip(descs[pos:pos + n], frames[pos:pos + n])]
            pos += n
            blk, _ = self.store.create(meta["key"], p, layout, {"name": "given"}, meta["opt"],
                                       arrs[0])
            for name, arr in zip(meta["arrays"], arrs[1:]):
                blk.state[name][...] = self.backend.asarray(arr)
            blk.state.update(meta["scalars"])
            blk.version = int(meta["version"])
        pst.seq, pst.epoch = seq, epoch
        for r in h.get("recent") or []:
            if isinstance(r, list) and len(r) == 3:
                pst.recent[tuple(r)] = None
        return seq

    def states(self) -> list[list]:
        """Every settled partition's STATE message (for a checkpoint)."""
        return [self._export(p, "") for p in sorted(self.store.partitions)
                if p not in self.installing]

    def register_fields(self) -> dict:
        """What REGISTER tells the broker: the partitions held with their (epoch, seq), and
        the tensors and block versions they hold, so a restarted broker can rebuild its
        table and catalog from its shards."""
        st = self.store.partitions
        ps = [p for p in sorted(st) if p not in self.installing]
        tensors, blocks = {}, []
        for p in ps:
            for key in sorted(st[p].keys):
                blk = self.store.blocks[key]
                tensors.setdefault(blk.layout.name, {**blk.layout.to_wire(), "opt": blk.opt})
                blocks.append([key, blk.version])
            for key in sorted(st[p].tables):
                tbl, name = self.store.tables[key], split_row_key(key)[0]
                tensors.setdefault(name, {"name": name, "table": tbl.cfg})
                blocks.append([key, tbl.version])
        return {"holds": [[p, st[p].epoch, st[p].seq] for p in ps],
                "tensors": list(tensors.values()), "blocks": blocks}

    def partition_digest(self, p: int) -> str:
        """A hash of partition ``p``: every block's value, version and optimizer state."""
        import xxhash
        hsh = xxhash.xxh3_64()
        pst = self.store.partitions.get(p)
        for key in sorted(pst.keys if pst else ()):
            blk = self.store.blocks[key]
            hsh.update(key.encode())
            hsh.update(blk.version.to_bytes(8, "little"))
            hsh.update(self.backend.to_host(blk.value).tobytes())
            for name in sorted(blk.state):
                v = blk.state[name]
                hsh.update(name.encode())
                hsh.update(repr(v).encode() if isinstance(v, (int, float))
                           else self.backend.to_host(v).tobytes())
        for key in sorted(pst.tables if pst else ()):
            hsh.update(key.encode())
            self.store.tables[key].digest_into(hsh)
        return hsh.hexdigest()

    def _digest_reply(self, h: dict) -> list:
        ps = h.get("ps")
        ps = sorted(self.store.partitions) if not isinstance(ps, list) else [
            p for p in ps if isinstance(p, int) and p in self.store.partitions]
        parts = [[p, self.store.partitions[p].seq, self.partition_digest(p)] for p in ps
                 if p not in self.installing]
        fields = {k: h[k] for k in ("client", "of") if k in h}
        return [wire.pack(wire.DIGEST_REPLY, req=h["req"], shard=self.shard_id, parts=parts,
                          **fields)]

    # -- introspection -----------------------------------------------------------------------
    def info(self) -> dict:
        return {"keys": len(self.store.blocks), "bytes": self.store.nbytes,
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
            ("snapshots", "Snapshot requests served."),
            ("row_reads", "Table row reads served."),
            ("syncs", "Partitions installed from a primary's state (catch-up)."),
            ("states_sent", "Partition states exported to a catching-up standby."),
            ("checkpoints", "Checkpoints written."),
            ("errors", "Messages that failed validation or handling."))}
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
            "Gradients summed into one optimizer step of a block.", self.h_pushes)
        return m

    def digest(self, keys=None) -> str:
        """A hash of the held values, versions and partition seqs (equal state -> equal digest)."""
        import xxhash
        hsh = xxhash.xxh3_64()
        for key in sorted(keys if keys is not None else self.store.blocks):
            blk = self.store.blocks[key]
            hsh.update(key.encode())
            hsh.update(blk.version.to_bytes(8, "little"))
            hsh.update(self.backend.to_host(blk.value).tobytes())
        return hsh.hexdigest()
