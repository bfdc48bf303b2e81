"""GPU kernels against the device's copy bandwidth, measured in the same run.

On a CUDA device it times, with CUDA events, the CuPy backend's fused Adam step over 64M float32
params, its sum of 8 gradients of 64M floats, and the two in one kernel (a batch of 8 summed
inside the Adam step, as a shard applies one), and prints one JSON line each:

    gbps       bytes read + written per second / 1e9 (Adam: w, g, m, v read, w, m, v written:
               28 B a param; the sum: 8 gradients read, 1 written: 36 B an element; the sum in
               the step: 8 gradients and w, m, v read, w, m, v written: 56 B a param)
    copy_gbps  the same for a cupy copy of a 1 GiB array into another (2 GiB moved a copy)
    ratio      gbps / copy_gbps

Without cupy or a device it prints {"bench": "gpu", "skipped": "no GPU"} and exits 0.

Usage: python bench/gpu.py [--n ELEMENTS] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import sys

from gradbus.shards import backend


def _seconds(cp, fn, repeats: int) -> float:
    """Device seconds per call of ``fn``, after one warm-up call (which compiles kernels)."""
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64 << 20, help="elements per array")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        be = backend.CupyBackend()
    except backend.BackendError:
        print(json.dumps({"bench": "gpu", "skipped": "no GPU"}))
        return 0
    cp, n = be.xp, a.n
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()

    src = cp.ones(1 << 28, cp.float32)                 # 1 GiB
    dst = cp.empty_like(src)
    copy_gbps = 2 * src.nbytes / _seconds(cp, lambda: cp.copyto(dst, src), a.repeats) / 1e9

    def line(op: str, nbytes: int, secs: float) -> str:
        gbps = nbytes / secs / 1e9
        return json.dumps({"bench": "gpu", "op": op, "n": n, "dtype": "float32", "device": device,
                           "gbps": round(gbps, 1), "copy_gbps": round(copy_gbps, 1),
                           "ratio": round(gbps / copy_gbps, 3)})

    rng = cp.random.default_rng(0)
    w, g, m = (rng.standard_normal(n, dtype=cp.float32) for _ in range(3))
    v = cp.abs(rng.standard_normal(n, dtype=cp.float32))
    secs = _seconds(cp, lambda: be.adam_step(w, g, m, v, 1, 1, 1e-3, 0.9, 0.999, 1e-8), a.repeats)
    print(line("adam_step", 28 * n, secs), flush=True)

    grads = [g] + [rng.standard_normal(n, dtype=cp.float32) for _ in range(7)]
    out = cp.empty_like(g)
    print(line("sum_into_8", 36 * n, _seconds(cp, lambda: be.sum_into(out, grads), a.repeats)),
          flush=True)
    secs = _seconds(cp, lambda: be.adam_step(w, grads, m, v, 8, 8, 1e-3, 0.9, 0.999, 1e-8),
                    a.repeats)
    print(line("adam_step_sum_8", 56 * n, secs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
