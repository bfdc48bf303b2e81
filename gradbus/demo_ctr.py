"""``gradbus demo ctr``: a click-through-rate model on sparse embedding tables.

The data comes from a planted model, so the best achievable score is known: each example has
one categorical value per field, drawn from a truncated power law (a few values are very
common, most are rare), and the click probability is a factorization machine over the
features' planted weights. :func:`make_data` draws it, :meth:`CTRData.optimum` scores the
planted probabilities themselves.

The learned model, :class:`CTRModel`, is a small "wide and deep" network: the embeddings of an
example's feature ids (table ``"ctr.emb"``) are concatenated and go through one ReLU layer to a
logit, to which each feature's scalar weight (table ``"ctr.lin"``, rows of one) is added. The two
tables live on the server as rows created on first use; the dense layers are ordinary tensors.
:func:`train_worker` is one worker's loop against a gradbus client, :func:`evaluate` scores
what the server holds.

Feature ids are global int64 ids ``field * vocab + value`` (value 0 is the most common value of
its field), so every field has its own rows in the shared tables. Ids seen fewer than
``min_count`` times in the training set are replaced by their field's out-of-vocabulary id
``fields * vocab + field`` before they reach a table (:meth:`CTRData.admit`), the usual
vocabulary step of a click pipeline: a row learned from a handful of examples only memorizes
their labels, and the second epoch then makes the model worse.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

import gradbus
from gradbus.demo import cluster_at, progress_line, run_workers, when_ready
from gradbus.demo_model import iterate_minibatches
from gradbus.workers.tier_client import member_statuses

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_DIM",
    "DEFAULT_EPOCHS",
    "DEFAULT_HIDDEN",
    "DEFAULT_LR_DENSE",
    "DEFAULT_LR_EMB",
    "DEFAULT_MIN_COUNT",
    "DENSE_PREFIX",
    "EMB_TABLE",
    "LIN_TABLE",
    "CTRData",
    "CTRModel",
    "auc",
    "evaluate",
    "iterate_minibatches",
    "log_loss",
    "make_data",
    "row_grads",
    "train_worker",
    "run",
    "worker_main",
]

#: Table of the feature embeddings (rows of the model's ``dim``).
EMB_TABLE = "ctr.emb"
#: Table of the per-feature scalar ("wide") weights (rows of one).
LIN_TABLE = "ctr.lin"
#: Server-side names of the dense parameters are this prefix plus ``w0, b0, w1, b1``.
DENSE_PREFIX = "ctr."

#: Width of the learned embeddings.
DEFAULT_DIM: int = 8
#: Units of the hidden ReLU layer.
DEFAULT_HIDDEN: int = 32
#: Examples per minibatch.
DEFAULT_BATCH: int = 256
#: Passes over a worker's shard of the training data.
DEFAULT_EPOCHS: int = 2
#: Adagrad learning rate of both tables (server side, per row).
DEFAULT_LR_EMB: float = 0.1
#: Adam learning rate of the dense layers (server side).
DEFAULT_LR_DENSE: float = 3e-3
#: Feature ids seen fewer times than this in the training set share their field's
#: out-of-vocabulary row (:meth:`CTRData.admit`): rows of a handful of examples only memorize
#: their labels.
DEFAULT_MIN_COUNT: int = 200
#: Standard deviation of a new embedding row (the scalar weights start at zero).
EMB_INIT_STD: float = 0.01
#: Pushes of each kind a worker keeps in flight: it waits on the futures of two steps ago.
WINDOW = 2

# The planted model. Over the examples, the wide part of the logit has standard deviation
# _PLANTED_LIN_STD and the pairwise part _PLANTED_PAIR_STD; a value of popularity rank r
# (1: the most common) has a weight of prior std r ** -_PLANTED_DECAY and a vector of prior
# std r ** -_PLANTED_PAIR_DECAY per component (before that scaling), so the long tail, which
# no training set of a realistic size can teach, carries little of the signal.
_PLANTED_LIN_STD = 1.0
_PLANTED_PAIR_STD = 0.8
_PLANTED_DECAY = 0.5
_PLANTED_PAIR_DECAY = 1.0
_PLANTED_CLICK_RATE = 0.2
_CALIBRATION_EXAMPLES = 20000


# -- data -------------------------------------------------------------------------------------
@dataclass
class CTRData:
    """Training and evaluation examples of :func:`make_data` and the model that drew them.

    ``x_*`` are int64 feature ids ``[n, fields]``, ``y_*`` float32 labels (1: click),
    ``p_eval`` the planted click probability of every evaluation example.
    ``bias``, ``w`` (``[fields * vocab]``) and ``e`` (``[fields * vocab, dim]``) are the planted
    model, indexed by feature id.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray
    p_eval: np.ndarray
    fields: int
    vocab: int
    dim: int
    bias: float = field(repr=False, default=0.0)
    w: np.ndarray | None = field(repr=False, default=None)
    e: np.ndarray | None = field(repr=False, default=None)
    _counts: np.ndarray | None = field(repr=False, default=None, compare=False)

    def feature_counts(self) -> np.ndarray:
        """Occurrences of every feature id in the training set (``[fields * vocab]``)."""
        if self._counts is None:
            self._counts = np.bincount(self.x_train.ravel(), minlength=self.fields * self.vocab)
        return self._counts

    def admit(self, x: np.ndarray, min_count: int) -> np.ndarray:
        """Feature ids ``x`` with those seen fewer than ``min_count`` times in training replaced
        by their field's out-of-vocabulary id ``fields * vocab + field``."""
        x = np.asarray(x, dtype=np.int64)
        if min_count <= 1:
            return x
        counts = self.feature_counts()
        oov = self.fields * self.vocab + np.arange(self.fields, dtype=np.int64)
        known = np.zeros(x.shape, dtype=bool)
        inside = (x >= 0) & (x < len(counts))
        known[inside] = counts[x[inside]] >= min_count
        return np.where(known, x, oov[None, :x.shape[1]])

    @property
    def click_rate(self) -> float:
        """Fraction of training examples that are clicks."""
        return float(np.mean(self.y_train))

    @property
    def base_logloss(self) -> float:
        """Evaluation log loss of predicting the training click rate for every example."""
        return log_loss(self.y_eval, np.full(len(self.y_eval), self.click_rate))

    def optimum(self) -> dict:
        """``{"logloss", "auc"}`` of the planted probabilities on the evaluation set: what no
        model can beat except by chance."""
        return {"logloss": log_loss(self.y_eval, self.p_eval), "auc": auc(self.y_eval, self.p_eval)}

    def planted_logit(self, x: np.ndarray) -> np.ndarray:
        """The planted model's logit for feature ids ``x`` ``[n, fields]``."""
        return _fm_logit(self.bias, self.w, self.e, x)


