"""Optimizers: the rules the shard applies to each block.

Each rule is a class with ``state(n, dtype)`` (the per-block state arrays) and
``step(w, g, k, state, scratch, out=None)``: ``g`` is the *sum* of a batch of ``k`` gradients for
the flat block ``w``, and ``scratch`` a caller-owned buffer of ``w``'s size, so a step allocates
nothing. With ``out`` (where the backend ``steps_out``) the stepped values go there and ``w`` is
left as it is; the optimizer state is updated in place either way. ``ranged(w, g, k, state,
out=None)`` is the same step as ``run(sl, scratch)``, to be called once for each piece ``sl`` of
the block (its state advanced once, at ``ranged``): the pieces of a big block step at once on a
shard's pass threads (:mod:`gradbus.codecs.passes`), the same bits as one step.

A batch of ``k`` gradients is applied as ``k`` steps of their mean, in one pass: the optimizer
state advances in closed form by ``k`` steps (Adam's ``t += k``, ``m = b1^k m + (1-b1^k) mean``,
...), so the result barely depends on how the broker happened to batch the pushes. Plain SGD is
exactly ``w -= lr * sum``; momentum is exact for ``k`` equal gradients; Adam (exact for equal
gradients from a fresh state) moves ``k`` times the step taken at the advanced state, Adagrad
``k`` times the step taken at the middle of the ``k`` accumulations.

The elementwise math (closed-form coefficients and kernels) is in :mod:`.backend`. A rule runs
on the backend it was made with: by default :data:`CPU`, chunked numpy; ``backend.load()``
selects CuPy, or numba's fused loops, when they are usable.
"""
from __future__ import annotations

from gradbus.codecs import specs

from .backend import NumpyBackend

CPU = NumpyBackend(jit=False)


def _to(out) -> dict:
    """``out`` for a backend's step only when given: a backend that steps in place only (CuPy)
    takes no such argument."""
    return {} if out is None else {"out": out}


def _cut(a, sl):
    """``a[sl]``; ``a`` itself where ``sl`` or ``a`` is None (the whole block, no view)."""
    return a if sl is None or a is None else a[sl]


class SGDRule:
    def __init__(self, spec: specs.SGD, backend=CPU):
        self.lr, self.momentum, self.be = spec.lr, spec.momentum, backend

    def state(self, n: int, dtype) -> dict:
        return {"v": self.be.xp.zeros(n, dtype)} if self.momentum else {}

    def step_reading(self, w, reads: list, out, scratch) -> bool | None:
        """A step into ``out`` from gradients read a chunk at a time (see the backend's
        ``sgd_step_reading``): whether their sum was finite, or None (nothing read) where it
        cannot: with momentum (its state would move before the gradients are all checked), or
        on a backend without that loop."""
        stepper = None if self.momentum else getattr(self.be, "sgd_step_reading", None)
        return None if stepper is None else stepper(w, reads, self.lr, out, scratch)

    def step(self, w, g, k: int, st: dict, scratch, out=None) -> None:
        self.ranged(w, g, k, st, out)(None, scratch)

    def ranged(self, w, g, k: int, st: dict, out=None):
        """The step as ``run(sl, scratch)``: elements ``sl`` of it (None: all), so that pieces
        of a block may step at once (:mod:`gradbus.codecs.passes`); each element as :meth:`step` does."""
        if self.momentum:
            v, lr, mu = st["v"], self.lr, self.momentum
            return lambda sl, scratch: self.be.momentum_step(
                _cut(w, sl), _cut(g, sl), _cut(v, sl), k, lr, mu, scratch, **_to(_cut(out, sl)))
        return lambda sl, scratch: self.be.sgd_step(_cut(w, sl), _cut(g, sl), self.lr, scratch,
                                                    **_to(_cut(out, sl)))


class AdamRule:
    def __init__(self, spec: specs.Adam, backend=CPU):
        self.lr, (self.b1, self.b2), self.eps, self.be = spec.lr, spec.betas, spec.eps, backend

    def state(self, n: int, dtype) -> dict:
        return {"m": self.be.xp.zeros(n, dtype), "v": self.be.xp.zeros(n, dtype), "t": 0}

    def step(self, w, g, k: int, st: dict, scratch, out=None) -> None:
        self.ranged(w, g, k, st, out)(None, scratch)

    def ranged(self, w, g, k: int, st: dict, out=None):
        """As :meth:`SGDRule.ranged`; the step count advances here, once."""
        st["t"] += k
        m, v, t = st["m"], st["v"], st["t"]
        return lambda sl, scratch: self.be.adam_step(
            _cut(w, sl), _cut(g, sl), _cut(m, sl), _cut(v, sl), k, t, self.lr, self.b1,
            self.b2, self.eps, scratch, **_to(_cut(out, sl)))


class AdagradRule:
    def __init__(self, spec: specs.Adagrad, backend=CPU):
        self.lr, self.eps, self.be = spec.lr, spec.eps, backend

    def state(self, n: int, dtype) -> dict:
        return {"h": self.be.xp.zeros(n, dtype)}

    def step(self, w, g, k: int, st: dict, scratch, out=None) -> None:
        self.ranged(w, g, k, st, out)(None, scratch)

    def ranged(self, w, g, k: int, st: dict, out=None):
        """As :meth:`SGDRule.ranged`."""
        h = st["h"]
        return lambda sl, scratch: self.be.adagrad_step(
            _cut(w, sl), _cut(g, sl), _cut(h, sl), k, self.lr, self.eps, scratch,
            **_to(_cut(out, sl)))


def make_rule(spec: specs.Optimizer, backend=CPU):
    if isinstance(spec, specs.SGD):
        return SGDRule(spec, backend)
    if isinstance(spec, specs.Adam):
        return AdamRule(spec, backend)
    if isinstance(spec, specs.Adagrad):
        return AdagradRule(spec, backend)
    raise TypeError(f"no rule for {spec!r}")
