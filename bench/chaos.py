"""Chaos: train the digits MLP while shards and the broker are killed and restarted at random.

A broker (pinned ports, so it can come back on them), ``--shards`` shard processes with
``--replicas`` copies of every partition, and ``--workers`` training threads, each with its own
client, pushing with ``acks="all"``. A seeded fault thread, every few seconds (exponential gaps,
mean ``--fault-every``), does one of:

* SIGKILL a shard, measure how long until no partition has it as primary (the failover), then
  start it again under the same id (fenced, rebuilt as a standby);
* SIGSTOP a shard for 1.5-3 s, then SIGCONT (a stall: failover, then fencing on return);
* SIGKILL the broker and start it again on the same ports (the shards register again and it
  rebuilds its table from them; clients resend what was not acknowledged).

Every push also carries a one-hot row of a per-worker ledger tensor (SGD, lr 1): after the run,
``-ledger[i]`` is how many times push ``i`` was applied. So, exactly:

    lost        pushes acknowledged but applied 0 times (must be 0)
    duplicates  pushes applied more than once (must be 0)

One JSON line: pushes sent, acknowledged, failed (by code), applied, lost, duplicates, faults
by kind, failover seconds (p50, max) for shard kills and stalls, broker recovery seconds, and the
final test accuracy of the model.

Usage: python bench/chaos.py [--seconds 120] [--seed 0] [--fault-every 6]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np

import gradbus
from gradbus import admin
from gradbus import demo_model as dm
from gradbus.cluster import end_processes, free_ports
from gradbus.codecs.errors import GradbusError

HB = ["--heartbeat-interval", "0.1", "--liveness", "5"]
LEDGER = 1 << 15           # pushes per worker the ledger can count




class Cluster:
    def __init__(self, shards: int, replicas: int):
        self.port, self.backend, self.events = free_ports(3)
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.replicas = replicas
        self.broker = None
        self.shards: dict[str, subprocess.Popen] = {}
        self.ids = [f"s{i}" for i in range(shards)]

    def _spawn(self, args):
        return subprocess.Popen([sys.executable, "-m", "gradbus", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    def start_broker(self):
        self.broker = self._spawn(["broker", "--port", str(self.port), "--backend-port",
                                   str(self.backend), "--events-port", str(self.events),
                                   "--replicas", str(self.replicas), *HB])
        line = self.broker.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"broker did not start: {line!r}")

    def start_shard(self, sid):
        self.shards[sid] = self._spawn(["shard", "--broker", self.url, "--id", sid, *HB])

    def alive(self) -> int:
        try:
            return sum(1 for s in admin.status(self.url, 1.0)["shards"] if s["alive"])
        except GradbusError:
            return -1

    def wait(self, cond, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = cond()
            if v:
                return time.monotonic()
            time.sleep(0.02)
        raise TimeoutError("cluster condition not reached")

    def stop(self):
        for p in self.shards.values():      # a stopped (SIGSTOP) shard must hear SIGTERM
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
        end_processes([*self.shards.values(), self.broker], grace=10.0)


def _owners(url):
    try:
        return admin.partitions(url, 1.0)["owners"]
    except GradbusError:
        return None


def chaos(cluster: Cluster, rng: random.Random, stop: threading.Event, mean_gap: float,
          out: dict) -> None:
    while not stop.wait(rng.expovariate(1.0 / mean_gap)):
        if cluster.alive() != len(cluster.ids):
            continue     # still recovering from the last fault
        kind = rng.choices(["kill_shard", "stall_shard", "kill_broker"], [0.5, 0.25, 0.25])[0]
        out["faults"][kind] += 1
        if kind == "kill_broker":
            t0 = time.monotonic()
            cluster.broker.kill()
            cluster.broker.wait()
            cluster.broker.stdout.close()
            stop.wait(rng.uniform(0.2, 1.0))
            cluster.start_broker()
            t1 = cluster.wait(lambda: cluster.alive() == len(cluster.ids)
                              and admin.status(cluster.url, 1.0)["under_replicated"] == 0)
            out["broker_recovery_s"].append(t1 - t0)
            continue
        owners = _owners(cluster.url) or []
        sid = rng.choice([s for s in cluster.ids if s in owners] or cluster.ids)
        proc = cluster.shards[sid]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL if kind == "kill_shard" else signal.SIGSTOP)
        try:
            t1 = cluster.wait(
                lambda sid=sid: (o := _owners(cluster.url)) is not None and sid not in o)
            out["failover_s"].append(t1 - t0)
        finally:
            if kind == "kill_shard":
                proc.wait()
                proc.stdout.close()
                stop.wait(rng.uniform(0.5, 2.0))
                cluster.start_shard(sid)
            else:
                stop.wait(rng.uniform(1.5, 3.0))
                proc.send_signal(signal.SIGCONT)
        cluster.wait(lambda: cluster.alive() == len(cluster.ids)
                     and admin.status(cluster.url, 1.0)["under_replicated"] == 0, 60)


def worker(url: str, index: int, workers: int, seed: int, deadline: float, out: dict) -> None:
    X, y, _, _ = dm.load_digits_split(seed)
    X, y = X[index::workers], y[index::workers]
    init = {"digits." + k: v for k, v in dm.init_params(dm.DEFAULT_SIZES, seed).items()}
    names = list(init)
    rng = np.random.default_rng(seed * 100 + index)
    ledger_name = f"ledger.{index}"
    futs = []
    with gradbus.connect(url, client_id=f"chaos-{index}", window=4, resend_after=1.0,
                         timeout=120) as c:
        c.init(init, optimizer=gradbus.Adam(lr=dm.DEFAULT_LR))
        c.init({ledger_name: np.zeros(LEDGER, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        sent = 0
        while time.monotonic() < deadline and sent < LEDGER:
            for Xb, yb in dm.iterate_minibatches(X, y, dm.DEFAULT_BATCH, rng):
                if time.monotonic() >= deadline or sent >= LEDGER:
                    break
                try:
                    w = c.pull(names)
                except GradbusError:            # the broker is down: wait for it
                    time.sleep(0.05)
                    continue
                params = {k[len("digits."):]: v for k, v in w.items()}
                _, grads = dm.loss_and_grads(params, Xb, yb)
                row = np.zeros(LEDGER, np.float32)
                row[sent] = 1.0
                g = {"digits." + k: v for k, v in grads.items()}
                g[ledger_name] = row
                futs.append(c.push(g, acks="all"))
                sent += 1
        acked, failed = 0, Counter()
        for f in futs:
            try:
                f.result(120)
                acked += 1
            except GradbusError as e:
                failed[str(e.code.value if hasattr(e.code, "value") else e.code)] += 1
                print(f"worker {index}: push failed: {e}", file=sys.stderr)
        out[index] = {"sent": sent, "acked": acked, "failed": dict(failed),
                      "acked_ids": [i for i, f in enumerate(futs) if f.exception() is None],
                      "resends": c.stats["resends"]}


def audit(url: str, results: dict) -> None:
    """Read every ledger through a fresh client (a snapshot from the primaries, served after
    every batch queued before it) and count each push's applications."""
    with gradbus.connect(url, timeout=60) as c:
        for index, r in results.items():
            name = f"ledger.{index}"
            counts = -c.pull([name])[name][:r["sent"]]
            r["applied"] = int(np.sum(counts >= 1))
            r["lost"] = int(np.sum(counts[r.pop("acked_ids")] < 1))
            r["duplicates"] = int(np.sum(counts > 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every", type=float, default=6.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    args = ap.parse_args()
    cluster = Cluster(args.shards, args.replicas)
    faults = {"faults": Counter(), "failover_s": [], "broker_recovery_s": []}
    results: dict = {}
    stop = threading.Event()
    t_start = time.monotonic()
    try:
        cluster.start_broker()
        for sid in cluster.ids:
            cluster.start_shard(sid)
        cluster.wait(lambda: cluster.alive() == len(cluster.ids))
        deadline = time.monotonic() + args.seconds
        threads = [threading.Thread(target=worker, args=(cluster.url, i, args.workers,
                                                         args.seed, deadline, results))
                   for i in range(args.workers)]
        for t in threads:
            t.start()
        chaos_t = threading.Thread(target=chaos, args=(cluster, random.Random(args.seed), stop,
                                                       args.fault_every, faults))
        chaos_t.start()
        while time.monotonic() < deadline and chaos_t.is_alive():
            time.sleep(0.2)
        stop.set()
        chaos_t.join()
        for t in threads:
            t.join()
        audit(cluster.url, results)
        with gradbus.connect(cluster.url) as c:
            w = c.pull(["digits." + k for k in dm.init_params(dm.DEFAULT_SIZES, 0)])
        params = {k[len("digits."):]: v for k, v in w.items()}
        _, _, Xt, yt = dm.load_digits_split(args.seed)
        acc = dm.accuracy(params, Xt, yt)
    finally:
        stop.set()
        cluster.stop()
    per = [results[i] for i in sorted(results)]
    fo, br = sorted(faults["failover_s"]), sorted(faults["broker_recovery_s"])
    failed = Counter()
    for r in per:
        failed.update(r["failed"])
    print(json.dumps({
        "bench": "chaos", "seconds": round(time.monotonic() - t_start, 1), "seed": args.seed,
        "workers": args.workers, "shards": args.shards, "replicas": args.replicas,
        "pushes_sent": sum(r["sent"] for r in per), "pushes_acked": sum(r["acked"] for r in per),
        "pushes_failed": dict(failed), "pushes_applied": sum(r["applied"] for r in per),
        "lost": sum(r["lost"] for r in per), "duplicates": sum(r["duplicates"] for r in per),
        "resends": sum(r["resends"] for r in per), "faults": dict(faults["faults"]),
        "failover_s_p50": round(fo[len(fo) // 2], 3) if fo else None,
        "failover_s_max": round(fo[-1], 3) if fo else None,
        "broker_recovery_s_p50": round(br[len(br) // 2], 3) if br else None,
        "broker_recovery_s_max": round(br[-1], 3) if br else None,
        "test_accuracy": round(float(acc), 4)}), flush=True)
    sys.exit(0 if sum(r["lost"] + r["duplicates"] for r in per) == 0 else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
