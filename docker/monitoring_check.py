#!/usr/bin/env python3
"""The monitoring, run for real: a Prometheus (and an Alertmanager) on loopback scraping a
local cluster (``gradbus up --shards 2 --replicas 2 --metrics-port P``) and a worker pushing
to it, queried through Prometheus's HTTP API.

    python docker/monitoring_check.py                  # checks, then the SIGSTOP run
    python docker/monitoring_check.py --no-sigstop     # the checks only

It runs docker/prometheus-local.yml and docker/alerts.yml as a test variant: the targets moved
to free ports, scrape and evaluation every ``--scrape`` seconds (1), and every rule's ``for:``
set to ``--for`` seconds (3) so that the alerts fire within seconds, not minutes. It checks:

1. every target (broker, each shard, the worker) is up;
2. the key series are there and, for counters, moving: pushes applied, the latency
   histograms, pending bytes, partitions down, shard liveness, shared memory;
3. the SIGSTOP run: shard-0 stopped, GradbusShardSilent, GradbusTargetDown and
   GradbusNoStandby go pending then firing, GradbusPartitionDown does not (its standby took
   over); shard-1 stopped too, GradbusPartitionDown goes pending then firing (and reaches the
   Alertmanager) and the worker's failing pushes fire; both continued (SIGCONT), the alerts
   resolve. Times come from Prometheus's own ALERTS samples: each alert must fire within its
   ``for:`` plus one evaluation interval (one scrape here) of going pending;
4. the Grafana dashboard and the rules name only series the processes export, and (after a
   SIGSTOP run, when every family has samples) only series Prometheus holds.

One JSON line per check on stdout (progress on stderr); exit status 0 when every check passed.
Everything it started is stopped at the end, stopped shards continued first.
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
import threading
import time
from pathlib import Path

from monitoring_lib import (
    HERE,
    Prom,
    dashboard_names,
    end,
    exported_names,
    free_port,
    free_run,
    get,
    rule_names,
    shard_pid,
    start,
    wait,
    write_config,
)

#: series that must be there; True: a counter (or histogram count) that must move
KEY_SERIES = {
    "gradbus_broker_pushes_applied_total": True,
    "gradbus_shard_pushes_applied_total": True,
    "gradbus_broker_push_to_ack_seconds_count": True,
    "gradbus_broker_push_to_visible_seconds_count": True,
    "gradbus_broker_batch_entries_count": True,
    "gradbus_shard_apply_seconds_count": True,
    "gradbus_broker_push_to_ack_seconds_bucket": False,
    "gradbus_shard_apply_seconds_bucket": False,
    "gradbus_broker_pending_bytes": False,
    "gradbus_broker_held_bytes": False,
    "gradbus_broker_partitions_down": False,
    "gradbus_broker_partitions_without_standby": False,
    "gradbus_broker_shard_up": False,
    "gradbus_broker_shard_silent": False,
    "gradbus_broker_shm_freed_total": True,
    "gradbus_client_shm_freed_total": True,
    "gradbus_client_pushes_acked_total": True,
    "gradbus_shard_shm": False,
    "gradbus_shard_last_checkpoint_timestamp_seconds": False,
}


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- the load: one worker pushing, its client metrics served -------------------------------------

class Worker:
    """Pushes four small tensors in a loop (a push is refused while its partition is down;
    counted, and the loop goes on) and serves its client metrics."""

    def __init__(self, url: str):
        import numpy as np

        import gradbus
        from gradbus.metrics import serve_client
        self.np, self.gradbus = np, gradbus
        self.client = gradbus.connect(url)
        self.grads = {f"w{i}": np.full(4096, 0.01, np.float32) for i in range(4)}
        self.client.init({k: np.zeros_like(v) for k, v in self.grads.items()},
                         optimizer=gradbus.SGD(lr=0.1))
        self.exporter = serve_client(self.client, interval=0.25)
        self.ok = self.failed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="monitoring-check-worker",
                                       daemon=True)
        self.thread.start()

    def run(self) -> None:
        from collections import deque
        futs: deque = deque()
        while not self.stop.is_set():
            try:
                futs.append(self.client.push(self.grads))
            except self.gradbus.GradbusError:
                self.failed += 1
            while futs and (futs[0].done() or len(futs) > 32):
                try:
                    futs.popleft().result(30)
                    self.ok += 1
                except Exception:      # refused, or not answered: counted, not fatal
                    self.failed += 1
            self.stop.wait(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.exporter.close()
        self.client.close()


# -- the checks -------------------------------------------------------------------------------------

def firing(prom: Prom, name: str, **labels) -> str | None:
    """The state (pending, firing) of the alert ``name`` whose labels include ``labels``."""
    states = [a["state"] for a in prom.alerts() if a["labels"].get("alertname") == name
              and all(a["labels"].get(k) == v for k, v in labels.items())]
    return "firing" if "firing" in states else (states[0] if states else None)


def check_targets(prom: Prom, want: int, timeout: float) -> dict:
    t0 = time.monotonic()

    def all_up():
        ts = prom.api("targets")["activeTargets"]
        return len(ts) == want and all(t["health"] == "up" for t in ts) and ts
    try:
        ts = wait(all_up, timeout, "every target up")
        ok = True
    except TimeoutError:
        ts, ok = prom.api("targets")["activeTargets"], False
    return {"check": "targets", "ok": ok, "seconds": round(time.monotonic() - t0, 2),
            "targets": {t["labels"]["instance"]: t["health"] for t in ts}}


def check_series(prom: Prom, shards: int, timeout: float) -> dict:
    count = {n: len(prom.query(n)) for n in KEY_SERIES}
    before = {n: prom.total(n) for n, moves in KEY_SERIES.items() if moves}
    after = dict(before)

    def moved():
        after.update({n: prom.total(n) for n in before})
        return all(after[n] is not None and before[n] is not None and after[n] > before[n]
                   for n in before)
    try:
        wait(moved, timeout, "every key counter moving", every=0.5)
    except TimeoutError:
        pass
    up = {s["metric"]["shard"]: float(s["value"][1])
          for s in prom.query("gradbus_broker_shard_up")}
    problems = [f"{n}: no series" for n, c in count.items() if not c]
    problems += [f"{n}: did not move ({before[n]} -> {after[n]})" for n in before
                 if not (after[n] is not None and before[n] is not None and after[n] > before[n])]
    if up != {f"shard-{i}": 1.0 for i in range(shards)}:
        problems.append(f"gradbus_broker_shard_up: {up}")
    if prom.total("gradbus_broker_partitions_down") != 0:
        problems.append("partitions down in a healthy cluster")
    return {"check": "series", "ok": not problems, "problems": problems, "series": count,
            "moved": {n: [before[n], after[n]] for n in before}, "shard_up": up}


def check_names(prom: Prom, urls: list[str], held_by_prometheus: bool) -> dict:
    """The dashboard's and the rules' series: exported by a process (TYPE lines of a scrape),
    and, when ``held_by_prometheus``, with samples in Prometheus."""
    exported = set()
    for u in urls:
        exported |= exported_names(get(u))
    used = dashboard_names() | rule_names()
    held = set(prom.api("label/__name__/values"))
    not_exported = sorted(used - exported)
    no_samples = sorted(used - held)
    return {"check": "names", "ok": not not_exported and not (held_by_prometheus and no_samples),
            "used": len(used), "not_exported": not_exported, "no_samples": no_samples}


def alert_figures(prom: Prom, name: str, labels: dict, since: float, until: float,
                  for_s: float, interval: float, stopped_at: float, continued_at: float) -> dict:
    """From Prometheus's ALERTS samples: when the alert went pending and firing (its own
    evaluation times) and when it last fired."""
    sel = ",".join([f'alertname="{name}"', *(f'{k}="{v}"' for k, v in labels.items())])
    span = time.time() - since + 5
    pend = [t for t, _ in prom.samples(f'ALERTS{{{sel},alertstate="pending"}}', span)
            if since <= t <= until]
    fire = [t for t, _ in prom.samples(f'ALERTS{{{sel},alertstate="firing"}}', span)
            if since <= t <= until]
    out = {"check": "alert", "alert": name, "labels": labels, "for_s": for_s}
    if not pend or not fire:
        return {**out, "ok": False, "problem": f"pending samples {len(pend)}, firing {len(fire)}"}
    to_fire = fire[0] - pend[0]
    out.update(pending_after_stop_s=round(pend[0] - stopped_at, 2),
               firing_after_stop_s=round(fire[0] - stopped_at, 2),
               pending_to_firing_s=round(to_fire, 3),
               last_firing_after_cont_s=round(fire[-1] - continued_at, 2))
    # fires within its for: plus one evaluation (one scrape) of going pending, never before
    out["ok"] = for_s - 1e-3 <= to_fire <= for_s + interval + 1e-3
    return out


def sigstop_run(prom: Prom, up_pid: int, am_url: str | None, for_s: float, interval: float,
                timeout: float, emit) -> bool:
    stopped: list[int] = []
    try:
        pids = [shard_pid(up_pid, f"shard-{i}") for i in range(2)]
        t_a = time.time()
        say(f"SIGSTOP shard-0 (pid {pids[0]})")
        os.kill(pids[0], signal.SIGSTOP)
        stopped.append(pids[0])
        phase_a = [("GradbusShardSilent", {"shard": "shard-0"}),
                   ("GradbusTargetDown", {"shard": "shard-0"}), ("GradbusNoStandby", {})]
        wait(lambda: all(firing(prom, n, **lb) == "firing" for n, lb in phase_a), timeout,
             "shard-0's alerts firing")
        # its standby took over: no partition went down
        down_a = firing(prom, "GradbusPartitionDown")
        t_b = time.time()
        say(f"SIGSTOP shard-1 (pid {pids[1]})")
        os.kill(pids[1], signal.SIGSTOP)
        stopped.append(pids[1])
        phase_b = [("GradbusPartitionDown", {}), ("GradbusShardSilent", {"shard": "shard-1"}),
                   ("GradbusClientPushesFailing", {})]
        wait(lambda: all(firing(prom, n, **lb) == "firing" for n, lb in phase_b), timeout,
             "shard-1's alerts firing")
        am = []
        if am_url:
            am = wait(lambda: [a["labels"]["alertname"] for a in get(f"{am_url}/api/v2/alerts")
                               if a["labels"].get("alertname") == "GradbusPartitionDown"],
                      timeout, "the Alertmanager told of GradbusPartitionDown")
        t_c = time.time()
        say("SIGCONT shard-0 and shard-1")
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        clearing = ("GradbusPartitionDown", "GradbusShardSilent", "GradbusTargetDown",
                    "GradbusNoStandby")
        wait(lambda: not any(firing(prom, n) for n in clearing), timeout,
             "the alerts resolved after SIGCONT")
        t_d = time.time()
        ok = down_a is None
        emit({"check": "sigstop", "ok": ok, "partition_down_after_shard0": down_a,
              "alertmanager": sorted(set(am)), "resolved_after_cont_s": round(t_d - t_c, 2),
              "client_pushes_failing_now": firing(prom, "GradbusClientPushesFailing")})
        for (name, lb), t0 in [*((a, t_a) for a in phase_a), *((b, t_b) for b in phase_b)]:
            fig = alert_figures(prom, name, lb, t0, t_d, for_s, interval, t0, t_c)
            emit(fig)
            ok = ok and fig["ok"]
        return ok
    finally:
        for pid in stopped:          # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--scrape", type=float, default=1.0,
                    help="scrape and evaluation interval, seconds")
    ap.add_argument("--for", dest="for_s", type=float, default=3.0,
                    help="every rule's for:, seconds (the test variant)")
    ap.add_argument("--timeout", type=float, default=60.0, help="for each wait, seconds")
    ap.add_argument("--sigstop", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prometheus", default=shutil.which("prometheus"))
    ap.add_argument("--alertmanager", default=shutil.which("prometheus-alertmanager")
                    or shutil.which("alertmanager"))
    args = ap.parse_args(argv)
    if not args.prometheus:
        say("no prometheus on PATH (Debian: apt-get install prometheus)")
        return 2
    if args.sigstop and (args.shards, args.replicas) != (2, 2):
        ap.error("the SIGSTOP run is written for --shards 2 --replicas 2")
    results: list[dict] = []

    def emit(d: dict) -> None:
        results.append(d)
        print(json.dumps(d), flush=True)

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gradbus-monitoring-"))
    up = prom_proc = am_proc = worker = None
    try:
        base = free_run(args.shards + 1)
        say(f"gradbus up --shards {args.shards} --replicas {args.replicas} "
            f"--metrics-port {base}")
        with open(work / "up.log", "wb") as log:
            up = subprocess.Popen(
                [sys.executable, "-m", "gradbus", "up", "--shards", str(args.shards),
                 "--replicas", str(args.replicas), "--port", "0", "--metrics-port", str(base)],
                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        line = up.stdout.readline().strip()
        if not line.startswith("ready: "):
            raise RuntimeError(f"gradbus up said {line!r} (log: {work / 'up.log'})")
        worker = Worker(line.split(" ", 1)[1])
        am_port = free_port()
        write_config(work, base, args.shards, worker.exporter.port, am_port, args.scrape,
                     args.for_s)
        am_url = None
        if args.alertmanager and args.sigstop:
            am_proc = start([args.alertmanager, f"--config.file={HERE / 'alertmanager.yml'}",
                             f"--storage.path={work / 'am'}",
                             f"--web.listen-address=127.0.0.1:{am_port}",
                             "--cluster.listen-address="], work / "alertmanager.log")
            am_url = f"http://127.0.0.1:{am_port}"
        port = free_port()
        prom_proc = start([args.prometheus, f"--config.file={work / 'prometheus.yml'}",
                           f"--storage.tsdb.path={work / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                          work / "prometheus.log")
        prom = Prom(f"http://127.0.0.1:{port}")
        wait(lambda: get(f"{prom.url}/-/ready"), args.timeout, "Prometheus ready")
        if am_url:
            wait(lambda: get(f"{am_url}/-/ready"), args.timeout, "Alertmanager ready")
        version = get(f"{prom.url}/api/v1/status/buildinfo")["data"]["version"]
        emit({"check": "setup", "ok": True, "prometheus": version, "scrape_s": args.scrape,
              "for_s": args.for_s, "shards": args.shards, "replicas": args.replicas,
              "alertmanager": bool(am_url)})
        emit(check_targets(prom, args.shards + 2, args.timeout))
        emit(check_series(prom, args.shards, args.timeout))
        if args.sigstop:
            sigstop_run(prom, up.pid, am_url, args.for_s, args.scrape, args.timeout, emit)
        urls = [f"http://127.0.0.1:{base + k}/metrics" for k in range(args.shards + 1)]
        emit(check_names(prom, [*urls, worker.exporter.url], args.sigstop))
        emit({"check": "pushes", "ok": worker.ok > 0, "acknowledged": worker.ok,
              "failed": worker.failed})
    except (OSError, RuntimeError, TimeoutError) as e:
        emit({"check": "error", "ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        if worker is not None:
            worker.close()
        end(prom_proc)
        end(am_proc)
        code = end(up, 30)
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in work.glob("*.log")}
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["ok"] for r in results)
    summary = {"check": "summary", "ok": ok, "seconds": round(time.monotonic() - t_start, 1),
               "up_exit": code}
    if not ok:
        summary["logs"] = logs
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
