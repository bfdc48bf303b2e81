"""Sparse embedding rows: deterministic initialisation, the optimizers against a per-row
reference, the frequency filter, expiry, the pending bound and state transfer."""
from __future__ import annotations

import math

import numpy as np
import pytest
import xxhash

from gradbus.shards import rows
from gradbus.shards.rows import RowTable, row_init

NORMAL = {"name": "normal", "mean": 0.5, "std": 2.0, "seed": 7}
UNIFORM = {"name": "uniform", "low": -0.25, "high": 0.75, "seed": 11}
OPTS = {
    "sgd": {"name": "sgd", "lr": 0.1},
    "adagrad": {"name": "adagrad", "lr": 0.2, "eps": 1e-6},
    "ftrl": {"name": "ftrl", "lr": 0.3, "beta": 1.0, "l1": 0.0, "l2": 0.0},
    "ftrl_l1_l2": {"name": "ftrl", "lr": 0.3, "beta": 0.5, "l1": 0.05, "l2": 0.1},
}


def cfg(opt="sgd", dim=5, dtype="float64", init=NORMAL, expiry=0.0, min_count=1) -> dict:
    return {"dim": dim, "dtype": dtype, "init": init, "opt": OPTS[opt] if isinstance(opt, str) else opt,
            "expiry": expiry, "min_count": min_count}


def digest(table: RowTable) -> int:
    h = xxhash.xxh3_64()
    table.digest_into(h)
    return h.intdigest()


def batch(rng, pool: np.ndarray, n: int, dim: int):
    ids = rng.choice(pool, n, replace=False).astype(np.int64)
    return ids, rng.normal(0, 1, (n, dim)), np.ones(n, np.int64)


# -- row_init ------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", [NORMAL, UNIFORM], ids=["normal", "uniform"])
def test_row_init_depends_only_on_id_and_column(rule):
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(-2**63, 2**63 - 1, 200, dtype=np.int64),
                          np.arange(-5, 5, dtype=np.int64)])
    whole = row_init(ids, 9, rule, np.float64)
    assert whole.shape == (len(ids), 9)
    assert np.array_equal(whole, row_init(ids, 9, rule, np.float64)), "not repeatable"
    perm = rng.permutation(len(ids))
    assert np.array_equal(whole[perm], row_init(ids[perm], 9, rule, np.float64)), "order"
    for j in (0, 17, len(ids) - 1):
        assert np.array_equal(whole[j:j + 1], row_init(ids[j:j + 1], 9, rule, np.float64))
    # a column's value does not depend on how many columns the row has
    assert np.array_equal(whole[:, :4], row_init(ids, 4, rule, np.float64))
    # the table's dtype is a rounding of the same values
    assert np.array_equal(whole.astype(np.float32), row_init(ids, 9, rule, np.float32))
    # distinct ids get distinct rows
    assert len(np.unique(whole[:, 0])) == len(ids)


def test_row_init_normal_statistics():
    z = row_init(np.arange(4000, dtype=np.int64) * 977, 32, NORMAL, np.float64)
    assert abs(z.mean() - 0.5) < 0.03
    assert abs(z.std() - 2.0) < 0.03
    frac_tail = np.mean(np.abs(z - 0.5) > 1.96 * 2.0)
    assert abs(frac_tail - 0.05) < 0.005
    # columns are uncorrelated (within pairs sharing a Box-Muller draw, and across pairs)
    for a, b in ((0, 1), (2, 3), (0, 5)):
        assert abs(np.corrcoef(z[:, a], z[:, b])[0, 1]) < 0.06


def test_row_init_uniform_bounds_and_mean():
    u = row_init(np.arange(-3000, 3000, dtype=np.int64), 16, UNIFORM, np.float32)
    assert u.dtype == np.float32
    assert u.min() >= -0.25 and u.max() <= 0.75
    assert abs(float(u.mean()) - 0.25) < 0.01
    assert abs(float(u.std()) - 1.0 / math.sqrt(12)) < 0.01


