"""The client's embedding-table calls (create, read and push rows), mixed into
:class:`~gradbus.workers.client.Client`: they plan with :mod:`.tables` and go through the
client's own request, credit and push paths.
"""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from gradbus.codecs import specs, wire
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.errors import Code, WireError, error_from
from gradbus.codecs.partition import row_key

from . import tables as rows_mod
from .commands import ReadRows


class TableMethods:
    """Needs from the class it is mixed into: ``_send_message``, ``_request``, ``_submit_push``,
    ``_check_open``, ``_lock``, ``_ids``, ``_rng``, ``_tables``, ``agent``, ``versions``,
    ``partitions``, ``timeout``, ``stats``."""

    # -- embedding tables -----------------------------------------------------------------
    def init_table(self, name: str, dim: int, initializer: specs.Initializer | None = None,
                   optimizer: specs.Optimizer | None = None, *, dtype: str = "float32",
                   expiry: float | None = None, min_count: int = 1,
                   consistency: str | None = None, stale_policy: str = "refuse",
                   scale_lr: bool = False, spread: int = 0,
                   timeout: float | None = None) -> None:
        """Create an embedding table (a no-op when it exists with the same dim and dtype).

        Rows are int64 ids, each a vector of ``dim``; a row is created by the first push that
        touches it, on the shard owning its partition, so the table spreads over every shard.
        A row not created yet reads as its initial value (``initializer``, default
        ``Normal(std=0.01)``; random rules are a function of the seed and the row id).
        ``optimizer``: ``SGD`` (no momentum), ``Adagrad`` (default, lr 0.05) or ``FTRL``.
        ``expiry``: seconds after which a row no push touched is dropped (off by default).
        ``min_count``: a row is created only once ``min_count`` pushes carried its id; the
        gradients before that are dropped (off by default). ``consistency``: ``"async"``
        (default) or ``"ssp:S"``: a push of rows read more than S table versions (pushes
        applied to the table) ago fails with StaleError; ``scale_lr`` scales each by
        1/staleness. Reads are always current, so ``stale_policy="delay"`` never waits.
        ``"bsp:N"``: a push is applied once N workers' pushes (or every connected worker's)
        for the step are in, and a read after a push waits until that step is applied.
        ``spread``: the number of partitions the rows are placed in (0, the default: all of
        them); fewer partitions mean fewer, larger messages per push and read, and so more
        rows per second, as long as they still cover the shards."""
        if not isinstance(name, str) or not name or "#" in name:
            raise ValueError(f"table names must be non-empty strings without '#', got {name!r}")
        init = (initializer or specs.Normal(std=0.01)).to_wire()
        opt = (optimizer or specs.Adagrad(lr=0.05)).to_wire()
        try:
            cons = specs.parse_consistency(consistency, stale_policy, scale_lr)
            cfg = specs.table_from_wire({"dim": dim, "dtype": dtype, "init": init, "opt": opt,
                                         "expiry": float(expiry or 0.0), "min_count": min_count,
                                         "cons": cons, "spread": spread})
        except WireError as e:
            raise ValueError(f"table {name}: {e.args[0]}") from None
        fut: Future = Future()
        self._send_message(lambda msg: [wire.pack(wire.INIT, msg=msg, opt=opt, tensors=[],
                                                  tables=[{"name": name, **cfg}])], fut)
        fut.result(timeout or self.timeout)
        self._tables.pop(name, None)     # an existing table keeps its own settings
        self._table(name)

    def _table(self, name: str) -> dict:
        cfg = self._tables.get(name)
        if cfg is None:
            for t in self._request(wire.CATALOG, names=[name]).get("tables") or []:
                if isinstance(t, dict) and t.get("name") == name:
                    cfg = self._tables[name] = specs.table_from_wire(t)
            if cfg is None:
                raise error_from(Code.UNKNOWN_KEY.value, f"no such table: {name}")
        return cfg

    def pull_rows(self, name: str, ids, timeout: float | None = None) -> np.ndarray:
        """The rows ``ids`` (any integer array) of table ``name``, shape ``ids.shape + (dim,)``,
        read from their shards (one round trip per shard). Rows not created yet read as their
        initial value. A read sees every push this client sent before it."""
        cfg = self._table(name)
        shape = np.shape(ids)
        flat = rows_mod.as_ids(ids)
        uniq, inv, reqs = rows_mod.read_plan(name, flat, self.partitions, cfg["dim"]
                                             * tcodec.DTYPES[cfg["dtype"]].itemsize, cfg["spread"])
        # bsp: after a push, the broker holds the read until the step is applied
        bsp_next = self.versions.bsp_next
        step = {"min": bsp_next[name]} if name in bsp_next else {}
        futs = []
        for q, _ in reqs:
            fut: Future = Future()
            with self._lock:
                self._check_open()
                req = next(self._ids)
                self.agent.submit(ReadRows(req, [wire.pack(wire.ROWS, req=req, table=name,
                                                           q=q, **step)], fut))
            futs.append(fut)
        t = self.timeout if timeout is None else timeout
        replies = [f.result(t) for f in futs]
        if replies:
            self.versions.pulled[name] = min(tv for _, tv in replies)
        out = rows_mod.assemble(name, uniq, reqs, [r for r, _ in replies], cfg["dim"],
                                cfg["dtype"])
        self.stats["rows_read"] += len(uniq)
        return out[inv].reshape(*shape, cfg["dim"])

    def push_rows(self, name: str, ids, grads, codec: str | None = None, acks: int | str = 1,
                  timeout: float | None = None) -> Future:
        """Send gradients for rows ``ids`` of table ``name`` (``grads``: one row of ``dim``
        per id; duplicate ids are summed). Returns a Future, like :meth:`push`; the shards
        apply one optimizer step per row on the sum of the gradients a batch holds for it.
        ``codec``: a dense chain (``raw``, ``bf16``, ``fp16``, ``int8``, ``|zstd``); rows
        get no error feedback."""
        if acks == "all":
            acks = wire.ACKS_ALL
        elif acks not in (0, 1):
            raise ValueError(f"acks must be 0, 1 or 'all', not {acks!r}")
        chain = codec or "raw"
        if tcodec.parse_stages(chain).sparsifier is not None:   # raises on a bad chain
            raise ValueError(f"rows take a dense codec chain, not {chain!r}")
        cfg = self._table(name)
        flat = rows_mod.as_ids(ids)
        g = np.asarray(grads)
        if g.size != len(flat) * cfg["dim"] or (g.ndim >= 1 and g.shape[-1] != cfg["dim"]):
            raise ValueError(f"{name}: {len(flat)} ids need gradients of shape "
                             f"[{len(flat)}, {cfg['dim']}], got {g.shape}")
        g = g.astype(cfg["dtype"], copy=False).reshape(len(flat), cfg["dim"])
        if not len(flat):
            done: Future = Future()
            done.set_result(None)
            return done
        uniq, summed = rows_mod.sum_duplicates(flat, g)
        descs, bufs = [], []
        for p, where in rows_mod.by_partition(name, uniq, self.partitions, cfg["spread"]):
            d, buf = wire.encode_tensor(row_key(name, p), np.ascontiguousarray(summed[where]),
                                        chain, rng=self._rng)
            d["ids"] = uniq[where].tobytes()
            descs.append(d)
            bufs.append(buf)
        modeled = cfg["cons"]["mode"] != "async"    # say which version the rows were read at
        ver = max(0, self.versions.pulled.get(name, 0))
        fut = self._submit_push(descs, bufs, acks, timeout, {"ver": ver} if modeled else {})
        if cfg["cons"]["mode"] == "bsp":
            self.versions.bsp_next[name] = ver + 1       # the next read waits for the step
        self.stats["rows_pushed"] += len(uniq)
        self.stats["push_raw_bytes"] += summed.nbytes
        return fut
