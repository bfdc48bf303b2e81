"""Optimizers: the one module that holds the update math. Every step updates in place.

Each rule is a class with ``state(n, dtype)`` (the per-block state arrays) and
``step(w, g, k, state, scratch)``: ``g`` is the *sum* of a batch of ``k`` gradients for the flat
block ``w``, and ``scratch`` a caller-owned buffer of ``w``'s size, so a step allocates nothing.

A batch of ``k`` gradients is applied as ``k`` steps of their mean, in one pass: the optimizer
state advances in closed form by ``k`` steps (Adam's ``t += k``, ``m = b1^k m + (1-b1^k) mean``,
...), so the result barely depends on how the broker happened to batch the pushes. Plain SGD is
exactly ``w -= lr * sum``; momentum is exact for ``k`` equal gradients; Adam (exact for equal
gradients from a fresh state) moves ``k`` times the step taken at the advanced state, Adagrad
``k`` times the step taken at the middle of the ``k`` accumulations.
"""
from __future__ import annotations

import numpy as np

from gradbus.codecs import specs


class SGDRule:
    def __init__(self, spec: specs.SGD):
        self.lr, self.momentum = spec.lr, spec.momentum

    def state(self, n: int, dtype) -> dict:
        return {"v": np.zeros(n, dtype)} if self.momentum else {}

    def step(self, w: np.ndarray, g: np.ndarray, k: int, st: dict, scratch: np.ndarray) -> None:
        if not self.momentum:
            np.multiply(g, w.dtype.type(self.lr), out=scratch)
            w -= scratch
            return
        m, v = self.momentum, st["v"]
        mk = m ** k
        s = m * (1.0 - mk) / (1.0 - m)           # sum_{i=1..k} m^i
        # sum of the k velocities: v*s + mean/(1-m) * (k - s); then v_k = m^k v + mean (1-m^k)/(1-m)
        np.multiply(v, self.lr * s, out=scratch)
        w -= scratch
        np.multiply(g, self.lr * (k - s) / (k * (1.0 - m)), out=scratch)
        w -= scratch
        v *= mk
        np.multiply(g, (1.0 - mk) / (k * (1.0 - m)), out=scratch)
        v += scratch


class AdamRule:
    def __init__(self, spec: specs.Adam):
        self.lr, (self.b1, self.b2), self.eps = spec.lr, spec.betas, spec.eps

    def state(self, n: int, dtype) -> dict:
        return {"m": np.zeros(n, dtype), "v": np.zeros(n, dtype), "t": 0}

    def step(self, w, g, k, st, scratch) -> None:
        m, v = st["m"], st["v"]
        st["t"] = t = st["t"] + k
        b1k, b2k = self.b1 ** k, self.b2 ** k
        m *= b1k
        np.multiply(g, (1.0 - b1k) / k, out=scratch)
        m += scratch
        v *= b2k
        np.multiply(g, g, out=scratch)
        scratch *= (1.0 - b2k) / (k * k)
        v += scratch
        # w -= k * lr * mhat / (sqrt(vhat) + eps), mhat = m/(1-b1^t), vhat = v/(1-b2^t)
        np.multiply(v, 1.0 / (1.0 - self.b2 ** t), out=scratch)
        np.sqrt(scratch, out=scratch)
        scratch += self.eps
        np.divide(m, scratch, out=scratch)
        scratch *= k * self.lr / (1.0 - self.b1 ** t)
        w -= scratch


class AdagradRule:
    def __init__(self, spec: specs.Adagrad):
        self.lr, self.eps = spec.lr, spec.eps

    def state(self, n: int, dtype) -> dict:
        return {"h": np.zeros(n, dtype)}

    def step(self, w, g, k, st, scratch) -> None:
        h = st["h"]
        # the step is taken at the middle of the k accumulations: h + (k+1)/2 * mean^2
        np.multiply(g, g, out=scratch)
        scratch *= (k + 1) / (2.0 * k * k)
        scratch += h
        np.sqrt(scratch, out=scratch)
        scratch += self.eps
        np.divide(g, scratch, out=scratch)       # k * mean / (sqrt(h_mid) + eps)
        scratch *= self.lr
        w -= scratch
        np.multiply(g, g, out=scratch)
        scratch *= 1.0 / k                       # h += k * mean^2
        h += scratch


def make_rule(spec: specs.Optimizer):
    if isinstance(spec, specs.SGD):
        return SGDRule(spec)
    if isinstance(spec, specs.Adam):
        return AdamRule(spec)
    if isinstance(spec, specs.Adagrad):
        return AdagradRule(spec)
    raise TypeError(f"no rule for {spec!r}")