def test_row_init_seeds_differ_and_fixed_rules_are_exact():
    ids = np.arange(100, dtype=np.int64)
    a = row_init(ids, 8, NORMAL, np.float64)
    b = row_init(ids, 8, {**NORMAL, "seed": 8}, np.float64)
    assert not np.any(a == b)
    assert np.array_equal(row_init(ids, 8, {"name": "zeros"}, np.float32),
                          np.zeros((100, 8), np.float32))
    c = row_init(ids, 8, {"name": "constant", "value": 0.125}, np.float64)
    assert c.dtype == np.float64 and np.all(c == 0.125)
    assert row_init(np.zeros(0, np.int64), 8, NORMAL, np.float32).shape == (0, 8)
    with pytest.raises(ValueError):
        row_init(ids, 8, {"name": "orthogonal"}, np.float64)


def test_row_init_large_batch_runs():
    # sanity only: 1024 ids x 64 columns, both random rules (no timing assertion)
    ids = np.arange(1024, dtype=np.int64) * 31
    for rule in (NORMAL, UNIFORM):
        for _ in range(5):
            assert row_init(ids, 64, rule, np.float32).shape == (1024, 64)


# -- optimizers against a per-row reference -------------------------------------------------

def ref_step(opt: dict, w: list, g: np.ndarray, st: dict) -> None:
    """One step of ``opt`` on one row, coordinate by coordinate in Python floats."""
    lr = opt["lr"]
    for c in range(len(w)):
        gc = float(g[c])
        if opt["name"] == "sgd":
            w[c] -= lr * gc
        elif opt["name"] == "adagrad":
            st["h"][c] += gc * gc
            w[c] -= lr * gc / (math.sqrt(st["h"][c]) + opt["eps"])
        else:
            n, z = st["n"][c], st["z"][c]
            sigma = (math.sqrt(n + gc * gc) - math.sqrt(n)) / lr
            z += gc - sigma * w[c]
            n += gc * gc
            st["n"][c], st["z"][c] = n, z
            if abs(z) <= opt["l1"]:
                w[c] = 0.0
            else:
                sign = 1.0 if z > 0 else -1.0
                w[c] = -(z - sign * opt["l1"]) / ((opt["beta"] + math.sqrt(n)) / lr + opt["l2"])


class Reference:
    """Rows as Python lists, stepped one row at a time."""

    def __init__(self, c: dict):
        self.c, self.rows, self.state = c, {}, {}

    def apply(self, ids, grads):
        opt, dim = self.c["opt"], self.c["dim"]
        for i, g in zip(ids.tolist(), grads):
            if i not in self.rows:
                self.rows[i] = row_init(np.array([i]), dim, self.c["init"], np.float64)[0].tolist()
                self.state[i] = {k: [0.0] * dim for k in ("h", "z", "n")}
            ref_step(opt, self.rows[i], g, self.state[i])

    def lookup(self, ids):
        init = row_init(ids, self.c["dim"], self.c["init"], np.float64)
        return np.array([self.rows.get(i, init[j]) for j, i in enumerate(ids.tolist())])


@pytest.mark.parametrize("opt", sorted(OPTS))
def test_optimizer_matches_per_row_reference(opt):
    rng = np.random.default_rng(1)
    c = cfg(opt)
    table, ref = RowTable(c), Reference(c)
    pool = np.arange(-30, 30, dtype=np.int64) * 1_000_003
    for step in range(12):
        ids, grads, seen = batch(rng, pool, int(rng.integers(1, 40)), c["dim"])
        grads *= 0.2 if opt == "ftrl_l1_l2" else 1.0
        assert table.apply(ids, grads, seen, float(step)) == len(ids)
        ref.apply(ids, grads)
    assert table.rows == len(ref.rows)
    np.testing.assert_allclose(table.lookup(pool), ref.lookup(pool), rtol=1e-10, atol=1e-12)
    if opt.startswith("ftrl"):
        _, arrays = table.export()
        arrays = dict(arrays)
        want_z = np.array([ref.state[i]["z"] for i in arrays["ids"].tolist()])
        want_n = np.array([ref.state[i]["n"] for i in arrays["ids"].tolist()])
        np.testing.assert_allclose(arrays["z"], want_z, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(arrays["n"], want_n, rtol=1e-10, atol=1e-12)


def test_optimizer_float32_table_tracks_float64_reference():
    rng = np.random.default_rng(2)
    c = cfg("adagrad", dim=6, dtype="float32")
    table, ref = RowTable(c), Reference({**c, "dtype": "float64"})
    pool = np.arange(50, dtype=np.int64)
    for step in range(8):
        ids, grads, seen = batch(rng, pool, 30, 6)
        grads = grads.astype(np.float32)
        table.apply(ids, grads, seen, float(step))
        ref.apply(ids, grads)
    out = table.lookup(pool)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref.lookup(pool), rtol=1e-4, atol=1e-5)


