"""Sparse embedding rows: one table's rows of one partition, their optimizer state and expiry.

A :class:`RowTable` maps int64 ids to float vectors of ``dim``. Rows are created by the first
gradient that reaches them (after a frequency filter, when ``min_count > 1``) and expire when
no gradient touched them for ``expiry`` seconds of batch time. The values live in arrays that
grow by doubling; a dict maps each id to its slot, and every step gathers the rows of a batch,
updates them in one vectorized pass and scatters them back.

An absent row reads as its initial value, and :func:`row_init` depends only on the rule, the
seed, the id and the column (a counter-based hash), so a row read before it exists equals the
row created later, on any replica, whatever the batching.

Nothing here reads a clock: every timestamp is the batch's, given by the caller, so replicas
that apply the same batches hold the same rows (:meth:`RowTable.digest_into` checks it).
"""
from __future__ import annotations

from itertools import repeat

import numpy as np

from gradbus.codecs.partition import GOLDEN, mix64

MAX_PENDING = 1 << 16      # ids counted by the frequency filter (per partition) before the
                           # oldest are forgotten: at most 16M per table over 256 partitions
MIN_CAPACITY = 16
INIT_CHUNK = 8192           # elements hashed at a time by row_init

STATE_NAMES = {"sgd": (), "adagrad": ("h",), "ftrl": ("z", "n")}
STAT_NAMES = ("rows_created", "rows_expired", "rows_filtered", "pending_forgotten")

_SEED_MUL = np.uint64(0xD6E8FEB86659FD93)
_S11 = np.uint64(11)


def _uniforms(ids: np.ndarray, seed: int, k: int) -> np.ndarray:
    """``[len(ids), k]`` float64 in [0, 1) from the top 53 bits of a hash of (seed, id, c) for
    column ``c``."""
    with np.errstate(over="ignore"):
        base = np.asarray(ids, np.int64).view(np.uint64) + np.uint64(seed) * _SEED_MUL
        mix64(base, np.empty_like(base))
        x = np.add(base[:, None], np.arange(1, k + 1, dtype=np.uint64) * GOLDEN)
    tmp = np.empty_like(x)
    mix64(x, tmp)
    x >>= _S11
    out = tmp.view(np.float64)
    return np.multiply(x.view(np.int64), 1.0 / (1 << 53), out=out)


def row_init(ids: np.ndarray, dim: int, rule: dict, dtype) -> np.ndarray:
    """Initial values ``[len(ids), dim]`` of the rows ``ids`` under ``rule``."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    dt = np.dtype(dtype)
    name = rule["name"]
    if name == "zeros":
        return np.zeros((len(ids), dim), dt)
    if name == "constant":
        return np.full((len(ids), dim), rule["value"], dt)
    if name not in ("normal", "uniform"):
        raise ValueError(f"unknown initializer {name!r}")
    out = np.empty((len(ids), dim), dt)
    step = max(1, INIT_CHUNK // max(dim, 1))   # bounded temporaries, reused between chunks
    for i in range(0, len(ids), step):
        out[i:i + step] = _random_rows(ids[i:i + step], dim, rule)
    return out


def _random_rows(ids: np.ndarray, dim: int, rule: dict) -> np.ndarray:
    """float64 rows of a ``normal`` or ``uniform`` rule."""
    seed = int(rule.get("seed", 0)) & 0xFFFFFFFFFFFFFFFF
    if rule["name"] == "uniform":
        low, high = float(rule["low"]), float(rule["high"])
        u = _uniforms(ids, seed, dim)
        u *= high - low
        u += low
        return np.minimum(u, high, out=u)
    # Box-Muller: columns 2p and 2p+1 are the cosine and sine of pair p, drawn from hash
    # columns 2p (radius) and 2p+1 (angle)
    pairs = (dim + 1) // 2
    u = _uniforms(ids, seed, 2 * pairs)
    r = np.sqrt(-2.0 * np.log(1.0 - u[:, 0::2]))      # 1 - u in (0, 1]: log is finite
    r *= float(rule["std"])
    angle = u[:, 1::2]
    cos = np.cos((2.0 * np.pi) * angle)
    sin = np.copysign(np.sqrt(np.maximum(1.0 - cos * cos, 0.0)), 0.5 - angle)
    mean = float(rule["mean"])
    u[:, 0::2] = r * cos + mean
    u[:, 1::2] = r * sin + mean
    return u[:, :dim]


def _optimizer(opt: dict) -> dict:
    """The optimizer's hyper-parameters with defaults filled in."""
    name = opt.get("name")
    if name == "sgd":
        if opt.get("momentum", 0):
            raise ValueError("sparse rows support sgd without momentum only")
        return {"name": name, "lr": float(opt["lr"])}
    if name == "adagrad":
        return {"name": name, "lr": float(opt["lr"]), "eps": float(opt.get("eps", 1e-10))}
    if name == "ftrl":
        return {"name": name, "lr": float(opt["lr"]), "beta": float(opt.get("beta", 1.0)),
                "l1": float(opt.get("l1", 0.0)), "l2": float(opt.get("l2", 0.0))}
    raise ValueError(f"unknown sparse optimizer {name!r}")


