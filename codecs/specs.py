"""Optimizer and initializer specs: what an INIT message says, validated at every boundary.

The math lives in ``gradbus.shards.optim`` (optimizers) and ``gradbus.shards.store``
(initializers); these classes only name a rule and its hyper-parameters.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .errors import Code, WireError


def _num(d: dict, name: str, lo: float = -math.inf, hi: float = math.inf,
         lo_open: bool = False) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError(Code.BAD_FIELD, f"{name} must be a finite number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise WireError(Code.BAD_FIELD, f"{name}={v} out of range")
    return float(v)


@dataclass(frozen=True)
class SGD:
    """``w -= lr * g``; with momentum ``v = momentum*v + g; w -= lr * v``."""

    lr: float
    momentum: float = 0.0
    name: str = field(default="sgd", init=False)

    def to_wire(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Adam:
    """Adam with bias correction (Kingma & Ba)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    name: str = field(default="adam", init=False)

    def to_wire(self) -> dict:
        return {"name": "adam", "lr": self.lr, "betas": list(self.betas), "eps": self.eps}


@dataclass(frozen=True)
class Adagrad:
    """``h += g*g; w -= lr * g / (sqrt(h) + eps)``."""

    lr: float
    eps: float = 1e-10
    name: str = field(default="adagrad", init=False)

    def to_wire(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FTRL:
    """FTRL-Proximal (McMahan et al., 2013), per coordinate, for embedding table rows:
    ``sigma = (sqrt(n + g*g) - sqrt(n)) / lr; z += g - sigma*w; n += g*g;
    w = 0 if |z| <= l1 else -(z - sign(z)*l1) / ((beta + sqrt(n))/lr + l2)``."""

    lr: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    name: str = field(default="ftrl", init=False)

    def to_wire(self) -> dict:
        return asdict(self)


Optimizer = SGD | Adam | Adagrad | FTRL


def optimizer_from_wire(d) -> Optimizer:
    if not isinstance(d, dict):
        raise WireError(Code.BAD_FIELD, "optimizer must be a map")
    name = d.get("name")
    if name == "sgd":
        momentum = _num(d, "momentum", 0, 1) if "momentum" in d else 0.0
        if momentum >= 1:
            raise WireError(Code.BAD_FIELD, "momentum must be below 1")
        return SGD(_num(d, "lr", 0, lo_open=True), momentum)
    if name == "adam":
        betas = d.get("betas", [0.9, 0.999])
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise WireError(Code.BAD_FIELD, "adam betas must be two numbers")
        b = {"b1": betas[0], "b2": betas[1]}
        b1, b2 = _num(b, "b1", 0, 1), _num(b, "b2", 0, 1)
        if b1 >= 1 or b2 >= 1:
            raise WireError(Code.BAD_FIELD, "adam betas must be below 1")
        return Adam(_num(d, "lr", 0, lo_open=True), (b1, b2),
                    _num(d, "eps", 0, lo_open=True) if "eps" in d else 1e-8)
    if name == "adagrad":
        return Adagrad(_num(d, "lr", 0, lo_open=True),
                       _num(d, "eps", 0, lo_open=True) if "eps" in d else 1e-10)
    if name == "ftrl":
        return FTRL(_num(d, "lr", 0, lo_open=True),
                    *(_num(d, k, 0) if k in d else dflt
                      for k, dflt in (("beta", 1.0), ("l1", 0.0), ("l2", 0.0))))
    raise WireError(Code.BAD_FIELD, f"unknown optimizer {name!r}")


@dataclass(frozen=True)
class Initializer:
    """Base: a shape, a dtype and a rule the shard applies block by block. A table's rows
    take the rule alone (``init_table(..., gradbus.Normal(std=0.01))``): no shape needed."""

    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    def params(self) -> dict:
        return {}

    def to_wire(self) -> dict:
        return {"name": self.kind, **self.params()}

    kind = ""


@dataclass(frozen=True)
class Zeros(Initializer):
    kind = "zeros"


@dataclass(frozen=True)
class Constant(Initializer):
    value: float = 0.0
    kind = "constant"

    def params(self) -> dict:
        return {"value": self.value}


@dataclass(frozen=True)
class Normal(Initializer):
    mean: float = 0.0
    std: float = 1.0
    seed: int = 0
    kind = "normal"

    def params(self) -> dict:
        return {"mean": self.mean, "std": self.std, "seed": self.seed}


@dataclass(frozen=True)
class Uniform(Initializer):
    low: float = -1.0
    high: float = 1.0
    seed: int = 0
    kind = "uniform"

    def params(self) -> dict:
        return {"low": self.low, "high": self.high, "seed": self.seed}


def validate_init_rule(d) -> dict:
    """Check an initializer rule from the wire; returns it (a plain map)."""
    if not isinstance(d, dict):
        raise WireError(Code.BAD_FIELD, "init rule must be a map")
    name = d.get("name")
    if name in ("given", "zeros"):
        return d
    if name == "constant":
        _num(d, "value")
    elif name == "normal":
        _num(d, "mean"), _num(d, "std", 0)
        _int_seed(d)
    elif name == "uniform":
        lo, hi = _num(d, "low"), _num(d, "high")
        if hi < lo:
            raise WireError(Code.BAD_FIELD, "uniform needs low <= high")
        _int_seed(d)
    else:
        raise WireError(Code.BAD_FIELD, f"unknown initializer {name!r}")
    return d


def _int_seed(d: dict) -> None:
    s = d.get("seed", 0)
    if isinstance(s, bool) or not isinstance(s, int) or s < 0 or s >= 2**63:
        raise WireError(Code.BAD_FIELD, "seed must be a non-negative int64")


TABLE_OPTIMIZERS = ("sgd", "adagrad", "ftrl")
MAX_TABLE_DIM = 1 << 16


def table_from_wire(d) -> dict:
    """Check a table's settings from the wire; returns the normalized map
    ``{"dim", "dtype", "init", "opt", "expiry", "min_count", "cons", "spread"}``."""
    if not isinstance(d, dict):
        raise WireError(Code.BAD_FIELD, "table settings must be a map")
    dim, dtype = d.get("dim"), d.get("dtype", "float32")
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_TABLE_DIM:
        raise WireError(Code.BAD_FIELD, f"table dim must be an int in 1..{MAX_TABLE_DIM}, "
                                        f"got {dim!r}")
    if dtype not in ("float32", "float64"):
        raise WireError(Code.BAD_DTYPE, f"table rows must be float32 or float64, not {dtype!r}")
    init = validate_init_rule(d.get("init", {"name": "zeros"}))
    if init["name"] == "given":
        raise WireError(Code.BAD_FIELD, "a table's rows are created on first touch: its "
                                        "initializer must be zeros, constant, normal or uniform")
    opt = d.get("opt")
    spec = optimizer_from_wire(opt)
    if spec.name not in TABLE_OPTIMIZERS or getattr(spec, "momentum", 0.0):
        raise WireError(Code.BAD_FIELD, f"table rows take sgd (no momentum), adagrad or ftrl, "
                                        f"not {spec}")
    expiry = _num(d, "expiry", 0) if "expiry" in d else 0.0
    mc = d.get("min_count", 1)
    if isinstance(mc, bool) or not isinstance(mc, int) or not 1 <= mc < 2**31:
        raise WireError(Code.BAD_FIELD, f"min_count must be a positive int, got {mc!r}")
    spread = d.get("spread", 0)
    if isinstance(spread, bool) or not isinstance(spread, int) or not 0 <= spread <= 65535:
        raise WireError(Code.BAD_FIELD, f"spread must be an int in 0..65535 (0: every "
                                        f"partition), got {spread!r}")
    try:
        cons = consistency_from_wire(d.get("cons"))
    except ValueError as e:
        raise WireError(Code.BAD_FIELD, f"table consistency: {e}") from None
    return {"dim": dim, "dtype": dtype, "init": dict(init), "opt": spec.to_wire(),
            "expiry": expiry, "min_count": mc, "cons": cons, "spread": spread}


CONSISTENCY_POLICIES = ("refuse", "delay")


def parse_consistency(text: str | None, policy: str = "refuse", scale_lr: bool = False) -> dict:
    """``"async"`` (default), ``"ssp:S"`` (a push computed on weights more than S versions old
    is refused, or with policy ``delay`` reads wait until the weights are at most S versions
    behind) or ``"bsp:N"`` (a step is applied once N workers' gradients for it are in, or every
    live worker's when fewer are left). ``scale_lr``: each gradient is scaled by
    1/max(1, staleness). Returns the wire form ``{"mode", "n", "policy", "scale"}``."""
    text = text or "async"
    if policy not in CONSISTENCY_POLICIES:
        raise ValueError(f"consistency policy must be one of {CONSISTENCY_POLICIES}")
    mode, _, arg = text.partition(":")
    if mode == "async" and not arg:
        n = 0
    elif mode in ("ssp", "bsp") and arg.isdigit() and (int(arg) >= 1 or mode == "ssp"):
        n = int(arg)
    else:
        raise ValueError(f"consistency must be async, ssp:S (S >= 0) or bsp:N (N >= 1), "
                         f"not {text!r}")
    return {"mode": mode, "n": n, "policy": policy, "scale": bool(scale_lr)}


def consistency_from_wire(d) -> dict:
    if d is None:
        return {"mode": "async", "n": 0, "policy": "refuse", "scale": False}
    if not isinstance(d, dict):
        raise ValueError("consistency must be a map")
    mode, n = d.get("mode"), d.get("n", 0)
    if mode == "async":
        text = "async"
    elif isinstance(n, int) and not isinstance(n, bool):
        text = f"{mode}:{n}"
    else:
        raise ValueError(f"bad consistency {d!r}")
    return parse_consistency(text, d.get("policy", "refuse"), bool(d.get("scale", False)))
