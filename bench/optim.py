"""CPU optimizer steps against a fused single-pass reference, measured in the same run.

For each rule and size it times one step (the sum of ``k`` gradients) on float32 params with:

    numpy      the shard's default path: shards/backend.py's chunked numpy
    numba      the same backend's numba loops (when numba imports)
    reference  plain @njit(fastmath=False, parallel=False) loops over the same math, written here

and prints one JSON line per (rule, size, implementation):

    gparams_s  params updated per second / 1e9 (best of --repeats, implementations interleaved)
    ratio      gparams_s / the reference's gparams_s

The reference loops use ``error_model="numpy"`` (IEEE division, numpy's semantics): numba's
default raises ZeroDivisionError from inside the loop, and that branch keeps LLVM from
vectorizing Adam and Adagrad. The reference needs numba (pip install numba).

Usage: python bench/optim.py [--sizes 1M,16M,64M] [--rules sgd,momentum,adam,adagrad] [--k 1]
                             [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from gradbus.codecs import specs
from gradbus.shards import backend, optim

SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}
SPECS = {"sgd": specs.SGD(lr=1e-3), "momentum": specs.SGD(lr=1e-3, momentum=0.9),
         "adam": specs.Adam(lr=1e-3), "adagrad": specs.Adagrad(lr=1e-2)}
STATE = {"sgd": (), "momentum": ("v",), "adam": ("m", "v"), "adagrad": ("h",)}


def _reference_loops():
    from numba import njit

    jit = njit(fastmath=False, parallel=False, error_model="numpy")

    @jit
    def sgd(w, g, lr):
        for i in range(w.size):
            w[i] -= lr * g[i]

    @jit
    def momentum(w, g, v, a, b, c, d):
        for i in range(w.size):
            vi = v[i]
            w[i] -= a * vi + b * g[i]
            v[i] = c * vi + d * g[i]

    @jit
    def adam(w, g, m, v, b1k, c1, b2k, c2, eps, lr):
        for i in range(w.size):
            mi = b1k * m[i] + c1 * g[i]
            vi = b2k * v[i] + c2 * g[i] * g[i]
            m[i] = mi
            v[i] = vi
            w[i] -= lr * mi / (np.sqrt(vi) + eps)

    @jit
    def adagrad(w, g, h, ia, ik, eps, lr):
        for i in range(w.size):
            gg = g[i] * g[i]
            w[i] -= lr * g[i] / (np.sqrt(h[i] + ia * gg) + eps)
            h[i] += ik * gg

    return {"sgd": sgd, "momentum": momentum, "adam": adam, "adagrad": adagrad}


def _reference_args(name: str, spec, k: int) -> tuple:
    """The reference's scalars (float32) for one step of k gradients, from a fresh state."""
    if name == "sgd":
        coefs = (spec.lr,)
    elif name == "momentum":
        coefs = backend.momentum_coefs(k, spec.lr, spec.momentum)
    elif name == "adam":
        coefs = backend.adam_coefs(k, k, spec.lr, *spec.betas, spec.eps)
    else:
        coefs = (*backend.adagrad_coefs(k), spec.eps, spec.lr)
    return tuple(np.float32(c) for c in coefs)


def _best(fns: dict, repeats: int, calls: int) -> dict:
    """Best seconds per call of each function, the functions interleaved round by round."""
    for fn in fns.values():
        fn()                                   # warm-up: page faults, numba dispatch
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def bench(name: str, n: int, k: int, repeats: int, impls: dict, loops: dict) -> list[dict]:
    """One line per implementation (``impls``: name -> backend) and the reference."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    scratch = np.empty(n, np.float32)
    spec = SPECS[name]
    rules = {impl: optim.make_rule(spec, be) for impl, be in impls.items()}
    st = optim.make_rule(spec).state(n, w.dtype)   # one state, advanced by every implementation
    fns = {impl: (lambda r=r: r.step(w, g, k, st, scratch)) for impl, r in rules.items()}
    ref, args, arrays = loops[name], _reference_args(name, spec, k), [st[s] for s in STATE[name]]
    fns["reference"] = lambda: ref(w, g, *arrays, *args)
    secs = _best(fns, repeats, calls=max(1, (16 << 20) // n))
    return [{"bench": "optim", "rule": name, "n": n, "dtype": "float32", "k": k, "impl": impl,
             "gparams_s": round(n / s / 1e9, 3), "ratio": round(secs["reference"] / s, 3)}
            for impl, s in secs.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--rules", default=",".join(SPECS))
    ap.add_argument("--k", type=int, default=1, help="gradients summed per step")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    try:
        loops = _reference_loops()
    except ImportError:
        print("bench/optim.py: the reference needs numba (pip install numba)", file=sys.stderr)
        return 2
    impls = {"numpy": optim.CPU, "numba": backend.NumpyBackend(jit=True)}
    for size in a.sizes.split(","):
        for name in a.rules.split(","):
            for line in bench(name, SIZES[size], a.k, a.repeats, impls, loops):
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