def test_ftrl_l1_gives_exact_zeros_where_z_is_small():
    rng = np.random.default_rng(3)
    l1 = 0.5
    c = cfg({"name": "ftrl", "lr": 0.1, "l1": l1}, dim=8)
    table = RowTable(c)
    ids = np.arange(200, dtype=np.int64)
    for step in range(3):
        table.apply(ids, rng.normal(0, 0.4, (200, 8)), np.ones(200, np.int64), float(step))
    _, arrays = table.export()
    arrays = dict(arrays)
    small = np.abs(arrays["z"]) <= l1
    assert small.any() and (~small).any(), "want both regimes in the data"
    assert np.all(arrays["values"][small] == 0.0)
    assert np.all(arrays["values"][~small] != 0.0)
    assert np.all(np.sign(arrays["values"][~small]) == -np.sign(arrays["z"][~small]))


# -- lookup --------------------------------------------------------------------------------

def test_lookup_absent_reads_init_without_creating_rows():
    table = RowTable(cfg("sgd", dim=4))
    ids = np.array([3, -9, 2**40], np.int64)
    out = table.lookup(ids)
    assert np.array_equal(out, row_init(ids, 4, NORMAL, np.float64))
    assert table.rows == 0 and table.nbytes == 0 and table.stats["rows_created"] == 0
    out[:] = 99.0           # a new array: writing it leaves the table alone
    assert np.array_equal(table.lookup(ids), row_init(ids, 4, NORMAL, np.float64))
    assert table.lookup(np.zeros(0, np.int64)).shape == (0, 4)


def test_lookup_after_apply_and_duplicates():
    table = RowTable(cfg("sgd", dim=4))
    g = np.arange(8, dtype=np.float64).reshape(2, 4)
    table.apply(np.array([5, 6], np.int64), g, np.ones(2, np.int64), 1.0)
    init = row_init(np.array([5, 6, 7], np.int64), 4, NORMAL, np.float64)
    out = table.lookup(np.array([6, 7, 5, 6, 7], np.int64))
    assert np.allclose(out[0], init[1] - 0.1 * g[1])
    assert np.allclose(out[2], init[0] - 0.1 * g[0])
    assert np.array_equal(out[0], out[3]), "a duplicate id reads the same row"
    assert np.array_equal(out[1], init[2]) and np.array_equal(out[4], init[2])
    assert table.rows == 2


def test_apply_rejects_bad_batches():
    table = RowTable(cfg("sgd", dim=4))
    ones = np.ones(2, np.int64)
    with pytest.raises(ValueError, match="unique"):
        table.apply(np.array([1, 1], np.int64), np.zeros((2, 4)), ones, 0.0)
    with pytest.raises(ValueError, match="shape"):
        table.apply(np.array([1, 2], np.int64), np.zeros((2, 3)), ones, 0.0)
    with pytest.raises(ValueError):
        table.apply(np.array([1, 2], np.int64), np.zeros((2, 4)), np.ones(3, np.int64), 0.0)
    assert table.rows == 0


# -- frequency filter ----------------------------------------------------------------------

def test_frequency_filter_admits_on_the_push_that_reaches_min_count():
    table = RowTable(cfg("sgd", dim=3, min_count=3))
    init = row_init(np.array([7, 8, 9], np.int64), 3, NORMAL, np.float64)
    g = np.ones((1, 3))
    one = np.ones(1, np.int64)

    assert table.apply(np.array([7], np.int64), g, one, 0.0) == 0
    assert table.apply(np.array([7], np.int64), g, one, 1.0) == 0
    assert table.rows == 0 and table.pending == 1
    assert np.array_equal(table.lookup(np.array([7])), init[:1]), "filtered gradients dropped"
    assert table.stats["rows_filtered"] == 2

    # the third push admits id 7 and applies only its own gradient
    assert table.apply(np.array([7], np.int64), 2 * g, one, 2.0) == 1
    assert np.allclose(table.lookup(np.array([7])), init[:1] - 0.1 * 2)
    assert table.rows == 1 and table.pending == 0 and table.stats["rows_created"] == 1

    # seen counts pushes: id 8 carried by 2 pushes then 1; id 9 by 3 pushes in one batch
    ids = np.array([8, 9], np.int64)
    assert table.apply(ids, np.ones((2, 3)), np.array([2, 3], np.int64), 3.0) == 1
    assert np.array_equal(table.lookup(ids[:1]), init[1:2])
    assert np.allclose(table.lookup(ids[1:]), init[2:] - 0.1)
    assert table.apply(ids, np.ones((2, 3)), np.array([1, 1], np.int64), 4.0) == 2
    assert np.allclose(table.lookup(ids), init[1:] - 0.1 * np.array([[1.0], [2.0]]))
    assert table.stats["rows_filtered"] == 3 and table.rows == 3


