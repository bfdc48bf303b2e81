"""A crowd of small clients against one cluster, in rounds: does the second round keep the first
round's rate?

``gradbus up --shards S`` runs once; each round starts ``--clients`` SDK clients (processes of
``--per-process`` clients each, threads), every one pushing a small tensor (``--size``) with
``acks=1``, ``--depth`` pushes in flight, for ``--seconds``; then they close and the next round
starts fresh clients against the same cluster (new ids, new push rings), as workers of a job
that restarts do. One JSON line per round: pushes acknowledged per second (all clients, over
the round's window after ``--warmup``), the broker's, shards' and clients' CPU microseconds per push in
that window, and their open descriptors and mapped gradbus segments at the round's end; a last
line gives the last round's rate over the first's.

``--inproc`` runs the shards inside the broker's process (``gradbus up --inproc``).

Usage: python bench/crowd.py [--clients 50] [--rounds 2] [--seconds 15] [--size 4K]
                             [--depth 1] [--shards 1] [--per-process 5] [--inproc]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (gradbus up and its ending)
import throughput  # noqa: E402  (sizes, free ports)

SIZES = {"1K": 1 << 10, "4K": 4 << 10, "64K": 64 << 10}


def _clients(url: str, first: int, count: int, nbytes: int, depth: int, counters, stop) -> None:
    """``count`` clients in threads of this process, client i counting in ``counters[i]``."""
    import collections

    import gradbus

    def run(i: int) -> None:
        n = nbytes // 4
        with gradbus.connect(url, timeout=120) as c:
            c.init({"crowd": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-6))
            g = np.ones(n, np.float32)
            waiting: collections.deque = collections.deque()
            while not stop.value:
                waiting.append(c.push({"crowd": g}, acks=1))
                if len(waiting) >= depth:
                    waiting.popleft().result(120)
                    counters[i] += 1
            for f in waiting:
                f.result(120)

    threads = [threading.Thread(target=run, args=(first + k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _mapped_segments(pid: int) -> int:
    """gradbus shared-memory segments ``pid`` has mapped (distinct files)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split(None, 5)[-1] for line in f if "/gradbus-" in line})
    except OSError:
        return -1


def _servers(up_pid: int) -> dict:
    """The broker's and shards' pids under ``gradbus up``."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == up_pid and b"gradbus" in cmd:
            role = "broker" if b"broker" in cmd else "shard"
            out[f"{role}{len([k for k in out if k.startswith(role)])}"] = int(d)
    return out


def _round(url: str, a, clients: int, nbytes: int, up_pid: int) -> dict:
    ctx = mp.get_context("spawn")
    counters, stop = ctx.RawArray("q", clients), ctx.RawValue("b", 0)
    procs = []
    for first in range(0, clients, a.per_process):
        count = min(a.per_process, clients - first)
        procs.append(ctx.Process(target=_clients, daemon=True,
                                 args=(url, first, count, nbytes, a.depth, counters, stop)))
    for p in procs:
        p.start()
    servers = _servers(up_pid)
    try:
        win = peers.count_window(counters, lambda: all(p.exitcode is None for p in procs),
                                 a.warmup, a.seconds, sample=peers.cpu_seconds,
                                 ready_timeout=300)
    finally:
        stop.value = 1
        for p in procs:
            p.join(120)
        peers.stop_processes(procs)
    pushes = max(1, win["events"])

    def used(pids) -> float:
        return sum(win["last"].get(p, 0.0) - win["first"].get(p, 0.0) for p in pids)
    cpu = {k: round(used([v]) / pushes * 1e6, 1) for k, v in servers.items()}
    cpu["clients"] = round(used([p.pid for p in procs]) / pushes * 1e6, 1)
    return {"pushes_per_s": round(win["events"] / win["seconds"], 1),
            "cpu_us_per_push": cpu,
            "fds": {k: _open_fds(v) for k, v in servers.items()},
            "mapped_segments": {k: _mapped_segments(v) for k, v in servers.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--size", default="4K", choices=sorted(SIZES))
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--per-process", type=int, default=5)
    ap.add_argument("--inproc", action="store_true",
                    help="the shards inside the broker's process (gradbus up --inproc)")
    a = ap.parse_args(argv)
    if min(a.clients, a.rounds, a.depth, a.shards, a.per_process) < 1:
        ap.error("--clients, --rounds, --depth, --shards and --per-process must be positive")
    nbytes = SIZES[a.size]
    rates = []
    with tempfile.NamedTemporaryFile("w+", prefix="gradbus-crowd-up-", suffix=".log") as log:
        up = subprocess.Popen([sys.executable, "-m", "gradbus", "up", "--shards",
                               str(a.shards), "--port", str(throughput.free_port()),
                               *(["--inproc"] if a.inproc else [])],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
        try:
            url = peers._wait_ready(up, log.name, peers.READY_TIMEOUT)
            for r in range(a.rounds):
                res = _round(url, a, a.clients, nbytes, up.pid)
                rates.append(res["pushes_per_s"])
                print(json.dumps({"bench": "crowd", "round": r + 1, "clients": a.clients,
                                  "size": a.size, "depth": a.depth, "shards": a.shards,
                                  "inproc": a.inproc, **res, "cpus": os.cpu_count()}), flush=True)
        finally:
            with contextlib.suppress(Exception):
                peers._end_group(up)
    if len(rates) > 1:
        print(json.dumps({"bench": "crowd", "clients": a.clients, "rounds": len(rates),
                          "last_over_first": round(rates[-1] / rates[0], 3) if rates[0] else None,
                          "rates": rates}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
