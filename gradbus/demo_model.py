"""Pure-numpy MLP classifier for scikit-learn's bundled digits dataset.

Used as the demo workload for gradbus: workers call :func:`loss_and_grads`
on minibatches and the server applies updates. :func:`train_single_process`
is the single-process baseline that the distributed run is compared with.

Parameters are a dict of arrays named ``"w0", "b0", "w1", "b1", ...``;
weight ``i`` has shape ``(sizes[i], sizes[i + 1])``. Hidden layers use ReLU,
the output layer is a softmax trained with mean cross-entropy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import numpy as np

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_EPOCHS",
    "DEFAULT_LR",
    "DEFAULT_SIZES",
    "Adam",
    "accuracy",
    "init_params",
    "iterate_minibatches",
    "load_digits_split",
    "loss_and_grads",
    "predict",
    "train_single_process",
]

#: Layer widths: 8x8 pixel input, one hidden layer, 10 classes.
DEFAULT_SIZES: tuple[int, ...] = (64, 128, 10)
#: Minibatch size used by :func:`train_single_process`.
DEFAULT_BATCH: int = 32
#: Adam learning rate used by :func:`train_single_process`.
DEFAULT_LR: float = 2e-3
#: Passes over the training set used by :func:`train_single_process`.
DEFAULT_EPOCHS: int = 25


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``X_train, y_train, X_test, y_test`` for the digits dataset.

    X is float32 in [0, 1] (pixel values divided by 16), y is int64. The split
    is stratified and deterministic for a given ``seed``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    X = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=test_fraction, stratify=y, random_state=seed
    )
    return (
        np.ascontiguousarray(X_train),
        np.ascontiguousarray(y_train),
        np.ascontiguousarray(X_test),
        np.ascontiguousarray(y_test),
    )


def init_params(sizes=DEFAULT_SIZES, seed: int = 0) -> dict[str, np.ndarray]:
    """Return float32 parameters for an MLP with layer widths ``sizes``.

    Weights feeding a ReLU use He-normal init, the output layer uses
    Glorot-uniform init; biases are zero.
    """
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < 2:
        raise ValueError("sizes needs at least an input and an output width")
    rng = np.random.default_rng(seed)
    n_layers = len(sizes) - 1
    params: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i < n_layers - 1:
            w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out))
        else:
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            w = rng.uniform(-limit, limit, size=(fan_in, fan_out))
        params[f"w{i}"] = w.astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, dtype=np.float32)
    return params


def _n_layers(params: Mapping[str, np.ndarray]) -> int:
    n = 0
    while f"w{n}" in params:
        n += 1
    if n == 0:
        raise ValueError("params has no 'w0'")
    return n


def _compute_dtype(params: Mapping[str, np.ndarray]) -> np.dtype:
    # float32 for float32 params, float64 if any param is float64.
    return np.result_type(np.float32, *(p.dtype for p in params.values()))


def _forward(params: Mapping[str, np.ndarray], X: np.ndarray):
    """Return ``(logits, activations)``; activations[i] is layer i's input."""
    n = _n_layers(params)
    h = np.asarray(X, dtype=_compute_dtype(params))
    activations = [h]
    for i in range(n):
        z = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = np.maximum(z, 0)
            activations.append(h)
        else:
            return z, activations
    raise AssertionError("unreachable")


def loss_and_grads(
    params: Mapping[str, np.ndarray], X: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Return the mean softmax cross-entropy and its gradient for every param.

    Gradients have the same keys, shapes and dtypes as ``params`` (float32 for
    :func:`init_params` output). ``params`` is only read, never written.
    """
    y = np.asarray(y, dtype=np.int64)
    logits, activations = _forward(params, X)
    n_samples = logits.shape[0]
    if n_samples == 0:
        raise ValueError("empty batch")
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    sum_exp = exp.sum(axis=1, keepdims=True)
    log_probs = shifted - np.log(sum_exp)
    rows = np.arange(n_samples)
    loss = float(-log_probs[rows, y].mean())

    delta = exp / sum_exp  # softmax probabilities
    delta[rows, y] -= 1
    delta /= n_samples

    grads: dict[str, np.ndarray] = {}
    for i in range(len(activations) - 1, -1, -1):
        w = params[f"w{i}"]
        b = params[f"b{i}"]
        grads[f"w{i}"] = (activations[i].T @ delta).astype(w.dtype, copy=False)
        grads[f"b{i}"] = delta.sum(axis=0).astype(b.dtype, copy=False)
        if i > 0:
            delta = delta @ w.T
            delta *= activations[i] > 0
    return loss, {k: grads[k] for k in params}


def predict(params: Mapping[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    """Return predicted class ids (int64) for the rows of ``X``."""
    logits, _ = _forward(params, X)
    return logits.argmax(axis=1).astype(np.int64)


def accuracy(params: Mapping[str, np.ndarray], X: np.ndarray, y: np.ndarray) -> float:
    """Return the fraction of rows of ``X`` classified as ``y``."""
    return float(np.mean(predict(params, X) == np.asarray(y)))


class Adam:
    """Adam optimizer (Kingma & Ba, bias-corrected) on a dict of numpy arrays.

    State (``m``, ``v``, step count ``t``) is created lazily per key on the
    first :meth:`step`.
    """

    def __init__(
        self,
        lr: float = DEFAULT_LR,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.lr = float(lr)
        self.beta1, self.beta2 = (float(b) for b in betas)
        self.eps = float(eps)
        self.t = 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """Apply one update to ``params`` in place using ``grads``."""
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        corr1 = 1.0 - b1**self.t
        corr2 = 1.0 - b2**self.t
        for key, g in grads.items():
            p = params[key]
            g = np.asarray(g, dtype=p.dtype)
            if key not in self.m:
                self.m[key] = np.zeros_like(p)
                self.v[key] = np.zeros_like(p)
            m, v = self.m[key], self.v[key]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            m_hat = m / corr1
            v_hat = v / corr2
            p -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(p.dtype, copy=False)


def iterate_minibatches(
    X: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield one epoch of ``(Xb, yb)`` batches in an order shuffled by ``rng``.

    The last batch is smaller when ``len(X)`` is not a multiple of
    ``batch_size``.
    """
    if batch_size <= 0:
        raise ValueError("batch_size must be positive")
    if len(X) != len(y):
        raise ValueError("X and y have different lengths")
    order = rng.permutation(len(X))
    for start in range(0, len(X), batch_size):
        idx = order[start : start + batch_size]
        yield X[idx], y[idx]


def train_single_process(
    epochs: int = DEFAULT_EPOCHS,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    seed: int = 0,
) -> dict:
    """Train the demo MLP in this process with :class:`Adam`.

    ``seed`` sets the data split, the initialization and the batch order.
    Returns ``{"test_accuracy": float, "seconds": float, "steps": int}``;
    ``seconds`` covers training and evaluation, not data loading.
    """
    X_train, y_train, X_test, y_test = load_digits_split(seed=seed)
    params = init_params(DEFAULT_SIZES, seed=seed)
    opt = Adam(lr=lr)
    rng = np.random.default_rng(seed)
    steps = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for Xb, yb in iterate_minibatches(X_train, y_train, batch_size, rng):
            _, grads = loss_and_grads(params, Xb, yb)
            opt.step(params, grads)
            steps += 1
    test_acc = accuracy(params, X_test, y_test)
    seconds = time.perf_counter() - start
    return {"test_accuracy": test_acc, "seconds": float(seconds), "steps": steps}
