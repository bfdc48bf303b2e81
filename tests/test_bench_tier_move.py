"""bench/tier_move.py: a drain of a tier member under pushing workers, in one JSON line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "tier_move.py")


def test_a_move_under_load_gives_its_line_and_every_push_is_applied_once():
    out = subprocess.run([sys.executable, BENCH, "--tensors", "4", "--size", "64K",
                          "--before", "0.5", "--after", "0.5"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["names_moved"] == r["expected_moved"] > 0 and r["all_applied_once"]
    assert r["move_bytes"] == r["names_moved"] * 3 * (64 << 10)     # weights, Adam's m and v
    assert r["move_s"] > 0 and r["pushes"] > 0 and r["updates_per_s_before"] > 0
