"""The processes of a ledger run in emulated hosts (tests/test_pair_split.py, bench/nemesis.py):
clients that push ``acks="all"`` one-hot rows of one shared ledger tensor (SGD, lr 1), each
into rows of its own, so that after the run ``-ledger[j]`` is how many times row ``j`` was
applied; and the one-shot questions asked from inside a host. Run as a script, each mode
prints one JSON line::

    ledger_child.py init URLS ROWS          the ledger tensor, ROWS rows in all
    ledger_child.py push URLS FIRST ROWS OUT
        push rows FIRST.. until OUT.stop exists (or ROWS were pushed); OUT.progress says how
        far it got meanwhile; then waits for the answers and prints
        {"sent": n, "acked": {row: monotonic time of its ack}, "failed": {row: error}}
    ledger_child.py ledger URLS             once fully replicated: the rows applied
        ({row: value}, values != 0) and each partition's copies ([seq, digest] each)
    ledger_child.py role URL                the broker's pair state: [role, epoch, peer's role,
        quorum, live shards, partitions under-replicated], or the error asking it gave
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

import gradbus
from gradbus import admin

NAME = "ledger"


def init(urls: str, rows: int) -> dict:
    with gradbus.connect(urls, timeout=60) as c:
        c.init({NAME: np.zeros(rows, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        return {"rows": rows}


def push(urls: str, first: int, rows: int, out: str) -> dict:
    acked, failed, lock = {}, {}, threading.Lock()

    def settled(i):
        def cb(f):
            t, e = time.monotonic(), f.exception()
            with lock:
                if e is None:
                    acked[i] = t
                else:
                    failed[i] = str(e)[:200]
        return cb
    futs, i = [], 0
    with gradbus.connect(urls, timeout=60, window=8) as c:
        size = c.pull([NAME], timeout=60)[NAME].size
        while i < rows and not os.path.exists(out + ".stop"):
            g = np.zeros(size, np.float32)
            g[first + i] = 1.0
            try:
                f = c.push({NAME: g}, acks="all", timeout=0.3)
            except gradbus.BackPressureError:
                f = None          # not sent: the same row again
            if f is not None:
                f.add_done_callback(settled(first + i))
                futs.append(f)
                i += 1
                try:
                    f.result(0.3)
                except Exception:
                    pass
            with lock:
                state = {"sent": i, "acked": len(acked)}
            with open(out + ".tmp", "w") as fh:
                json.dump(state, fh)
            os.replace(out + ".tmp", out + ".progress")
        end = time.monotonic() + 60
        for f in futs:
            try:
                f.result(max(0.01, end - time.monotonic()))
            except Exception:
                pass
    with lock:
        return {"sent": i, "acked": acked, "failed": failed}


def ledger(urls: str) -> dict:
    deadline = time.monotonic() + 60
    while admin.status(urls, timeout=5)["under_replicated"] and time.monotonic() < deadline:
        time.sleep(0.05)
    copies: dict = {}
    for parts in admin.digest(urls).values():
        for p, sd in parts.items():
            copies.setdefault(str(p), []).append(list(sd))
    with gradbus.connect(urls, timeout=60) as c:
        w = c.pull([NAME], timeout=60)[NAME]
    return {"w": {int(j): float(w[j]) for j in np.flatnonzero(w)}, "copies": copies}


def role(url: str):
    try:
        st = admin.status(url, timeout=2.0)
    except gradbus.GradbusError as e:
        return str(e)
    p = st["pair"]
    return [p["role"], p["epoch"], p["peer"]["role"], p.get("quorum"),
            sum(s["alive"] for s in st["shards"]), st["under_replicated"]]


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    if mode == "init":
        got = init(args[0], int(args[1]))
    elif mode == "push":
        got = push(args[0], int(args[1]), int(args[2]), args[3])
    elif mode == "ledger":
        got = ledger(args[0])
    else:
        got = role(args[0])
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
