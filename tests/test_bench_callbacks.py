"""bench/callbacks.py: push to callback times for each way of waiting."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "callbacks.py")


def test_every_pattern_gives_a_line_with_its_times():
    out = subprocess.run([sys.executable, BENCH, "--pushes", "20"], capture_output=True,
                         text=True, timeout=300, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["pattern"] for r in lines] == ["callbacks_only", "after_a_waited_push",
                                             "waited_with_callback"]
    for r in lines:
        assert r["pushes"] == 20 and r["bytes"] == 4096
        assert 0 < r["callback_p50_ms"] <= r["callback_p90_ms"] <= r["callback_max_ms"], r
        assert r["client_cpu_us_per_push"] > 0


def test_bad_arguments_are_refused():
    for args in (["--patterns", "nope"], ["--pushes", "0"], ["--size", "9G"]):
        out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "error" in out.stderr
