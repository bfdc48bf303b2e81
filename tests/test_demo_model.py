"""Tests for gradbus.demo_model (numpy MLP on scikit-learn's digits)."""

import numpy as np
import pytest

pytest.importorskip("sklearn")

from gradbus import demo_model as dm  # noqa: E402


def _tiny_problem(seed=0, sizes=(5, 7, 6, 4), n=9):
    rng = np.random.default_rng(seed)
    params = {k: v.astype(np.float64) for k, v in dm.init_params(sizes, seed=seed).items()}
    # Non-zero biases so their gradients are exercised away from the init point.
    for k in params:
        if k.startswith("b"):
            params[k] = rng.normal(0.0, 0.1, size=params[k].shape)
    X = rng.normal(size=(n, sizes[0]))
    y = rng.integers(0, sizes[-1], size=n).astype(np.int64)
    return params, X, y


def test_init_params_names_shapes_dtypes():
    sizes = (64, 32, 16, 10)
    params = dm.init_params(sizes, seed=3)
    assert list(params) == ["w0", "b0", "w1", "b1", "w2", "b2"]
    for i in range(3):
        assert params[f"w{i}"].shape == (sizes[i], sizes[i + 1])
        assert params[f"b{i}"].shape == (sizes[i + 1],)
        assert params[f"w{i}"].dtype == np.float32
        assert params[f"b{i}"].dtype == np.float32
        assert not np.any(params[f"b{i}"])
        assert np.std(params[f"w{i}"]) > 0
    again = dm.init_params(sizes, seed=3)
    assert all(np.array_equal(params[k], again[k]) for k in params)


def test_gradient_matches_finite_differences():
    params, X, y = _tiny_problem()
    loss, grads = dm.loss_and_grads(params, X, y)
    assert np.isfinite(loss)
    assert set(grads) == set(params)
    rng = np.random.default_rng(1)
    h = 1e-6
    for key, p in params.items():
        assert grads[key].shape == p.shape
        flat_idx = rng.choice(p.size, size=min(6, p.size), replace=False)
        for j in flat_idx:
            idx = np.unravel_index(j, p.shape)
            plus = {k: v.copy() for k, v in params.items()}
            minus = {k: v.copy() for k, v in params.items()}
            plus[key][idx] += h
            minus[key][idx] -= h
            numeric = (dm.loss_and_grads(plus, X, y)[0] - dm.loss_and_grads(minus, X, y)[0]) / (2 * h)
            analytic = float(grads[key][idx])
            rel = abs(analytic - numeric) / max(abs(analytic) + abs(numeric), 1e-5)
            assert rel < 1e-4, (key, idx, analytic, numeric, rel)


def test_loss_and_grads_float32_and_read_only_params():
    params = dm.init_params((64, 16, 10), seed=0)
    X_train, y_train, _, _ = dm.load_digits_split(seed=0)
    X, y = X_train[:20], y_train[:20]
    before = {k: v.copy() for k, v in params.items()}
    for arr in list(params.values()) + [X, y]:
        arr.flags.writeable = False
    loss, grads = dm.loss_and_grads(params, X, y)
    assert np.isfinite(loss)
    for k, p in params.items():
        assert np.array_equal(p, before[k])
        assert grads[k].shape == p.shape
        assert grads[k].dtype == np.float32
        assert np.all(np.isfinite(grads[k]))


def test_loss_is_stable_for_huge_logits():
    params = dm.init_params((4, 3), seed=0)
    params["w0"] = params["w0"] * np.float32(1e4)
    X = np.ones((2, 4), dtype=np.float32) * 100
    loss, grads = dm.loss_and_grads(params, X, np.array([0, 1]))
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(g)) for g in grads.values())


def test_digits_split_shapes_and_dtypes():
    X_train, y_train, X_test, y_test = dm.load_digits_split(seed=0)
    assert X_train.dtype == np.float32 and X_test.dtype == np.float32
    assert y_train.dtype == np.int64 and y_test.dtype == np.int64
    assert X_train.shape[1] == X_test.shape[1] == 64
    assert X_train.shape[0] == y_train.shape[0]
    assert X_test.shape[0] == y_test.shape[0]
    assert X_train.shape[0] + X_test.shape[0] == 1797
    assert abs(X_test.shape[0] / 1797 - 0.2) < 0.01
    assert X_train.min() >= 0.0 and X_train.max() <= 1.0
    assert set(np.unique(y_train)) == set(range(10))
    assert set(np.unique(y_test)) == set(range(10))
    again = dm.load_digits_split(seed=0)
    assert np.array_equal(again[0], X_train) and np.array_equal(again[3], y_test)


def test_iterate_minibatches_covers_each_sample_once():
    X = np.arange(10, dtype=np.float32).reshape(10, 1)
    y = np.arange(10, dtype=np.int64)
    batches = list(dm.iterate_minibatches(X, y, 4, np.random.default_rng(0)))
    assert [len(yb) for _, yb in batches] == [4, 4, 2]
    seen = np.concatenate([yb for _, yb in batches])
    assert sorted(seen.tolist()) == list(range(10))
    for Xb, yb in batches:
        assert np.array_equal(Xb[:, 0].astype(np.int64), yb)


def test_adam_first_step_matches_formula():
    params = {"w": np.array([1.0, -2.0, 0.5], dtype=np.float32)}
    grads = {"w": np.array([0.3, -0.1, 0.0], dtype=np.float32)}
    opt = dm.Adam(lr=0.01)
    opt.step(params, grads)
    # After one bias-corrected step the update is lr * g / (|g| + eps).
    g = grads["w"].astype(np.float64)
    expected = np.array([1.0, -2.0, 0.5]) - 0.01 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(params["w"], expected, rtol=1e-6)
    assert params["w"].dtype == np.float32


def test_train_single_process_reaches_accuracy():
    result = dm.train_single_process()
    assert set(result) == {"test_accuracy", "seconds", "steps"}
    assert result["test_accuracy"] >= 0.95
    assert result["steps"] > 0
    assert result["seconds"] > 0