def test_no_filter_admits_everything_without_pending():
    table = RowTable(cfg("sgd", dim=2, min_count=1))
    table.apply(np.arange(10, dtype=np.int64), np.ones((10, 2)), np.ones(10, np.int64), 0.0)
    assert table.rows == 10 and table.pending == 0 and table.stats["rows_filtered"] == 0


# -- expiry --------------------------------------------------------------------------------

def test_expiry_drops_untouched_rows_and_keeps_touched_ones():
    table = RowTable(cfg("adagrad", dim=3, expiry=10.0))
    g, init = np.ones((2, 3)), row_init(np.arange(4, dtype=np.int64), 3, NORMAL, np.float64)
    table.apply(np.array([1, 2], np.int64), g, np.ones(2, np.int64), 0.0)
    table.apply(np.array([2], np.int64), g[:1], np.ones(1, np.int64), 5.0)
    before = table.lookup(np.array([2], np.int64))
    table.apply(np.array([3], np.int64), g[:1], np.ones(1, np.int64), 12.0)   # cutoff 2
    assert table.rows == 2 and table.stats["rows_expired"] == 1
    assert np.array_equal(table.lookup(np.array([1], np.int64)), init[1:2]), "row 1 expired"
    assert np.array_equal(table.lookup(np.array([2], np.int64)), before), "row 2 kept"
    # an expired row comes back fresh: value and optimizer state from scratch
    table.apply(np.array([1], np.int64), g[:1], np.ones(1, np.int64), 13.0)
    fresh = RowTable(cfg("adagrad", dim=3))
    fresh.apply(np.array([1], np.int64), g[:1], np.ones(1, np.int64), 0.0)
    assert np.array_equal(table.lookup(np.array([1])), fresh.lookup(np.array([1])))
    assert table.stats["rows_created"] == 4


def test_expiry_sweeps_at_most_every_eighth_of_expiry():
    table = RowTable(cfg("sgd", dim=2, expiry=8.0))
    one = np.ones(1, np.int64)
    table.apply(np.array([1], np.int64), np.ones((1, 2)), one, 0.0)      # first sweep at ts 0
    table.apply(np.array([2], np.int64), np.ones((1, 2)), one, 8.5)      # sweeps: cutoff 0.5
    assert table.rows == 1
    table.apply(np.array([3], np.int64), np.ones((1, 2)), one, 9.0)
    table.apply(np.array([4], np.int64), np.ones((1, 2)), one, 17.0)     # cutoff 9: 2 goes
    assert sorted(dict(table.export()[1])["ids"].tolist()) == [3, 4]
    table.apply(np.array([5], np.int64), np.ones((1, 2)), one, 17.9)     # < 1 since last sweep
    assert table.rows == 3, "no sweep within expiry/8 of the last one"
    assert table.stats["rows_expired"] == 2


def test_expiry_forgets_pending_ids():
    table = RowTable(cfg("sgd", dim=2, expiry=10.0, min_count=2))
    one = np.ones(1, np.int64)
    table.apply(np.array([1], np.int64), np.ones((1, 2)), one, 0.0)
    assert table.pending == 1
    table.apply(np.array([2], np.int64), np.ones((1, 2)), one, 20.0)
    assert dict(table.export()[1])["pending_ids"].tolist() == [2]
    table.apply(np.array([1], np.int64), np.ones((1, 2)), one, 21.0)
    assert table.rows == 0, "id 1's earlier push was forgotten"


