"""bench/calls.py: Python calls per push in each process, from two run lengths."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "calls.py")


def test_calls_per_push_are_counted_for_every_process():
    out = subprocess.run([sys.executable, BENCH, "--size", "4K", "--pushes", "20", "--more",
                          "40", "--configs", "inproc"], capture_output=True, text=True,
                         timeout=300, check=True)
    (line,) = out.stdout.splitlines()
    res = json.loads(line)
    assert res["config"] == "inproc" and res["pushes"] == 40
    calls = res["calls_per_push"]
    # a push costs every process some calls, and no process thousands of them
    assert set(calls) == {"broker", "worker"}
    assert all(50 < v < 5000 for v in calls.values()), calls
    assert res["broker_top"] and all(not k.startswith("~:") for k, _ in res["broker_top"])


def test_bad_arguments_are_refused():
    for args in (["--configs", "nope"], ["--pushes", "0"]):
        out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "error" in out.stderr
