"""gradbus beside PyTorch RPC and a bare shared-memory pipeline, measured in the same run.

Two workers push fp32 gradients of one tensor to one server as fast as they can and take the
fresh weights back after every push. Configurations:

    rpc                   PyTorch RPC parameter server (bench/peers_rpc.py), TensorPipe defaults
    rpc_tcp               the same, TensorPipe restricted to TCP (uv transport, basic channel)
    gradbus_shm           ``gradbus up --shards 1`` (a broker and a shard) and two SDK workers,
                          every process with GRADBUS_SHM=1; each step pushes (acks=1) and reads
                          the local weights (``c.pull(["w"])``, which does not wait)
    gradbus_worker_noshm  the same with GRADBUS_SHM=0 in the workers (workers on other hosts)
    floor_shm             bench/floor.py's ``shm`` pipeline: headers through a Python ZeroMQ
                          broker, gradients through shared-memory rings, weights back through a
                          seqlock board

GRADBUS_SHM is only set: whether this gradbus honours it is not checked. Every configuration
counts its updates in shared counters; after every worker counted one and ``--warmup`` seconds,
this process reads the counters and the CPU time (utime + stime in /proc/PID/stat) of every
process under it at both ends of a ``--seconds`` window. One JSON line per configuration and
size:

    updates_per_s     gradient updates applied per second, both workers (rpc: weights returned;
                      gradbus: pushes acknowledged; floor: pushes acked)
    cpu_s_per_update  CPU seconds of all the configuration's processes in the window, per update
    vs_rpc, vs_rpc_tcp, vs_floor_shm
                      updates_per_s over that configuration's, same size, same round (the median
                      of the rounds' ratios with ``--repeat``); null when it did not run

With ``--repeat N`` the rounds are interleaved (every configuration and size once per round) and
a line gives medians and each round's ``rates``.

Usage: python bench/peers.py [--sizes 64K,4M,16M] [--seconds 4] [--warmup 1.5]
                             [--configs rpc,rpc_tcp,gradbus_shm,gradbus_worker_noshm,floor_shm]
                             [--repeat N]
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
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floor  # noqa: E402  (the shm pipeline, the window, the process reaping)
import throughput  # noqa: E402  (the sizes and free ports)
from floor import Board, Ring, Segments, count_window, stop_processes  # noqa: E402, F401

CONFIGS = ("rpc", "rpc_tcp", "gradbus_shm", "gradbus_worker_noshm", "floor_shm")
REFERENCES = ("rpc", "rpc_tcp", "floor_shm")
WORKERS = 2
READY_TIMEOUT = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- CPU accounting
def cpu_seconds() -> dict[int, float]:
    """utime + stime, in seconds, of every process under this one (children, their children)."""
    parent, ticks = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # from field 3 (state) on
        parent[int(d)], ticks[int(d)] = int(fields[1]), int(fields[11]) + int(fields[12])
    children = collections.defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    out, todo = {}, [os.getpid()]
    while todo:
        for pid in children[todo.pop()]:
            out[pid] = ticks[pid] / CLK_TCK
            todo.append(pid)
    return out


def cpu_between(first: dict, last: dict) -> float:
    """CPU seconds spent between two cpu_seconds() samples by the processes of the last one."""
    return sum(t - first.get(pid, 0.0) for pid, t in last.items())


@contextlib.contextmanager
def environment(**values):
    """os.environ with ``values`` set (spawned children inherit it), restored on leaving."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- configurations
@contextlib.contextmanager
def rpc_config(nbytes: int, counters, stop, tcp_only: bool):
    import peers_rpc  # torch is imported only here
    ctx = mp.get_context("spawn")
    procs = peers_rpc.processes(ctx, nbytes, throughput.free_port(), tcp_only, counters, stop)
    try:
        for p in procs:
            p.start()
        yield lambda: all(p.exitcode is None for p in procs)
    finally:
        stop.value = 1
        for p in procs:
            if p.pid is not None:
                p.join(30)
        stop_processes(procs)


def _gradbus_worker(url: str, index: int, nbytes: int, counters, stop) -> None:
    import gradbus
    n = nbytes // 4
    with gradbus.connect(url, timeout=60) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1e-6))
        c.pull(["w"])                       # follow the tensor: fresh weights by subscription
        g = np.random.default_rng(index).standard_normal(n).astype(np.float32)
        while not stop.value:
            c.push({"w": g}, acks=1)
            c.pull(["w"])                   # the freshest weights, as a training step reads them
            counters[index] = c.stats["pushes_acked"]
        c.flush(60)


