"""bench/passes.py: one big block's step on 1, 2, ... pass threads, a line per configuration."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "passes.py")


def test_each_thread_count_and_optimizer_gets_a_line(shm_dir):
    out = subprocess.run([sys.executable, BENCH, "--size", "4M", "--threads", "1,2,4",
                          "--repeat", "3", "--pushes", "2", "--opts", "sgd,adam"],
                         capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [(r["opt"], r["threads"]) for r in lines] == [
        ("sgd", 1), ("sgd", 2), ("sgd", 4), ("adam", 1), ("adam", 2), ("adam", 4)]
    for r in lines:
        assert r["bench"] == "passes" and r["size"] == 4 << 20 and r["pushes"] == 2
        assert r["ms_per_step"] > 0 and r["gb_per_s"] > 0 and r["cores"] >= 1
        # a 4 MiB block: one piece per thread, at most one per 512 KiB
        assert r["pieces"] == min(r["threads"], 8)
        base = next(b for b in lines if b["opt"] == r["opt"] and b["threads"] == 1)
        assert abs(r["speedup"] - base["ms_per_step"] / r["ms_per_step"]) < 0.02


def test_bad_arguments_are_refused():
    for args in (["--threads", "0"], ["--threads", "two"], ["--opts", "lbfgs"]):
        out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "error" in out.stderr, args