def test_expiry_of_most_rows_compacts_storage():
    table = RowTable(cfg("sgd", dim=4, dtype="float32", expiry=100.0))
    n = 20_000
    ids = np.arange(n, dtype=np.int64) * 3
    g = np.ones((n, 4), np.float32)
    table.apply(ids, g, np.ones(n, np.int64), 0.0)
    keep = ids[::50]
    table.apply(keep, g[:len(keep)], np.ones(len(keep), np.int64), 60.0)
    table.apply(np.zeros(0, np.int64), np.zeros((0, 4), np.float32), np.zeros(0, np.int64),
                150.0)
    assert table.rows == len(keep) and table.stats["rows_expired"] == n - len(keep)
    init = row_init(keep, 4, NORMAL, np.float32)
    np.testing.assert_allclose(table.lookup(keep), init - np.float32(0.2), rtol=1e-6, atol=1e-6)
    assert table.nbytes == len(keep) * 4 * 4


# -- pending bound -------------------------------------------------------------------------

def test_pending_bound_forgets_the_oldest(monkeypatch):
    monkeypatch.setattr(rows, "MAX_PENDING", 8)
    table = RowTable(cfg("sgd", dim=2, min_count=5))
    one = np.ones(1, np.int64)
    for i in range(10):
        table.apply(np.array([i], np.int64), np.ones((1, 2)), one, float(i))
    # 9 pending > 8 after ts 8: the 5 oldest went, leaving 4; then id 9 joined
    assert table.stats["pending_forgotten"] == 5
    _, arrays = table.export()
    arrays = dict(arrays)
    assert arrays["pending_ids"].tolist() == [5, 6, 7, 8, 9]
    assert arrays["pending_last"].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]
    # id 0's count restarted: 4 more pushes are not enough; id 5's were kept: 4 more admit it
    table.apply(np.array([0, 5], np.int64), np.ones((2, 2)), np.array([4, 4]), 10.0)
    assert table.rows == 1
    assert table.lookup(np.array([0, 5], np.int64)).tolist()[0] == \
        row_init(np.array([0]), 2, NORMAL, np.float64)[0].tolist()


# -- export / install / digest -------------------------------------------------------------

def _busy_table(c: dict, seed: int = 4, steps: int = 10) -> RowTable:
    rng = np.random.default_rng(seed)
    table = RowTable(c)
    pool = np.arange(-40, 40, dtype=np.int64) * 7
    for step in range(steps):
        ids, grads, _ = batch(rng, pool, 25, c["dim"])
        seen = rng.integers(1, 3, len(ids))
        table.apply(ids, grads, seen, float(step))
        table.version += 1
    return table


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "ftrl_l1_l2"])
def test_export_install_round_trip(opt):
    c = cfg(opt, dim=4, dtype="float32", expiry=6.0, min_count=3)
    table = _busy_table(c)
    assert table.rows > 0 and table.pending > 0 and table.stats["rows_expired"] > 0
    scalars, arrays = table.export()
    ids = dict(arrays)["ids"]
    assert np.all(np.diff(ids) > 0), "rows exported by ascending id"
    copy = RowTable.install(c, scalars, dict(arrays))
    assert digest(copy) == digest(table)
    assert copy.version == table.version and copy.stats == table.stats
    assert copy.rows == table.rows and copy.nbytes == table.nbytes
    probe = np.arange(-300, 300, dtype=np.int64)
    assert np.array_equal(copy.lookup(probe), table.lookup(probe))

    # the same further batches keep them equal (slot orders differ)
    rng = np.random.default_rng(5)
    for step in range(10, 14):
        ids, grads, seen = batch(rng, np.arange(-60, 60, dtype=np.int64) * 7, 30, 4)
        assert table.apply(ids, grads, seen, float(step)) == copy.apply(ids, grads, seen,
                                                                           float(step))
        assert digest(copy) == digest(table)
    copy.apply(np.array([7], np.int64), np.ones((1, 4), np.float32), np.ones(1, np.int64), 14.0)
    assert digest(copy) != digest(table)


def test_same_applies_give_same_digest():
    c = cfg("ftrl", dim=3, expiry=5.0, min_count=2)
    a, b = _busy_table(c), _busy_table(c)
    assert digest(a) == digest(b)
    b.version += 1
    assert digest(a) != digest(b), "the version is part of the digest"
    assert digest(_busy_table(c, seed=9)) != digest(a)


