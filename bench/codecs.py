"""Speed and compression of the tensor codec chains (gradbus.codecs.tensor) on gradient-like data.

For each gradient size (float32 elements, normal with standard deviation ``--scale``, like real
gradients) and each chain it prints one JSON line::

    {"bench": "codecs", "size": elements, "chain": ..., "applied": applied chain,
     "encode_gbps": ..., "decode_gbps": ..., "ratio": ...}

    encode_gbps   float32 input bytes / seconds of tensor.encode (best of --repeat runs)
    decode_gbps   float32 input bytes / seconds of tensor.decode of the frame's bytes (best of
                  --repeat); raw decodes to a view of the frame, so its figure is not a copy speed
    ratio         float32 input bytes / encoded bytes

``fp16-naive`` and ``bf16-naive`` are the codecs' previous implementations (numpy's float16 cast,
and the bf16 rounding on whole-array temporaries), measured in the same run for comparison.

Usage: python bench/codecs.py [--sizes 1M,16M] [--chains raw,fp16,...] [--repeat 5] [--scale 1e-3]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gradbus.codecs import tensor

CHAINS = ["raw", "fp16", "fp16-naive", "bf16", "bf16-naive", "int8", "sign", "topk:0.01",
          "topk:0.001", "randomk:0.01", "topk:0.01|int8|zstd", "bf16|zstd", "raw|zstd",
          "raw|shuffle|zstd"]
SIZES = {"1M": 1 << 20, "16M": 16 << 20}
MAX_BYTES = 1 << 31


def _fp16_naive_encode(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return a.astype(np.float16)


def _fp16_naive_decode(buf: bytes, n: int) -> np.ndarray:
    return np.frombuffer(buf, np.float16, n).astype(np.float32)


def _bf16_naive_encode(a: np.ndarray) -> np.ndarray:
    u = a.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _bf16_naive_decode(buf: bytes, n: int) -> np.ndarray:
    return (np.frombuffer(buf, np.uint16, n).astype(np.uint32) << np.uint32(16)).view(np.float32)


NAIVE = {"fp16-naive": (_fp16_naive_encode, _fp16_naive_decode),
         "bf16-naive": (_bf16_naive_encode, _bf16_naive_decode)}


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(g: np.ndarray, chain: str, repeat: int, rng: np.random.Generator) -> dict:
    n = g.size
    if chain in NAIVE:
        enc, dec = NAIVE[chain]
        applied = chain
        frame = enc(g).tobytes()
        t_enc = best_time(lambda: enc(g), repeat)
        t_dec = best_time(lambda: dec(frame, n), repeat)
    else:
        applied, buf = tensor.encode(g, chain, rng=rng)
        frame = memoryview(buf).tobytes()   # what a ZeroMQ receiver gets
        t_enc = best_time(lambda: tensor.encode(g, chain, rng=rng), repeat)
        t_dec = best_time(lambda: tensor.decode(frame, applied, "float32", g.shape, MAX_BYTES),
                          repeat)
    return {"bench": "codecs", "size": n, "chain": chain, "applied": applied,
            "encode_gbps": round(g.nbytes / t_enc / 1e9, 3),
            "decode_gbps": round(g.nbytes / t_dec / 1e9, 3),
            "ratio": round(g.nbytes / len(frame), 2)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1M,16M", help=f"comma list of {sorted(SIZES)} or integers")
    p.add_argument("--chains", default=",".join(CHAINS), help="comma list of chains")
    p.add_argument("--repeat", type=int, default=5, help="runs per measurement (best is kept)")
    p.add_argument("--scale", type=float, default=1e-3, help="standard deviation of the gradient")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    for size in args.sizes.split(","):
        n = SIZES[size] if size in SIZES else int(size)
        g = (rng.standard_normal(n) * args.scale).astype(np.float32)
        for chain in args.chains.split(","):
            print(json.dumps(measure(g, chain, args.repeat, rng)), flush=True)


if __name__ == "__main__":
    main()