def _pairs(e: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``sum_{f<g} <e[x_f], e[x_g]>`` per example, in O(F * dim)."""
    v = e[x]                                   # [n, F, dim]
    s = v.sum(axis=1)
    return 0.5 * ((s * s).sum(axis=1) - (v * v).sum(axis=(1, 2)))


def _fm_logit(bias: float, w: np.ndarray, e: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``bias + sum_f w[x_f] + sum_{f<g} <e[x_f], e[x_g]>`` (a factorization machine)."""
    return bias + w[x].sum(axis=1) + _pairs(e, x)


def _draw_ids(rng: np.random.Generator, n: int, fields: int, vocab: int,
              cdf: np.ndarray) -> np.ndarray:
    """``[n, fields]`` global ids: each field's value by inverting the power law's ``cdf``."""
    values = np.searchsorted(cdf, rng.random((n, fields)), side="right")
    np.minimum(values, vocab - 1, out=values)   # guards a rounding cdf[-1] below 1
    return (values + vocab * np.arange(fields)).astype(np.int64)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """Logistic function without overflow for any finite ``z``."""
    z = np.asarray(z)
    out = np.empty_like(z, dtype=np.result_type(z.dtype, np.float32))
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


def make_data(n_train: int, n_eval: int, *, fields: int = 8, vocab: int = 20000, dim: int = 4,
              zipf: float = 1.1, seed: int = 0) -> CTRData:
    """Draw a planted click model and ``n_train`` + ``n_eval`` examples from it.

    Value ``v`` of a field has probability proportional to ``(v + 1) ** -zipf`` (``v <
    vocab``), independently per field; its feature id is ``field * vocab + v``. The planted
    model gives every feature a normal scalar weight and a normal ``dim``-vector whose spread
    shrinks with the value's popularity rank (``(v + 1) ** -0.5`` and ``(v + 1) ** -1`` before
    scaling), scaled so the wide and the pairwise part of the logit have standard deviations of
    about 1.0 and 0.8 over the examples, and a bias that puts the click rate near 20%; labels
    are Bernoulli draws of ``sigmoid(logit)``. With the defaults the planted probabilities reach
    an AUC of about 0.75-0.80 and a log loss about 0.09 below the base rate's.
    The planted model and the evaluation set do not depend on ``n_train`` (separate random
    streams), so runs of different sizes are comparable.
    """
    if n_train <= 0 or n_eval <= 0:
        raise ValueError("n_train and n_eval must be positive")
    if fields < 2 or vocab < 1 or dim < 1 or zipf <= 0:
        raise ValueError("need fields >= 2, vocab >= 1, dim >= 1 and zipf > 0")
    model_rng, calib_rng, train_rng, eval_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -zipf
    cdf = np.cumsum(weights / weights.sum())

    rank = np.tile(np.arange(1, vocab + 1, dtype=np.float64), fields)   # per feature id
    w = model_rng.normal(0.0, 1.0, len(rank)) * rank ** -_PLANTED_DECAY
    e = model_rng.normal(0.0, 1.0, (len(rank), dim)) * (rank ** -_PLANTED_PAIR_DECAY)[:, None]
    # Scale both parts to their target spread over a calibration sample (the pairs scale as
    # the square of e), then set the bias so the click rate hits its target (bisection).
    calib = _draw_ids(calib_rng, _CALIBRATION_EXAMPLES, fields, vocab, cdf)
    lin_std, pair_std = w[calib].sum(axis=1).std(), _pairs(e, calib).std()
    if lin_std > 0:
        w *= _PLANTED_LIN_STD / lin_std
    if pair_std > 0:
        e *= math.sqrt(_PLANTED_PAIR_STD / pair_std)
    raw = _fm_logit(0.0, w, e, calib)
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _sigmoid(raw + mid).mean() > _PLANTED_CLICK_RATE:
            hi = mid
        else:
            lo = mid
    bias = 0.5 * (lo + hi)

    def draw(rng, n):
        x = _draw_ids(rng, n, fields, vocab, cdf)
        p = _sigmoid(_fm_logit(bias, w, e, x))
        return x, (rng.random(n) < p).astype(np.float32), p

    x_train, y_train, _ = draw(train_rng, n_train)
    x_eval, y_eval, p_eval = draw(eval_rng, n_eval)
    return CTRData(x_train, y_train, x_eval, y_eval, p_eval, fields, vocab, dim,
                   bias=bias, w=w, e=e)


# -- metrics ----------------------------------------------------------------------------------
def log_loss(y: np.ndarray, p: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of labels ``y`` under probabilities ``p`` (clipped to
    ``[eps, 1 - eps]``)."""
    y = np.asarray(y, dtype=np.float64)
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1.0 - eps)
    if y.shape != p.shape or y.size == 0:
        raise ValueError("y and p must be non-empty and of one shape")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def _average_ranks(a: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``a``, tied values sharing the mean of their ranks."""
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]                    # group i: sorted positions [start, end)
    group_rank = 0.5 * (starts + 1 + ends)              # mean of ranks start+1 .. end
    ranks = np.empty(len(a), dtype=np.float64)
    ranks[order] = np.repeat(group_rank, ends - starts)
    return ranks


def auc(y: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a random positive outscores a random
    negative, ties counting one half (Mann-Whitney U from average ranks, O(n log n)).
    ``nan`` when ``y`` has a single class."""
    y = np.asarray(y).astype(bool).ravel()
    score = np.asarray(score, dtype=np.float64).ravel()
    if y.shape != score.shape:
        raise ValueError("y and score must have one shape")
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = _average_ranks(score)[y].sum()
    return float((r - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# -- the model --------------------------------------------------------------------------------
def _sum_by(inverse: np.ndarray, n_rows: int, grads: np.ndarray) -> np.ndarray:
    """``out[k] = sum of grads[i] over i with inverse[i] == k`` for ``grads`` ``[n, d]``."""
    out = np.empty((n_rows, grads.shape[1]), dtype=grads.dtype)
    for j in range(grads.shape[1]):
        out[:, j] = np.bincount(inverse, weights=grads[:, j], minlength=n_rows)
    return out


def row_grads(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row gradients of a batch: ``ids`` ``[B, F]``, ``grads`` ``[B, F, d]`` ->
    ``(unique_ids [U], summed [U, d])``, the gradients of repeated ids summed (what one server
    step of the row applies)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    grads = np.asarray(grads)
    grads = grads.reshape(len(ids), -1)
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, _sum_by(inverse.reshape(-1), len(uniq), grads)


class CTRModel:
    """Wide and deep click model over ``fields`` embeddings of width ``dim``.

    ``logit = relu(concat(emb) @ w0 + b0) @ w1 + b1 + sum_f lin_f``; the dense parameters are a
    dict ``{"w0": [F*dim, hidden], "b0": [hidden], "w1": [hidden, 1], "b1": [1]}``. Computation
    runs in the dtype of the parameters and embeddings (float32, or float64 if any is).
    """

    row_grads = staticmethod(row_grads)

    def __init__(self, fields: int, dim: int, hidden: int = DEFAULT_HIDDEN, seed: int = 0):
        if fields < 1 or dim < 1 or hidden < 1:
            raise ValueError("fields, dim and hidden must be positive")
        self.fields, self.dim, self.hidden, self.seed = int(fields), int(dim), int(hidden), seed

    def init_params(self, base_rate: float | None = None) -> dict[str, np.ndarray]:
        """float32 dense parameters: He-normal ``w0``, Glorot-uniform ``w1``, zero ``b0``;
        ``b1`` is the log-odds of ``base_rate`` (zero if None), so training starts from the
        average click rate instead of 50%."""
        rng = np.random.default_rng(self.seed)
        n_in = self.fields * self.dim
        limit = math.sqrt(6.0 / (self.hidden + 1))
        b1 = 0.0
        if base_rate is not None:
            r = min(max(float(base_rate), 1e-4), 1 - 1e-4)
            b1 = math.log(r / (1 - r))
        w0 = rng.normal(0.0, math.sqrt(2.0 / n_in), (n_in, self.hidden))
        return {"w0": w0.astype(np.float32),
                "b0": np.zeros(self.hidden, np.float32),
                "w1": rng.uniform(-limit, limit, (self.hidden, 1)).astype(np.float32),
                "b1": np.full(1, b1, np.float32)}

    def _check(self, emb: np.ndarray, lin: np.ndarray) -> None:
        if emb.ndim != 3 or emb.shape[1:] != (self.fields, self.dim):
            raise ValueError(f"emb must be [B, {self.fields}, {self.dim}], got {emb.shape}")
        if lin.shape != (emb.shape[0], self.fields, 1):
            raise ValueError(f"lin must be [B, {self.fields}, 1], got {lin.shape}")

    def _forward(self, params: Mapping[str, np.ndarray], emb, lin):
        emb, lin = np.asarray(emb), np.asarray(lin)
        self._check(emb, lin)
        dt = np.result_type(np.float32, emb.dtype, lin.dtype, *(p.dtype for p in params.values()))
        x = emb.reshape(len(emb), -1).astype(dt, copy=False)
        h = np.maximum(x @ params["w0"].astype(dt, copy=False) + params["b0"], 0)
        z = (h @ params["w1"].astype(dt, copy=False))[:, 0] + params["b1"][0] \
            + lin.sum(axis=(1, 2), dtype=dt)
        return z.astype(dt, copy=False), x, h

    def logits(self, params: Mapping[str, np.ndarray], emb: np.ndarray,
               lin: np.ndarray) -> np.ndarray:
        """Logits ``[B]`` for embeddings ``emb`` ``[B, F, dim]`` and weights ``lin``
        ``[B, F, 1]``."""
        return self._forward(params, emb, lin)[0]

    def forward(self, params: Mapping[str, np.ndarray], emb: np.ndarray,
                lin: np.ndarray) -> np.ndarray:
        """Click probabilities ``[B]`` (the sigmoid of :meth:`logits`)."""
        return _sigmoid(self.logits(params, emb, lin))

    def loss_and_grads(self, params: Mapping[str, np.ndarray], emb: np.ndarray,
                       lin: np.ndarray, y: np.ndarray):
        """``(loss, dense_grads, emb_grads [B, F, dim], lin_grads [B, F, 1])`` of the mean log
        loss over the batch. ``dense_grads`` has the keys and dtypes of ``params``."""
        z, x, h = self._forward(params, emb, lin)
        y = np.asarray(y, dtype=z.dtype).reshape(-1)
        n = len(z)
        if n == 0 or len(y) != n:
            raise ValueError("empty batch or labels of another length")
        # log(1 + e^z) - y z, without overflow
        loss = float(np.mean(np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z))) - y * z))
        dz = (_sigmoid(z) - y) / n                                  # [B]
        w0, w1 = params["w0"].astype(z.dtype, copy=False), params["w1"].astype(z.dtype, copy=False)
        dh = dz[:, None] * w1[:, 0][None, :]
        dh *= h > 0
        dense = {"w0": x.T @ dh, "b0": dh.sum(axis=0), "w1": (h.T @ dz)[:, None],
                 "b1": np.array([dz.sum()])}
        dense = {k: dense[k].astype(params[k].dtype, copy=False) for k in params}
        emb_grads = (dh @ w0.T).reshape(n, self.fields, self.dim)
        lin_grads = np.broadcast_to(dz[:, None, None], (n, self.fields, 1)).copy()
        return loss, dense, emb_grads, lin_grads


# -- training against a gradbus client --------------------------------------------------------
def _gather(client, ids: np.ndarray, fields: int):
    """Rows of both tables for feature ids ``[B, F]``: ``(uniq, inverse, emb [B, F, dim],
    lin [B, F, 1])``, each distinct id pulled once."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    emb_rows = np.asarray(client.pull_rows(EMB_TABLE, uniq))
    lin_rows = np.asarray(client.pull_rows(LIN_TABLE, uniq))
    n = len(ids)
    return (uniq, inverse, emb_rows[inverse].reshape(n, fields, -1),
            lin_rows[inverse].reshape(n, fields, 1))


def _dense_names() -> list[str]:
    return [DENSE_PREFIX + k for k in ("w0", "b0", "w1", "b1")]


def train_worker(client, data: CTRData, *, worker: int = 0, workers: int = 1,
                 epochs: int = DEFAULT_EPOCHS, batch: int = DEFAULT_BATCH,
                 lr_emb: float = DEFAULT_LR_EMB, lr_dense: float = DEFAULT_LR_DENSE,
                 dim: int = DEFAULT_DIM, hidden: int = DEFAULT_HIDDEN,
                 min_count: int = DEFAULT_MIN_COUNT, seed: int = 0,
                 progress: Callable[[int, float], None] | None = None) -> dict:
    """Train on shard ``worker`` of ``workers`` (examples ``worker::workers``) for ``epochs``.

    Creates the tables (Adagrad rows: embeddings normal with std :data:`EMB_INIT_STD`, scalar
    weights zero) and the dense layers (Adam) unless they exist, so every worker may call it.
    Each step pulls the rows of the batch's distinct ids and the freshest dense weights, and
    pushes the per-row summed gradients and the dense gradients without waiting: it waits
    only on the pushes of :data:`WINDOW` steps ago. ``progress(step, loss)`` is called after
    every step. Returns ``{"steps", "examples", "last_loss"}`` (the loss of the last batch).
    """
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} not in 0..{workers - 1}")
    model = CTRModel(data.fields, dim, hidden, seed)
    when_ready(lambda: client.init_table(
        EMB_TABLE, dim, gradbus.Normal(std=EMB_INIT_STD, seed=seed), gradbus.Adagrad(lr=lr_emb)))
    when_ready(lambda: client.init_table(LIN_TABLE, 1, gradbus.Zeros(),
                                          gradbus.Adagrad(lr=lr_emb)))
    init = {DENSE_PREFIX + k: v for k, v in model.init_params(data.click_rate).items()}
    when_ready(lambda: client.init(init, optimizer=gradbus.Adam(lr=lr_dense)))
    names = list(init)

    x, y = data.admit(data.x_train[worker::workers], min_count), data.y_train[worker::workers]
    rng = np.random.default_rng(seed * 1000 + worker)
    in_flight: deque = deque()
    steps = examples = 0
    last_loss = float("nan")
    for _ in range(epochs):
        for xb, yb in iterate_minibatches(x, y, batch, rng):
            uniq, inverse, emb, lin = _gather(client, xb, data.fields)
            w = client.pull(names)
            params = {k[len(DENSE_PREFIX):]: v for k, v in w.items()}
            loss, dense, g_emb, g_lin = model.loss_and_grads(params, emb, lin, yb)
            n = len(uniq)
            in_flight.append((
                client.push_rows(EMB_TABLE, uniq, _sum_by(inverse, n, g_emb.reshape(-1, dim))),
                client.push_rows(LIN_TABLE, uniq, _sum_by(inverse, n, g_lin.reshape(-1, 1))),
                client.push({DENSE_PREFIX + k: g for k, g in dense.items()})))
            while len(in_flight) > WINDOW:
                for f in in_flight.popleft():
                    f.result()
            steps += 1
            examples += len(xb)
            last_loss = loss
            if progress is not None:
                progress(steps, loss)
    for futures in in_flight:
        for f in futures:
            f.result()
    flush = getattr(client, "flush", None)
    if flush is not None:
        flush()
    return {"steps": steps, "examples": examples, "last_loss": last_loss}


def evaluate(client, data: CTRData, batch: int = 4096, *,
             min_count: int = DEFAULT_MIN_COUNT) -> dict:
    """``{"logloss", "auc"}`` of the model the server holds on the evaluation set (reads only:
    ``pull_rows`` and ``pull``). Model sizes are read from the dense weights."""
    w = client.pull(_dense_names())
    params = {k[len(DENSE_PREFIX):]: np.asarray(v) for k, v in w.items()}
    n_in, hidden = params["w0"].shape
    model = CTRModel(data.fields, n_in // data.fields, hidden)
    p = np.empty(len(data.x_eval), dtype=np.float64)
    for start in range(0, len(data.x_eval), batch):
        xb = data.admit(data.x_eval[start:start + batch], min_count)
        _, _, emb, lin = _gather(client, xb, data.fields)
        p[start:start + len(xb)] = model.forward(params, emb, lin)
    return {"logloss": log_loss(data.y_eval, p), "auc": auc(data.y_eval, p)}


# -- the launcher: `gradbus demo ctr` ---------------------------------------------------------
DEFAULT_TRAIN = 100_000
DEFAULT_EVAL = 20_000
PROGRESS_EVERY = 50          # steps between a worker's progress lines


def worker_main(broker_url: str, index: int, workers: int, epochs: int, n_train: int,
                seed: int) -> None:
    """One CTR worker process: prints JSON progress lines and a final ``done`` line."""
    data = make_data(n_train, DEFAULT_EVAL, seed=seed)
    t0 = time.perf_counter()
    losses: list[float] = []

    def progress(step: int, loss: float) -> None:
        losses.append(loss)
        if step % PROGRESS_EVERY == 0:
            print(json.dumps({"worker": index, "step": step, "loss": round(
                float(np.mean(losses[-PROGRESS_EVERY:])), 4)}), flush=True)

    with gradbus.connect(broker_url, client_id=f"ctr-worker-{index}-{time.time_ns()}") as c:
        out = train_worker(c, data, worker=index, workers=workers, epochs=epochs, seed=seed,
                           progress=progress)
        print(json.dumps({"worker": index, "done": True, **out,
                          "rows_pushed": c.stats["rows_pushed"], "rows_read": c.stats["rows_read"],
                          "push_bytes": c.stats["push_bytes"],
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


def run(workers: int = 2, shards: int = 2, epochs: int = DEFAULT_EPOCHS,
        n_train: int = DEFAULT_TRAIN, broker_url: str | None = None, seed: int = 0,
        echo=print) -> dict:
    """Start a local cluster (unless given one), train with ``workers`` processes, then score
    the model the server holds against the planted optimum."""
    t0 = time.perf_counter()
    # one BLAS thread per worker: small matrices, and the cores are shared with the cluster
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}

    def on_line(i: int, line: str, done: dict) -> None:
        msg = progress_line(i, line, done, echo)
        if msg is not None and msg.get("step", 1) % (PROGRESS_EVERY * 4) == 0:
            echo(f"  worker {i}  step {msg['step']:>5}  loss {msg['loss']:.4f}")

    with cluster_at(broker_url, shards, echo) as broker_url:
        echo(f"broker {broker_url}; {workers} workers, {epochs} epochs over {n_train} "
             f"click-log examples")
        done = run_workers(
            [[sys.executable, "-m", "gradbus", "ctr-worker", "--broker", broker_url,
              "--index", str(i), "--workers", str(workers), "--epochs", str(epochs),
              "--train", str(n_train), "--seed", str(seed)] for i in range(workers)],
            on_line, env)
        data = make_data(n_train, DEFAULT_EVAL, seed=seed)
        with gradbus.connect(broker_url) as c:
            score = evaluate(c, data)
            st = c.status()
    best = data.optimum()
    tables = {t["name"]: t for m in member_statuses(st) for t in m.get("tables", [])}
    return {"logloss": round(score["logloss"], 4), "auc": round(score["auc"], 4),
            "optimum_logloss": round(best["logloss"], 4), "optimum_auc": round(best["auc"], 4),
            "base_logloss": round(data.base_logloss, 4),
            "rows": {n: t["rows"] for n, t in tables.items() if n.startswith("ctr.")},
            "steps": int(sum(d["steps"] for d in done.values())),
            "rows_pushed": int(sum(d["rows_pushed"] for d in done.values())),
            "push_bytes": int(sum(d["push_bytes"] for d in done.values())),
            "seconds": round(time.perf_counter() - t0, 2), "workers": workers,
            "shards": shards, "epochs": epochs, "train": n_train}


def format_summary(s: dict) -> str:
    return (f"\neval log loss {s['logloss']:.4f} (planted optimum {s['optimum_logloss']:.4f}, "
            f"click rate alone {s['base_logloss']:.4f})\n"
            f"eval AUC      {s['auc']:.4f} (planted optimum {s['optimum_auc']:.4f})\n"
            f"rows {s['rows']}  steps {s['steps']}  seconds {s['seconds']:.1f}")
