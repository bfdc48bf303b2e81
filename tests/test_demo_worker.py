"""`gradbus worker` run by itself (as the docker and k8s examples run it): its last line is a
JSON summary that carries the demo model's test accuracy, so whoever reads a worker's log
learns whether the run trained."""
from __future__ import annotations

import json
import subprocess
import sys


def test_worker_last_line_reports_test_accuracy(make_cluster):
    cluster = make_cluster(1)
    r = subprocess.run([sys.executable, "-m", "gradbus", "worker", "--broker", cluster.url,
                        "--index", "0", "--workers", "1", "--epochs", "3"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["done"] is True and last["worker"] == 0, last
    # 3 epochs of the whole training set reach well above chance (0.1) on the 10 digits
    assert 0.5 < last["test_accuracy"] <= 1.0, last
