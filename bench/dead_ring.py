"""How long a SIGKILLed worker's shared-memory ring outlives it while other workers push.

``gradbus up --shards 2 --replicas 2`` on a shared-memory directory of its own
(``$GRADBUS_SHM_DIR``), ``--workers`` worker processes pushing ``--mb`` MiB gradients without
pause (window 8). One of them is SIGKILLed ``--rounds`` times while it holds ring slots, and
started again once its segments are gone (or after ``--limit`` seconds). Per round: the
seconds from the SIGKILL until none of its segments is left in the directory (None: still
there after the limit), and the number of gradbus segments then.

One JSON line. Usage: python bench/dead_ring.py [--workers 3] [--rounds 5] [--mb 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from gradbus.codecs import shm

WORKER = r"""
import sys
import numpy as np
import gradbus
n = int(sys.argv[2])
with gradbus.connect(sys.argv[1], block_bytes=1 << 16, window=8) as c:
    assert c.shm is not None, "no shared memory"
    c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=0.01))
    g = {"w": np.ones(n, np.float32)}
    print("pushing", flush=True)
    while True:
        c.push(g)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--limit", type=float, default=60.0)
    a = ap.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    d = tempfile.mkdtemp(prefix="gradbus-bench-", dir=base)
    env = {**os.environ, "GRADBUS_SHM_DIR": d}
    n = int(a.mb * (1 << 20)) // 4
    up = subprocess.Popen([sys.executable, "-m", "gradbus", "up", "--shards", "2",
                           "--replicas", "2", "--port", "0"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    workers: list = []

    def start():
        p = subprocess.Popen([sys.executable, "-c", WORKER, url, str(n)], env=env,
                             stdout=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "pushing":
            raise RuntimeError("a worker did not start")
        return p

    def segs(pid=None):
        return [x for x in os.listdir(d) if (o := shm.owned(x)) and (pid is None or o[2] == pid)]

    rounds = []
    try:
        line = up.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"up said {line!r}")
        url = line.split()[-1]
        workers = [start() for _ in range(a.workers)]
        for _ in range(a.rounds):
            time.sleep(2.0)                  # pushing, slots held
            victim = workers[0]
            had = len(segs(victim.pid))
            victim.send_signal(signal.SIGKILL)
            t = time.monotonic()
            victim.wait()
            victim.stdout.close()
            while segs(victim.pid) and time.monotonic() - t < a.limit:
                time.sleep(0.05)
            gone = None if segs(victim.pid) else round(time.monotonic() - t, 2)
            rounds.append({"segments": had, "gone_s": gone, "left": len(segs())})
            workers[0] = start()
    finally:
        for p in workers:
            p.kill()
            p.wait()
            p.stdout.close()
        up.terminate()
        up.wait(60)
        up.stdout.close()
        shutil.rmtree(d, ignore_errors=True)
    done = [r["gone_s"] for r in rounds if r["gone_s"] is not None]
    print(json.dumps({"bench": "dead_ring", "workers": a.workers, "mb": a.mb,
                      "rounds": rounds, "gone_s_max": max(done) if done else None,
                      "kept_past_limit": sum(1 for r in rounds if r["gone_s"] is None)}))


if __name__ == "__main__":
    main()
