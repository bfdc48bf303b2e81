"""bench/push_cpu.py: CPU per push in the broker and one client, by depth."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "push_cpu.py")


def test_each_depth_gets_a_line_with_every_process_figure():
    out = subprocess.run([sys.executable, BENCH, "--size", "4K", "--depths", "1,4",
                          "--pushes", "60", "--warmup", "10", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["depth"] for r in lines] == [1, 4]
    for r in lines:
        assert r["bench"] == "push_cpu" and r["pushes"] == 60 and len(r["rounds"]) == 2
        for k in ("us_per_push", "broker_cpu_us", "client_cpu_us", "broker_switches",
                  "client_switches"):
            assert r[k] >= 0 and all(rd[k] >= 0 for rd in r["rounds"]), (k, r)
        assert r["us_per_push"] > 0
        # the line's figures are the medians of its rounds
        for k in ("us_per_push", "broker_cpu_us", "client_switches"):
            lo, hi = sorted(rd[k] for rd in r["rounds"])
            assert abs(r[k] - (lo + hi) / 2) < 0.02, (k, r)


def test_bad_arguments_are_refused():
    for args in (["--depths", "0"], ["--depths", "x"], ["--pushes", "0"], ["--rounds", "0"]):
        out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "error" in out.stderr, args
