"""A broker tier across emulated server hosts: does a second (and a fourth) server host add its
link to the cluster's?

The hosts (bench/hosts_net.py): K server hosts and W worker hosts, network namespaces joined
by one switch; each server host's link shaped to ``--server-link`` each way, each worker's to
``--link``. On server host k runs one broker with its shard in its process (``gradbus broker
--inproc-shards 1``), member k of a tier of K (``--tier``; K=1: a lone broker). Every worker
(gradbus.connect to member 0, which hands it the map; frames, no shared memory) pushes the
whole model, ``--tensors`` tensors of ``--size`` each, ``acks=1``, and with ``--depth`` D pushes
in flight waits for its oldest push's ACK and pulls the model at the version that ACK named
(each member's tensors at the version that member's part of the ACK named), then counts an
update.

One JSON line per K (medians over ``--repeat`` interleaved rounds):

    updates_per_s      model updates made fresh per second, all workers
    vs_one             updates_per_s over K=1's in the same round (the median of the rounds)
    server_in_util, server_out_util
                       each server host's link, each way: bits over the window against its
                       rate (a list, one per server host)
    tensors_per_member how many of the model's tensors each member holds (the tier's map)
    cpu_util           CPU seconds of every process of the configuration, per second and per
                       core of this machine (1.0: every core busy)

Usage (as root): python bench/tier_hosts.py [--servers 1,2,4] [--workers 8] [--tensors 8]
    [--size 1M] [--link 1gbit] [--server-link 100mbit] [--depth 1] [--seconds 6]
    [--warmup 2] [--repeat 1]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_net  # noqa: E402  (the namespaces and links)
import peers  # noqa: E402  (CPU accounting)
from floor import count_window  # noqa: E402
from hosts_net import SERVER_DEV, HostsError  # noqa: E402

from gradbus.cluster import end_processes  # noqa: E402

READY_TIMEOUT = 180.0
SIZES = {"256K": 256 << 10, "1M": 1 << 20, "4M": 4 << 20}


def _names(n: int) -> list[str]:
    return [f"layer{i}" for i in range(n)]


def worker(url: str, names: list, nelems: int, depth: int, counters, i: int, stop,
           init: bool) -> None:
    """One worker host's loop (module level: a spawned child runs it in its namespace)."""
    import numpy as np

    import gradbus
    from gradbus.workers.tier_client import TierClient
    c = gradbus.connect(url, timeout=120, shm=False)
    if init:
        c.init({n: np.zeros(nelems, np.float32) for n in names},
               optimizer=gradbus.SGD(lr=1e-3))
    deadline = time.monotonic() + 60
    while True:      # the model exists once worker 0 made it
        try:
            c.pull(names, timeout=30)
            break
        except gradbus.UnknownKeyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    members = c.members if isinstance(c, TierClient) else [c]
    owned = [[n for n in names if (c.owner(n) if isinstance(c, TierClient) else c) is m]
             for m in members]
    # a push's ACK has a part per member it went to, in the order its names first name them
    order = (list(dict.fromkeys(c.tier.owner(n) for n in names))
             if isinstance(c, TierClient) else [0])
    g = {n: np.full(nelems, 1e-6, np.float32) for n in names}
    inflight: collections.deque = collections.deque()
    try:
        while not stop.value:
            inflight.append(c.push(g, acks=1))
            if len(inflight) < depth:
                continue
            r = inflight.popleft().result(120)
            vers = [p["ver"] for p in r["parts"]] if "parts" in r else [r["ver"]]
            for k, ver in zip(order, vers):      # each member at the version its part named
                members[k].pull(owned[k], min_version=ver, timeout=120)
            counters[i] += 1
    finally:
        if os.environ.get("TIER_HOSTS_STATS"):
            st = c.stats
            print(f"worker {i}: " + json.dumps({k: st[k] for k in sorted(st) if st[k]}),
                  file=sys.stderr, flush=True)
        c.close(timeout=5)


def _start_tier(hosts, k: int, log) -> tuple[list, list[str]]:
    """K brokers, broker k (with one in-process shard) on server host k; their processes and
    client URLs."""
    port = hosts.next_port()
    urls = [f"tcp://{hosts.server_addrs[j]}:{port}" for j in range(k)]
    tier = [a for u in urls for a in ("--tier", u)] if k > 1 else []
    procs = []
    try:
        for j in range(k):
            cmd = [*hosts.exec_prefix(hosts.servers[j]), sys.executable, "-m", "gradbus",
                   "broker", "--host", hosts.server_addrs[j], "--port", str(port),
                   "--inproc-shards", "1", *tier,
                   *(["--tier-index", str(j)] if tier else [])]
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            line = p.stdout.readline().strip()
            if not line.startswith("listening: "):
                raise RuntimeError(f"broker {j} did not start: {line!r}")
    except BaseException:
        end_processes(procs, 10)
        raise
    return procs, urls