def _corrupt(arrays: dict, name: str, how: str) -> None:
    a = arrays[name]
    if how == "shape":
        arrays[name] = np.concatenate([a, a[:1]]) if a.ndim == 1 else a[:, :-1]
    elif how == "dtype":
        arrays[name] = a.astype(np.float64 if a.dtype != np.float64 else np.float32)
    elif how == "order":
        arrays[name] = a[::-1].copy()
    elif how == "missing":
        del arrays[name]


@pytest.mark.parametrize("name,how", [
    ("values", "shape"), ("values", "dtype"), ("h", "shape"), ("last", "shape"),
    ("last", "dtype"), ("ids", "order"), ("ids", "dtype"), ("pending_count", "shape"),
    ("pending_ids", "order"), ("h", "missing"),
])
def test_install_refuses_inconsistent_state(name, how):
    c = cfg("adagrad", dim=4, dtype="float32", min_count=3)
    scalars, arrays = _busy_table(c).export()
    arrays = dict(arrays)
    _corrupt(arrays, name, how)
    with pytest.raises(ValueError):
        RowTable.install(c, scalars, arrays)


def test_install_refuses_bad_scalars_and_overlaps():
    c = cfg("sgd", dim=2, min_count=3)
    scalars, arrays = _busy_table(c).export()
    arrays = dict(arrays)
    with pytest.raises(ValueError, match="version"):
        RowTable.install(c, {**scalars, "version": -1}, arrays)
    with pytest.raises(ValueError, match="arrays"):
        RowTable.install(c, scalars, {**arrays, "h": arrays["values"]})
    overlap = {**arrays, "pending_ids": arrays["ids"][:1].copy(),
               "pending_count": np.ones(1, np.int64), "pending_last": np.zeros(1)}
    with pytest.raises(ValueError, match="both"):
        RowTable.install(c, scalars, overlap)
    too_many = {**arrays, "pending_count": np.full(len(arrays["pending_ids"]), 3, np.int64)}
    with pytest.raises(ValueError, match="pending counts"):
        RowTable.install(c, scalars, too_many)
    # an export of an empty table installs
    empty = RowTable(c)
    s, a = empty.export()
    assert digest(RowTable.install(c, s, dict(a))) == digest(empty)


# -- growth and size -----------------------------------------------------------------------

@pytest.mark.parametrize("opt,arrays_per_row", [("sgd", 1), ("adagrad", 2), ("ftrl", 3)])
def test_growth_to_many_rows(opt, arrays_per_row):
    dim, n = 4, 100_000
    table = RowTable(cfg(opt, dim=dim, dtype="float32", init=UNIFORM))
    rng = np.random.default_rng(6)
    all_ids = rng.permutation(np.arange(n, dtype=np.int64) * 1_000_003)
    for chunk in np.array_split(all_ids, 4):
        g = np.full((len(chunk), dim), 0.5, np.float32)
        assert table.apply(chunk, g, np.ones(len(chunk), np.int64), 0.0) == len(chunk)
    assert table.rows == n and table.stats["rows_created"] == n
    assert table.nbytes == n * dim * 4 * arrays_per_row
    sample = all_ids[::997]
    if opt == "sgd":
        want = row_init(sample, dim, UNIFORM, np.float32) - np.float32(0.05)
        np.testing.assert_allclose(table.lookup(sample), want, rtol=1e-6, atol=1e-7)
    # a second pass over all rows updates them in place
    assert table.apply(all_ids, np.zeros((n, dim), np.float32), np.ones(n, np.int64), 1.0) == n
    assert table.rows == n


def test_apply_batch_of_1024_by_64_runs():
    # sanity only, no timing assertion
    rng = np.random.default_rng(7)
    for opt in ("sgd", "adagrad", "ftrl"):
        table = RowTable(cfg(opt, dim=64, dtype="float32"))
        pool = np.arange(4096, dtype=np.int64)
        for step in range(4):
            ids = rng.choice(pool, 1024, replace=False)
            g = rng.normal(0, 1, (1024, 64)).astype(np.float32)
            assert table.apply(ids, g, np.ones(1024, np.int64), float(step)) == 1024
        assert np.isfinite(table.lookup(pool)).all()