def _step(opt: dict, w: np.ndarray, g: np.ndarray, st: dict) -> None:
    """One optimizer step on gathered rows ``w`` with summed gradients ``g``, in place."""
    name, lr = opt["name"], opt["lr"]
    if name == "sgd":
        w -= lr * g
    elif name == "adagrad":
        h = st["h"]
        h += g * g
        w -= lr * g / (np.sqrt(h) + opt["eps"])
    else:
        z, n = st["z"], st["n"]
        g2 = g * g
        sqrt_n = np.sqrt(n)
        n += g2
        sqrt_new = np.sqrt(n)
        z += g - (sqrt_new - sqrt_n) / lr * w
        l1 = opt["l1"]
        with np.errstate(divide="ignore", invalid="ignore"):   # beta = 0 on a zero history
            w[...] = -(z - np.sign(z) * l1) / ((opt["beta"] + sqrt_new) / lr + opt["l2"])
        w[np.abs(z) <= l1] = 0


def _le(a: np.ndarray) -> bytes:
    """Bytes of ``a`` in little-endian order, whatever the host."""
    return np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()


class RowPool:
    """Storage shared by the :class:`RowTable` objects of one table on one shard: values,
    optimizer state and last-touch times in arrays that grow by doubling, and a free list.
    Sharing it lets one batch message update the rows of every partition it carries in one
    gather, one optimizer pass and one scatter."""

    def __init__(self, cfg: dict):
        self.dim = int(cfg["dim"])
        self.dtype = np.dtype(cfg.get("dtype", "float32"))
        self.rule = cfg["init"]
        self.opt = _optimizer(cfg["opt"])
        self.state_names = STATE_NAMES[self.opt["name"]]
        self._free: list[int] = []
        self._alloc(MIN_CAPACITY)

    def _alloc(self, cap: int) -> None:
        old = len(self.last) if hasattr(self, "last") else 0
        values = np.zeros((cap, self.dim), self.dtype)
        state = {k: np.zeros((cap, self.dim), self.dtype) for k in self.state_names}
        last = np.zeros(cap)
        if old:
            values[:old], last[:old] = self.values, self.last
            for k in self.state_names:
                state[k][:old] = self.state[k]
        self.values, self.state, self.last = values, state, last
        self._free.extend(range(cap - 1, old - 1, -1))    # low slots are handed out first

    def take(self, k: int) -> list[int]:
        """``k`` free slots (their contents are the caller's to set)."""
        if k > len(self._free):
            cap = len(self.last)
            need = cap - len(self._free) + k
            while cap < need:
                cap *= 2
            self._alloc(cap)
        out = self._free[-k:] if k else []
        del self._free[len(self._free) - k:]
        return out[::-1]

    def give(self, slots) -> None:
        self._free.extend(slots)

    @property
    def capacity(self) -> int:
        return len(self.last)

    def update(self, groups: list, grads: np.ndarray) -> None:
        """Apply one batch: ``groups`` is a list of ``(table, ids, seen, ts)`` with ``ids`` and
        ``seen`` plain lists (each table's ids unique), ``grads`` the rows of every group's ids,
        in order. Creates admitted rows, then one optimizer step on every row."""
        slots, keep, new_ids, new_slots, stamps = [], None, [], [], []
        pos = 0
        for tbl, ids, seen, ts in groups:
            get = tbl._slot.get
            sl = [get(i, -1) for i in ids]
            if -1 in sl:
                admit = tbl._admit([i for i, s in zip(ids, sl) if s < 0],
                                   [c for c, s in zip(seen, sl) if s < 0], ts)
                fresh = [i for i, a in zip((i for i, s in zip(ids, sl) if s < 0), admit) if a]
                got = self.take(len(fresh))
                tbl._slot.update(zip(fresh, got))
                tbl.stats["rows_created"] += len(fresh)
                new_ids += fresh
                new_slots += got
                it = iter(got)
                ai = iter(admit)
                full = []
                for s in sl:
                    full.append(s if s >= 0 else (next(it) if next(ai) else -1))
                if -1 in full:             # filtered ids: their gradients are dropped
                    if keep is None:
                        keep = list(range(pos))
                    keep += [pos + j for j, s in enumerate(full) if s >= 0]
                    full = [s for s in full if s >= 0]
                elif keep is not None:
                    keep += range(pos, pos + len(ids))
                sl = full
            elif keep is not None:
                keep += range(pos, pos + len(ids))
            pos += len(ids)
            slots += sl
            stamps.append((ts, len(sl)))
        if new_slots:
            ns = np.array(new_slots, np.int64)
            self.values[ns] = row_init(np.array(new_ids, np.int64), self.dim, self.rule,
                                       self.dtype)
            for arr in self.state.values():
                arr[ns] = 0
        if not slots:
            return
        idx = np.array(slots, np.int64)
        g = grads if keep is None else grads[np.array(keep, np.int64)]
        w = self.values[idx]
        st = {k: arr[idx] for k, arr in self.state.items()}
        _step(self.opt, w, np.asarray(g, self.dtype), st)
        self.values[idx] = w
        for k, arr in self.state.items():
            arr[idx] = st[k]
        if len(stamps) == 1:
            self.last[idx] = stamps[0][0]
        else:
            self.last[idx] = np.repeat([t for t, _ in stamps], [n for _, n in stamps])