def _wait_ready(up: subprocess.Popen, log: str, timeout: float) -> str:
    """The client URL ``gradbus up`` prints once its shards are alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("ready: "):
                    return line.split()[1]
        if up.poll() is not None:
            raise RuntimeError(f"gradbus up exited with {up.returncode}")
        time.sleep(0.1)
    raise TimeoutError(f"gradbus up not ready in {timeout:.0f}s")


def _end_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT to a process group led by ``proc`` (the way Ctrl-C stops ``gradbus up``), then
    SIGKILL to the group if its leader outlives ``grace``; the leader is reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def gradbus_config(nbytes: int, counters, stop, worker_shm: str):
    ctx = mp.get_context("spawn")
    up, procs = None, []
    with tempfile.NamedTemporaryFile("w+", prefix="gradbus-peers-up-", suffix=".log") as log:
        try:
            cmd = [sys.executable, "-m", "gradbus", "up", "--shards", "1",
                   "--port", str(throughput.free_port())]
            up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  env={**os.environ, "GRADBUS_SHM": "1"})
            url = _wait_ready(up, log.name, READY_TIMEOUT)
            with environment(GRADBUS_SHM=worker_shm):
                procs = [ctx.Process(target=_gradbus_worker, daemon=True,
                                     args=(url, i, nbytes, counters, stop))
                         for i in range(WORKERS)]
                for p in procs:
                    p.start()
            yield lambda: up.poll() is None and all(p.exitcode is None for p in procs)
        finally:
            stop.value = 1
            for p in procs:
                if p.pid is not None:
                    p.join(60)
            stop_processes(procs)
            if up is not None:
                _end_group(up)


def start(config: str, nbytes: int, counters, stop):
    """The configuration's processes as a context manager yielding ``alive()``."""
    if config in ("rpc", "rpc_tcp"):
        return rpc_config(nbytes, counters, stop, tcp_only=config == "rpc_tcp")
    if config in ("gradbus_shm", "gradbus_worker_noshm"):
        return gradbus_config(nbytes, counters, stop, "1" if config == "gradbus_shm" else "0")
    if config == "floor_shm":
        return _floor(nbytes, counters, stop)
    raise ValueError(f"unknown configuration {config!r}")


@contextlib.contextmanager
def _floor(nbytes: int, counters, stop):
    with floor.shm_pipeline(nbytes, counters, stop, WORKERS) as procs:
        yield lambda: all(p.exitcode is None for p in procs)


def measure(config: str, nbytes: int, warmup: float, seconds: float) -> dict:
    """One configuration at one size: its updates per second and CPU seconds per update."""
    ctx = mp.get_context("spawn")
    counters, stop = ctx.RawArray("q", WORKERS), ctx.RawValue("b", 0)
    with start(config, nbytes, counters, stop) as alive:
        win = count_window(counters, alive, warmup, seconds, sample=cpu_seconds,
                           ready_timeout=READY_TIMEOUT)
    updates = win["events"]
    return {"updates_per_s": updates / win["seconds"],
            "cpu_s_per_update": cpu_between(win["first"], win["last"]) / updates
            if updates else None}


# ----------------------------------------------------------------------------- output
def _sig(x, digits: int = 4):
    return None if x is None else float(f"{x:.{digits}g}")


def lines(size: str, configs: list, rounds: list) -> list[dict]:
    """One line per configuration at ``size`` from the rounds' results ({config: result})."""
    out = []
    for config in configs:
        runs = [r.get(config) for r in rounds]
        ok = [r for r in runs if r and r.get("updates_per_s")]
        line = {"bench": "peers", "config": config, "size": size, "bytes": throughput.SIZES[size],
                "workers": WORKERS,
                "updates_per_s": round(statistics.median(r["updates_per_s"] for r in ok), 1)
                if ok else None,
                "cpu_s_per_update": _sig(statistics.median(r["cpu_s_per_update"] for r in ok))
                if ok else None}
        for ref in REFERENCES:
            ratios = [r[config]["updates_per_s"] / r[ref]["updates_per_s"] for r in rounds
                      if r.get(config, {}).get("updates_per_s")
                      and r.get(ref, {}).get("updates_per_s")]
            line[f"vs_{ref}"] = round(statistics.median(ratios), 3) if ratios else None
        if len(rounds) > 1:
            line["repeats"] = len(rounds)
            line["rates"] = [round(r["updates_per_s"], 1) if r and r.get("updates_per_s")
                             else None for r in runs]
        errors = [r["error"] for r in runs if r and "error" in r]
        if errors:
            line["error"] = errors[0]
        line["cpus"] = os.cpu_count()
        out.append(line)
    return out


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # runs every finally: children reaped, segments removed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,4M,16M")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds; lines give medians")
    a = ap.parse_args(argv)
    configs, sizes = a.configs.split(","), a.sizes.split(",")
    if a.repeat < 1 or not set(configs) <= set(CONFIGS) or not set(sizes) <= set(throughput.SIZES):
        ap.error(f"--repeat must be at least 1, --configs a list of {', '.join(CONFIGS)} and "
                 f"--sizes a list of {', '.join(throughput.SIZES)}")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(a, configs, sizes)
    finally:        # multiprocessing's resource tracker, the one child no configuration reaps
        with contextlib.suppress(Exception):
            from multiprocessing import resource_tracker
            resource_tracker._resource_tracker._stop()


def _run(a, configs: list, sizes: list) -> int:
    results = {size: [] for size in sizes}
    for _ in range(a.repeat):
        for size in sizes:
            round_ = {}
            for config in configs:
                try:
                    round_[config] = measure(config, throughput.SIZES[size], a.warmup, a.seconds)
                except Exception as e:       # noqa: BLE001  (the other configurations still run)
                    round_[config] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"peers: {config} at {size} failed: {e}", file=sys.stderr, flush=True)
            results[size].append(round_)
    ran = [c for c in configs
           if any("error" not in r[c] for rs in results.values() for r in rs)]
    print(f"peers: configs run: {', '.join(ran) or 'none'}"
          + (f"; failed: {', '.join(c for c in configs if c not in ran)}"
             if len(ran) < len(configs) else "")
          + "; GRADBUS_SHM set for the gradbus configs (not checked whether it is honoured)",
          file=sys.stderr, flush=True)
    for size in sizes:
        for line in lines(size, configs, results[size]):
            print(json.dumps(line), flush=True)
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
