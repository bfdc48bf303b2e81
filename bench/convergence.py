"""Accuracy against bytes: the demo's model trained through gradbus with each gradient codec.

For each configuration it runs the full demo (a local cluster, 2 asynchronous workers, the
digits MLP) and prints one JSON line: final test accuracy, gradient bytes on the wire, their
ratio to raw float32, and the accuracy gap to the raw run of the same invocation.

Usage: python bench/convergence.py [--seeds 0,1] [--epochs N] [--only "raw;topk:0.01"]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

CONFIGS = [  # (name, codec chain, error feedback, local accumulation); bf16 is never fed back
    ("raw", "raw", True, 1),
    ("bf16", "bf16", True, 1),
    ("int8", "int8", True, 1),
    ("sign", "sign", True, 1),
    ("sign, no EF", "sign", False, 1),
    ("topk:0.01", "topk:0.01", True, 1),
    ("topk:0.01, no EF", "topk:0.01", False, 1),
    ("topk:0.01|int8|zstd", "topk:0.01|int8|zstd", True, 1),
    ("topk:0.01|int8|zstd, no EF", "topk:0.01|int8|zstd", False, 1),
    ("topk:0.001", "topk:0.001", True, 1),
    ("topk:0.001, no EF", "topk:0.001", False, 1),
    ("raw, accumulate 4", "raw", True, 4),
    ("topk:0.01|int8|zstd, accumulate 4", "topk:0.01|int8|zstd", True, 4),
]


def main(argv=None) -> None:
    from gradbus import demo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--only", default=None, help="semicolon-separated config names")
    ap.add_argument("--optimizer", default="momentum", choices=["momentum", "adam"],
                    help="server-side rule (momentum SGD is the usual one under sparsification)")
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    only = set(a.only.split(";")) if a.only else None
    raw_acc, raw_bytes = None, None
    for name, chain, ef, acc in CONFIGS:
        if only and name not in only and name != "raw":
            continue
        runs = [demo.run(codec=chain, error_feedback=ef, accumulate=acc, seed=s,
                         epochs=a.epochs, echo=lambda *_: None, baseline=False,
                         optimizer=a.optimizer) for s in seeds]
        accuracy = statistics.mean(r["test_accuracy"] for r in runs)
        pbytes = statistics.mean(r["push_bytes"] for r in runs)
        if name == "raw":
            raw_acc, raw_bytes = accuracy, pbytes
        print(json.dumps({"bench": "convergence", "config": name, "codec": chain,
                          "optimizer": a.optimizer,
                          "error_feedback": ef, "accumulate": acc, "seeds": seeds,
                          "test_accuracy": round(accuracy, 4),
                          "accuracy_gap_pp": round(100 * (accuracy - raw_acc), 2),
                          "push_bytes": int(pbytes),
                          "bytes_vs_raw": round(raw_bytes / pbytes, 1) if pbytes else None,
                          "pushes": runs[0]["pushes"]}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