class RowBatch:
    """The row gradients of one batch message, summed per row and applied together per
    table (:meth:`RowPool.update`). Entries of one table object must be added in batch order."""

    def __init__(self):
        self._entries: dict[int, list] = {}      # id(pool) -> [(table, ids, rows, ts)]

    def add(self, table: "RowTable", ids: np.ndarray, rows: np.ndarray, ts: float) -> None:
        self._entries.setdefault(id(table.pool), []).append((table, ids, rows, ts))

    def apply(self) -> None:
        for entries in self._entries.values():
            _apply_entries(entries)
        self._entries.clear()


def _apply_entries(entries: list) -> None:
    """Sum equal ids per table (in entry order), then one pool update per pool."""
    pool = entries[0][0].pool
    tables, index = [], {}
    for tbl, _, _, _ in entries:
        if id(tbl) not in index:
            index[id(tbl)] = len(tables)
            tables.append(tbl)
    ids = np.concatenate([e[1] for e in entries])
    rows = np.concatenate([e[2] for e in entries]) if len(entries) > 1 else entries[0][2]
    owner = np.repeat([index[id(e[0])] for e in entries], [len(e[1]) for e in entries])
    order = np.lexsort((ids, owner))               # by table, then id; stable for equal ids
    so, si = owner[order], ids[order]
    if len(si) == 0:
        return
    cut = np.flatnonzero(np.concatenate(([True], (si[1:] != si[:-1]) | (so[1:] != so[:-1]))))
    summed = np.add.reduceat(rows[order], cut, axis=0) if len(cut) < len(si) else rows[order]
    seen = np.diff(np.append(cut, len(si))).tolist()
    uo, ui = so[cut], si[cut].tolist()
    bounds = np.flatnonzero(np.concatenate(([True], uo[1:] != uo[:-1], [True]))).tolist()
    ts = {}
    for tbl, _, _, t in entries:
        ts[id(tbl)] = max(t, ts.get(id(tbl), t))
    groups = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        tbl = tables[int(uo[a])]
        groups.append((tbl, ui[a:b], seen[a:b], ts[id(tbl)]))
    pool.update(groups, summed)
    for tbl, _, _, t in groups:
        tbl._sweep(t)
        tbl._bound_pending()