def measure(hosts, k: int, a) -> dict:
    ctx = mp.get_context("spawn")
    w = a.workers
    counters, stop = ctx.RawArray("q", w), ctx.RawValue("b", 0)
    names = _names(a.tensors)
    nelems = SIZES[a.size] // 4
    brokers, urls = _start_tier(hosts, k, subprocess.DEVNULL)
    procs = []
    samples = []
    try:
        for i in range(w):
            target, args = hosts.in_worker(i, worker, (urls[0], names, nelems, a.depth,
                                                       counters, i, stop, i == 0))
            p = ctx.Process(target=target, args=args, daemon=True)
            p.start()
            procs.append(p)
            if i == 0:       # the model made before the others look for it
                deadline = time.monotonic() + READY_TIMEOUT
                while counters[0] == 0 and p.exitcode is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError("worker 0 made no update")
                    time.sleep(0.05)

        def alive() -> bool:
            return all(p.exitcode is None for p in procs) and all(
                b.poll() is None for b in brokers)

        def sample():
            s = {"t": time.monotonic(), "cpu": peers.cpu_seconds(),
                 "servers": [hosts_net.dev_bytes(b.pid, SERVER_DEV) for b in brokers]}
            samples.append(s)
            return s
        win = count_window(counters, alive, a.warmup, a.seconds, sample=sample,
                           ready_timeout=READY_TIMEOUT)
    finally:
        stop.value = 1
        for p in procs:
            p.join(15)
            if p.exitcode is None:
                p.kill()
                p.join(5)
        end_processes(brokers, 10)
    first, last = samples
    secs = last["t"] - first["t"]
    rate = hosts.server_bps * secs / 8
    ins = [(b[0] - f[0]) / rate for f, b in zip(first["servers"], last["servers"])]
    outs = [(b[1] - f[1]) / rate for f, b in zip(first["servers"], last["servers"])]
    from gradbus.codecs.tier import TierMap
    owners = collections.Counter(TierMap.spread(urls, 256).owner(n) for n in names) \
        if k > 1 else collections.Counter({0: len(names)})
    return {"updates_per_s": win["events"] / win["seconds"],
            "server_in_util": [round(x, 3) for x in ins],
            "server_out_util": [round(x, 3) for x in outs],
            "tensors_per_member": [owners.get(j, 0) for j in range(k)],
            "cpu_util": round(peers.cpu_between(first["cpu"], last["cpu"]) / secs
                              / os.cpu_count(), 3)}


def line(k: int, rounds: list, a) -> dict:
    runs = [r[k] for r in rounds if "error" not in r.get(k, {"error": 1})]
    out = {"bench": "tier_hosts", "servers": k, "workers": a.workers, "tensors": a.tensors,
           "size": a.size, "bytes": SIZES[a.size], "depth": a.depth, "link": a.link,
           "server_link": a.server_link}
    if runs:
        out["updates_per_s"] = round(statistics.median(r["updates_per_s"] for r in runs), 2)
        ratios = [r[k]["updates_per_s"] / r[1]["updates_per_s"] for r in rounds
                  if "error" not in r.get(k, {"error": 1}) and "error" not in r.get(1, {"error": 1})
                  and r[1]["updates_per_s"]]
        out["vs_one"] = round(statistics.median(ratios), 3) if ratios else None
        last = runs[-1]
        for f in ("server_in_util", "server_out_util", "tensors_per_member", "cpu_util"):
            out[f] = last[f]
    out["rates"] = [round(r[k]["updates_per_s"], 2) if "updates_per_s" in r.get(k, {}) else None
                    for r in rounds]
    errors = [r[k]["error"] for r in rounds if "error" in r.get(k, {})]
    if errors:
        out["error"] = errors[0]
    out["repeats"] = len(rounds)
    out["cpus"] = os.cpu_count()
    return out


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # every finally runs: processes ended, namespaces gone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="1,2,4", help="server hosts (tier members), a list")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--size", default="1M", choices=sorted(SIZES))
    ap.add_argument("--link", default="1gbit", help="each worker host's link (tc rate)")
    ap.add_argument("--server-link", default="100mbit", help="each server host's link")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds")
    a = ap.parse_args(argv)
    try:
        servers = sorted({int(x) for x in a.servers.split(",")})
    except ValueError:
        ap.error("--servers is a list of ints")
    if servers[0] < 1 or servers[-1] > hosts_net.MAX_SERVERS or a.workers < 1 \
            or a.tensors < 1 or a.depth < 1:
        ap.error(f"1 to {hosts_net.MAX_SERVERS} servers; workers, tensors and depth >= 1")
    if 1 not in servers:
        servers = [1, *servers]          # vs_one needs the lone broker in each round
    why = hosts_net.permitted()
    if why:
        print(f"tier_hosts: cannot make the emulated hosts: {why}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    hosts_net.sweep()
    hosts = hosts_net.Hosts(a.workers, a.link, a.server_link, servers=servers[-1])
    try:
        hosts.build()
        print(f"tier_hosts: {servers[-1]} server hosts ({a.server_link} each), {a.workers} "
              f"worker hosts ({a.link} each)", file=sys.stderr, flush=True)
        rounds = []
        for _ in range(a.repeat):
            round_ = {}
            for k in servers:
                try:
                    round_[k] = measure(hosts, k, a)
                except Exception as e:      # noqa: BLE001  (the other configurations run)
                    round_[k] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"tier_hosts: K={k} failed: {e}", file=sys.stderr, flush=True)
                print(f"tier_hosts: K={k}: {round_[k]}", file=sys.stderr, flush=True)
            rounds.append(round_)
        for k in servers:
            print(json.dumps(line(k, rounds, a)), flush=True)
        return 0 if all("error" not in r[k] for r in rounds for k in servers) else 1
    except HostsError as e:
        print(f"tier_hosts: {e}", file=sys.stderr)
        return 2
    finally:
        hosts.close()
        with contextlib.suppress(Exception):     # multiprocessing's resource tracker
            from multiprocessing import resource_tracker
            resource_tracker._resource_tracker._stop()


if __name__ == "__main__":
    sys.exit(main())
