"""Optimizers: the one module that holds the update math. Every step updates in place.

Each rule is a class with ``state(n, dtype)`` (the per-block state arrays) and
``step(w, g, state, scratch)`` applying one summed gradient ``g`` to the flat block ``w``.
``scratch`` is a caller-owned buffer of ``w``'s size, so a step allocates nothing.
"""
from __future__ import annotations

import numpy as np

from gradbus.codecs import specs


class SGDRule:
    def __init__(self, spec: specs.SGD):
        self.lr, self.momentum = spec.lr, spec.momentum

    def state(self, n: int, dtype) -> dict:
        return {"v": np.zeros(n, dtype)} if self.momentum else {}

    def step(self, w: np.ndarray, g: np.ndarray, st: dict, scratch: np.ndarray) -> None:
        if self.momentum:
            v = st["v"]
            v *= self.momentum
            v += g
            g = v
        np.multiply(g, w.dtype.type(self.lr), out=scratch)
        w -= scratch


class AdamRule:
    def __init__(self, spec: specs.Adam):
        self.lr, (self.b1, self.b2), self.eps = spec.lr, spec.betas, spec.eps

    def state(self, n: int, dtype) -> dict:
        return {"m": np.zeros(n, dtype), "v": np.zeros(n, dtype), "t": 0}

    def step(self, w, g, st, scratch) -> None:
        m, v = st["m"], st["v"]
        st["t"] = t = st["t"] + 1
        m *= self.b1
        np.multiply(g, 1.0 - self.b1, out=scratch)
        m += scratch
        v *= self.b2
        np.multiply(g, g, out=scratch)
        scratch *= 1.0 - self.b2
        v += scratch
        # w -= lr * mhat / (sqrt(vhat) + eps), mhat = m/(1-b1^t), vhat = v/(1-b2^t)
        np.multiply(v, 1.0 / (1.0 - self.b2 ** t), out=scratch)
        np.sqrt(scratch, out=scratch)
        scratch += self.eps
        np.divide(m, scratch, out=scratch)
        scratch *= self.lr / (1.0 - self.b1 ** t)
        w -= scratch


class AdagradRule:
    def __init__(self, spec: specs.Adagrad):
        self.lr, self.eps = spec.lr, spec.eps

    def state(self, n: int, dtype) -> dict:
        return {"h": np.zeros(n, dtype)}

    def step(self, w, g, st, scratch) -> None:
        h = st["h"]
        np.multiply(g, g, out=scratch)
        h += scratch
        np.sqrt(h, out=scratch)
        scratch += self.eps
        np.divide(g, scratch, out=scratch)
        scratch *= self.lr
        w -= scratch


def make_rule(spec: specs.Optimizer):
    if isinstance(spec, specs.SGD):
        return SGDRule(spec)
    if isinstance(spec, specs.Adam):
        return AdamRule(spec)
    if isinstance(spec, specs.Adagrad):
        return AdagradRule(spec)
    raise TypeError(f"no rule for {spec!r}")