class RowTable:
    """The rows of one embedding table that hash to one partition. Storage is a
    :class:`RowPool`, shared with the table's other partitions on the same shard (a table
    object made without one gets its own)."""

    def __init__(self, cfg: dict, pool: RowPool | None = None):
        self.cfg = dict(cfg)            # the table's settings, as the broker sent them
        self.pool = pool or RowPool(cfg)
        self.dim = self.pool.dim
        self.dtype = self.pool.dtype
        self.rule = cfg["init"]
        self.opt = self.pool.opt
        self.expiry = float(cfg.get("expiry", 0) or 0)
        self.min_count = int(cfg.get("min_count", 1) or 1)
        self.state_names = self.pool.state_names
        self.version = 0
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self._swept: float | None = None
        self._slot: dict[int, int] = {}
        self._pending: dict[int, tuple[int, float]] = {}

    # -- storage --------------------------------------------------------------------------
    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent."""
        return np.fromiter(map(self._slot.get, ids.tolist(), repeat(-1)), np.int64, len(ids))

    def release(self) -> None:
        """Give this table's slots back to the pool (the partition was dropped)."""
        self.pool.give(self._slot.values())
        self._slot = {}

    @property
    def rows(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        """Bytes of the live rows' values and optimizer state."""
        return len(self._slot) * self.dim * self.dtype.itemsize * (1 + len(self.state_names))

    @property
    def pending(self) -> int:
        """Ids counted by the frequency filter and not yet admitted."""
        return len(self._pending)

    # -- reads and updates ----------------------------------------------------------------
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (duplicates allowed) as a new ``[len(ids), dim]`` array; absent rows
        read as their initial values and are not created."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        slots = self._slots(ids)
        out = self.pool.values[np.maximum(slots, 0)]
        absent = slots < 0
        if absent.any():
            out[absent] = row_init(ids[absent], self.dim, self.rule, self.dtype)
        return out

    def _admit(self, ids: list, seen: list, ts: float) -> list:
        """Frequency filter for absent ``ids``: count their pushes; True where admitted now."""
        if self.min_count <= 1:
            return [True] * len(ids)
        pending, need = self._pending, self.min_count
        admit = []
        for i, s in zip(ids, seen):
            count = pending.pop(i, (0, 0.0))[0] + s
            if count >= need:
                admit.append(True)
            else:
                pending[i] = (count, ts)
                admit.append(False)
        self.stats["rows_filtered"] += admit.count(False)
        return admit

    def apply(self, ids: np.ndarray, grads: np.ndarray, seen: np.ndarray, ts: float) -> int:
        """One optimizer step per row on its summed gradient. ``ids`` unique, ``grads``
        ``[len(ids), dim]``, ``seen`` the pushes that carried each id, ``ts`` the batch's time.
        Returns the number of rows updated."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        grads = np.asarray(grads, self.dtype)
        seen = np.asarray(seen, np.int64).reshape(-1)
        ts = float(ts)
        if grads.shape != (len(ids), self.dim) or seen.shape != ids.shape:
            raise ValueError(f"apply: {len(ids)} ids need grads of shape {(len(ids), self.dim)} "
                             f"and {len(ids)} counts, got {grads.shape} and {seen.shape}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("apply: ids must be unique")
        before = self.stats["rows_filtered"]
        self.pool.update([(self, ids.tolist(), seen.tolist(), ts)], grads)
        self._sweep(ts)
        self._bound_pending()
        return len(ids) - (self.stats["rows_filtered"] - before)

    def _sweep(self, ts: float) -> None:
        """Drop rows and pending ids untouched for longer than ``expiry``."""
        if self.expiry <= 0 or (self._swept is not None and ts - self._swept < self.expiry / 8):
            return
        self._swept = ts
        cutoff = ts - self.expiry
        if self._slot:
            ids, slots = self._id_slots()
            old = self.pool.last[slots] < cutoff
            if old.any():
                gone = slots[old].tolist()
                for i in ids[old].tolist():
                    del self._slot[i]
                self.pool.give(gone)
                self.stats["rows_expired"] += len(gone)
        if self._pending:
            self._pending = {i: v for i, v in self._pending.items() if v[1] >= cutoff}

    def _bound_pending(self) -> None:
        """Above MAX_PENDING ids, forget the oldest (by last seen, then id) down to half."""
        if len(self._pending) <= MAX_PENDING:
            return
        ids, _, last = self._pending_arrays(sort=False)
        drop = len(ids) - MAX_PENDING // 2
        for i in ids[np.lexsort((ids, last))[:drop]].tolist():
            del self._pending[i]
        self.stats["pending_forgotten"] += drop

    def _pending_arrays(self, sort: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pending map as (ids, counts, last seen), by ascending id when ``sort``."""
        p = self._pending
        ids = np.fromiter(p.keys(), np.int64, len(p))
        counts = np.fromiter((v[0] for v in p.values()), np.int64, len(p))
        last = np.fromiter((v[1] for v in p.values()), np.float64, len(p))
        if sort:
            order = np.argsort(ids, kind="stable")
            ids, counts, last = ids[order], counts[order], last[order]
        return ids, counts, last

    # -- state transfer -------------------------------------------------------------------
    def _id_slots(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self._slot)
        return (np.fromiter(self._slot.keys(), np.int64, n),
                np.fromiter(self._slot.values(), np.int64, n))

    def _sorted_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of the live rows in ascending id order."""
        ids, slots = self._id_slots()
        order = np.argsort(ids, kind="stable")
        return ids[order], slots[order]

    def export(self) -> tuple[dict, list[tuple[str, np.ndarray]]]:
        """The full state: scalars and named arrays, rows and pending ids by ascending id."""
        ids, slots = self._sorted_rows()
        arrays = [("ids", ids), ("values", self.pool.values[slots])]
        arrays += [(k, self.pool.state[k][slots]) for k in self.state_names]
        arrays.append(("last", self.pool.last[slots]))
        pids, pcount, plast = self._pending_arrays()
        arrays += [("pending_ids", pids), ("pending_count", pcount), ("pending_last", plast)]
        scalars = {"version": self.version, "swept": self._swept, **self.stats}
        return scalars, arrays

    @classmethod
    def install(cls, cfg: dict, scalars: dict, arrays: dict[str, np.ndarray],
                pool: RowPool | None = None) -> RowTable:
        """A table rebuilt from :meth:`export`'s output (its rows stored in ``pool``);
        ValueError if it is inconsistent."""
        t = cls(cfg, pool)
        arrays = dict(arrays)
        t._install_scalars(scalars)
        expected = {"ids", "values", "last", "pending_ids", "pending_count", "pending_last",
                    *t.state_names}
        if set(arrays) != expected:
            raise ValueError(f"row table arrays must be {sorted(expected)}, got {sorted(arrays)}")
        ids = _checked(arrays, "ids", np.int64, None)
        n = len(ids)
        if n > 1 and not (np.diff(ids) > 0).all():
            raise ValueError("row ids must be strictly ascending")
        values = _checked(arrays, "values", t.dtype, (n, t.dim))
        state = {k: _checked(arrays, k, t.dtype, (n, t.dim)) for k in t.state_names}
        for k in ("h", "n"):
            if k in state and not (state[k] >= 0).all():
                raise ValueError(f"optimizer state {k!r} must be non-negative")
        last = _checked(arrays, "last", np.float64, (n,))
        if not np.isfinite(last).all():
            raise ValueError("row timestamps must be finite")
        t._install_pending(arrays, ids)
        got = t.pool.take(n)
        slots = np.array(got, np.int64)
        t.pool.values[slots], t.pool.last[slots] = values, last
        for k in t.state_names:
            t.pool.state[k][slots] = state[k]
        t._slot = dict(zip(ids.tolist(), got))
        return t

    def _install_scalars(self, scalars: dict) -> None:
        version, swept = scalars.get("version"), scalars.get("swept")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"row table version must be a non-negative int, got {version!r}")
        if swept is not None and (isinstance(swept, bool) or not isinstance(
                swept, (int, float, np.floating)) or not np.isfinite(swept)):
            raise ValueError(f"row table swept must be a finite number or None, got {swept!r}")
        self.version = int(version)
        self._swept = None if swept is None else float(swept)
        for k in STAT_NAMES:
            v = scalars.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"row table stat {k} must be a non-negative int, got {v!r}")
            self.stats[k] = int(v)

    def _install_pending(self, arrays: dict, row_ids: np.ndarray) -> None:
        pids = _checked(arrays, "pending_ids", np.int64, None)
        m = len(pids)
        count = _checked(arrays, "pending_count", np.int64, (m,))
        last = _checked(arrays, "pending_last", np.float64, (m,))
        if m and self.min_count <= 1:
            raise ValueError("pending ids given to a table without a frequency filter")
        if m > 1 and not (np.diff(pids) > 0).all():
            raise ValueError("pending ids must be strictly ascending")
        if m and ((count < 0).any() or (count >= self.min_count).any()):
            raise ValueError(f"pending counts must lie in [0, {self.min_count})")
        if not np.isfinite(last).all():
            raise ValueError("pending timestamps must be finite")
        if m and np.isin(pids, row_ids, assume_unique=True).any():
            raise ValueError("an id is both a row and pending")
        self._pending = dict(zip(pids.tolist(), zip(count.tolist(), last.tolist())))

    def digest_into(self, hsh) -> None:
        """Feed ``hsh`` (``update(bytes)``) the version, rows, state and pending ids, by id."""
        ids, slots = self._sorted_rows()
        pids, pcount, plast = self._pending_arrays()
        hsh.update(_le(np.array([self.version, len(ids), self.dim, len(pids)], np.int64)))
        hsh.update(_le(ids))
        hsh.update(_le(self.pool.values[slots]))
        for k in self.state_names:
            hsh.update(_le(self.pool.state[k][slots]))
        hsh.update(_le(self.pool.last[slots]))
        hsh.update(_le(pids))
        hsh.update(_le(pcount))
        hsh.update(_le(plast))


def _checked(arrays: dict, name: str, dtype, shape: tuple | None) -> np.ndarray:
    """``arrays[name]`` if it has ``dtype`` and ``shape`` (1-D of any length when None)."""
    a = np.asarray(arrays[name])
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"row table array {name!r}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if (a.ndim != 1) if shape is None else (a.shape != shape):
        want = "1-D" if shape is None else shape
        raise ValueError(f"row table array {name!r}: shape {a.shape}, expected {want}")
    return a
