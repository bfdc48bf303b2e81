"""Time to accuracy: gradbus beside synchronous data-parallel training, with and without a straggler.

The same model (the demo's 64-128-10 MLP in torch, as examples/torch_digits.py builds it, on
scikit-learn's digits), the same initial weights, global batch, learning-rate rule and seeds for
every configuration:

    ddp         torch DistributedDataParallel on gloo, W ranks, SGD with momentum in each rank
    async       gradbus, W asynchronous workers, SGD with momentum on the shards
    ssp         gradbus, W workers, the tensors created with consistency ``ssp:S`` (refuse)
    async_topk  gradbus async with ``topk:0.01|int8`` and error feedback
    single      one process: the global batch per step, no communication, no straggler

Each worker runs on an emulated accelerator: the real forward and backward pass of its share of
the global batch plus a sleep of ``--step-ms`` (worker 0's is ``--straggler`` times longer;
``--jitter`` adds per-step noise). The learning-rate rule: ``--lr`` and ``--momentum`` per step of
the global batch (ddp, single). A gradbus push carries the gradient of batch/W examples, and W
asynchronous workers add momentum of their own, so the shards use momentum
``m' = max(0, 1 - W (1 - m))`` and lr ``lr (1 - m') / (W (1 - m))``: the same long-run step,
lr / (1 - m) per global batch (``--push-momentum`` sets m'). Within each seed the
configurations run one after another in an order rotated per seed, so the machine's load hits
them alike; first, each runs ``--warmup`` seconds unmeasured (numba compiles a shard's and a
worker's loops on first use).

Per run, every ``--eval-every`` seconds one fast worker copies the weights it holds; the copies
are scored on the test split after the run. Reported, medians over the seeds, one JSON line per
configuration and straggler setting: seconds until the test accuracy, averaged over the last
``--smooth`` seconds of evaluations, reaches ``--target`` (null: not within the budget, for some
seed), test accuracy and log loss averaged over the last ``--final-window`` seconds of the
``--budget``, gradient bytes sent (in all, and until the target), steps per worker, and for
gradbus the pushes refused as too stale and the mean staleness the broker saw. ``--curves``
keeps every curve (JSON), ``--plot`` draws them (bench/tta_plot.py; needs matplotlib:
``pip install 'gradbus[plot]'``).

Usage: python bench/time_to_accuracy.py [--workers 4] [--step-ms 30] [--straggler 1,2]
           [--jitter 0] [--seeds 0,1,2] [--budget 20] [--target 0.95] [--ssp 6]
           [--configs ddp,async,ssp,async_topk,single] [--curves FILE] [--plot FILE.png]
       python bench/time_to_accuracy.py --quick      (2 workers, 3 s, one seed: a smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tta_worker.py")
CONFIGS = {   # name -> how it trains; the gradbus ones share one cluster, a name prefix per run
    "ddp": {"kind": "ddp"},
    "async": {"kind": "gradbus", "codec": "raw", "consistency": None},
    "ssp": {"kind": "gradbus", "codec": "raw", "consistency": "ssp"},
    "async_topk": {"kind": "gradbus", "codec": "topk:0.01|int8", "consistency": None},
    "single": {"kind": "single"},
}
REPLY_TIMEOUT = 180.0    # seconds a worker may take to set up a run or to send its result
START_MARGIN = 0.2       # seconds between the last worker's "ready" and the common start


class Pool:
    """W worker processes (bench/tta_worker.py), started once and reused for every run: torch
    is imported and the gloo group formed only once. Each worker's lines are read by a thread
    into a queue, so every wait has a deadline."""

    def __init__(self, workers: int):
        from gradbus.cluster import free_ports
        port = free_ports(1)[0]
        self.procs, self.lines = [], []
        for rank in range(workers):
            p = subprocess.Popen([sys.executable, WORKER, "--rank", str(rank), "--world",
                                  str(workers), "--ddp-port", str(port)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            q: queue.Queue = queue.Queue()
            threading.Thread(target=self._read, args=(p, q), daemon=True).start()
            self.procs.append(p)
            self.lines.append(q)

    @staticmethod
    def _read(p: subprocess.Popen, q: queue.Queue) -> None:
        for line in p.stdout:
            q.put(line)
        q.put(None)

    def send(self, rank: int, msg: dict) -> None:
        self.procs[rank].stdin.write(json.dumps(msg) + "\n")
        self.procs[rank].stdin.flush()

    def receive(self, rank: int, key: str, timeout: float = REPLY_TIMEOUT):
        try:
            line = self.lines[rank].get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"worker {rank}: no {key!r} within {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError(f"worker {rank} ended (exit {self.procs[rank].wait()})")
        return json.loads(line)[key]

    def close(self) -> None:
        from gradbus.cluster import end_processes
        for rank, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    self.send(rank, {"cmd": "exit"})
                except OSError:
                    pass
        end_processes(self.procs, grace=10.0)


def run_one(pool: Pool, name: str, seed: int, straggler: float, a, run_id: int,
            url: str | None) -> dict:
    """One configuration, one seed: the run on every worker it needs (gradbus: against the
    cluster at ``url``, under names of its own), then each worker's result and, for gradbus,
    the broker's staleness figures for this run's pushes."""
    cfg = {**CONFIGS[name], "seed": seed, "straggler": straggler, "step_ms": a.step_ms,
           "jitter": a.jitter, "budget": a.budget, "eval_every": a.eval_every,
           "batch": a.batch, "lr": a.lr, "momentum": a.momentum}
    ranks = [0] if cfg["kind"] == "single" else list(range(len(pool.procs)))
    cfg["record"] = ranks[-1]
    before = after = None
    if cfg["kind"] == "gradbus":
        cfg.update(url=url, prefix=f"r{run_id}.", window=a.window, wait_own=a.wait_own,
                   push_momentum=push_momentum(a.momentum, len(ranks), a.push_momentum),
                   push_lr_scale=1.0 / len(ranks),
                   consistency=f"ssp:{a.ssp}" if cfg["consistency"] else None,
                   stale_policy=a.ssp_policy)
        before = staleness(url)
    for r in ranks:
        pool.send(r, {"cmd": "run", **cfg})
    for r in ranks:
        pool.receive(r, "ready")
    start = time.monotonic() + START_MARGIN
    for r in ranks:
        pool.send(r, {"start": start})
    results = [pool.receive(r, "result", a.budget + REPLY_TIMEOUT) for r in ranks]
    if before is not None:
        after = staleness(url)
    return summarize(name, seed, straggler, results, a, _mean_between(before, after))


def push_momentum(momentum: float, workers: int, given: float | None = None) -> float:
    """The momentum the shards use for W asynchronous workers: ``given``, else
    ``max(0, 1 - W (1 - momentum))``. Asynchrony adds momentum of its own, about 1 - 1/W for W
    workers (Mitliagkas et al., "Asynchrony begets momentum", 2016); lowering the explicit one so
    that (1 - explicit) / W = 1 - momentum keeps the total near the synchronous run's."""
    if given is not None:
        return given
    return max(0.0, 1.0 - workers * (1.0 - momentum))


def staleness(url: str) -> dict:
    """The broker's staleness histogram summary (count, mean) over every push so far."""
    import gradbus
    with gradbus.connect(url) as c:
        return c.status()["staleness"]


def _mean_between(before: dict | None, after: dict | None) -> float | None:
    """Mean staleness of the pushes counted between two summaries."""
    if before is None or after is None:
        return None
    n = after["count"] - before["count"]
    if n <= 0:
        return None
    total = (after["mean"] or 0) * after["count"] - (before["mean"] or 0) * before["count"]
    return round(total / n, 2)


def smoothed(curve: list, window: float) -> list:
    """The curve with each point's accuracy and log loss replaced by their mean over the points
    of the last ``window`` seconds (itself included): one evaluation of a model that SGD moves
    about is a noisy reading of where training is."""
    out = []
    for i, (t, _, _) in enumerate(curve):
        pts = [pt for pt in curve[:i + 1] if pt[0] > t - window] or [curve[i]]
        out.append([t, sum(p[1] for p in pts) / len(pts), sum(p[2] for p in pts) / len(pts)])
    return out


def time_to(curve: list, target: float) -> float | None:
    """Seconds at which the curve's test accuracy first reaches ``target`` (None: never)."""
    return next((t for t, acc, _ in curve if acc >= target), None)


def at_budget(curve: list, budget: float) -> list:
    """The last point of the curve at or before ``budget`` seconds."""
    inside = [pt for pt in curve if pt[0] <= budget]
    return inside[-1] if inside else curve[0]


def bytes_until(traces: list[list], t: float | None) -> int | None:
    """Gradient bytes every worker had sent at its last note at or before ``t``."""
    if t is None:
        return None
    return sum(max((b for tt, _, b in tr if tt <= t), default=0) for tr in traces)


def summarize(name, seed, straggler, results: list[dict], a,
              mean_staleness: float | None = None) -> dict:
    curve = results[-1]["curve"]
    tta = time_to(smoothed(curve, a.smooth), a.target)
    final = at_budget(smoothed(curve, a.final_window), a.budget)
    return {"config": name, "seed": seed, "straggler": straggler,
            "seconds_to_target": tta, "final_accuracy": round(final[1], 5),
            "final_log_loss": round(final[2], 5),
            "grad_bytes": sum(r["grad_bytes"] for r in results),
            "grad_bytes_to_target": bytes_until([r["trace"] for r in results], tta),
            "steps": [r["steps"] for r in results],
            "refused": sum(r.get("refused", 0) for r in results),
            "mean_staleness": mean_staleness,
            "curve": curve}


def _median(values):
    vals = [v for v in values if v is not None]
    if len(vals) < len(values) or not vals:   # a seed that never got there: no median
        return None
    return statistics.median(vals)


def aggregate(runs: list[dict], target: float, budget: float) -> list[dict]:
    """One line per (straggler, configuration): medians over the seeds, ratios to ddp's."""
    out = []
    for straggler in sorted({r["straggler"] for r in runs}):
        group = [r for r in runs if r["straggler"] == straggler]
        names = list(dict.fromkeys(r["config"] for r in group))
        med = {}
        for name in names:
            rs = [r for r in group if r["config"] == name]
            med[name] = {k: _median([r[k] for r in rs]) for k in
                         ("seconds_to_target", "final_accuracy", "final_log_loss", "grad_bytes",
                          "grad_bytes_to_target", "refused", "mean_staleness")}
            med[name]["steps"] = [int(statistics.median(s)) for s in zip(*(r["steps"] for r in rs))]
            med[name]["per_seed_seconds_to_target"] = [r["seconds_to_target"] for r in rs]
            med[name]["per_seed_final_accuracy"] = [r["final_accuracy"] for r in rs]
            med[name]["seeds"] = [r["seed"] for r in rs]
        for name in names:
            m = med[name]
            line = {"bench": "time_to_accuracy", "config": name, "straggler": straggler,
                    "target": target, "budget_s": budget, **m}
            line["vs_ddp_seconds"] = _ratio(m["seconds_to_target"], med, "ddp",
                                            "seconds_to_target")
            line["vs_ddp_accuracy_pp"] = (
                round(100 * (m["final_accuracy"] - med["ddp"]["final_accuracy"]), 2)
                if "ddp" in med else None)
            line["vs_async_grad_bytes_to_target"] = _ratio(
                m["grad_bytes_to_target"], med, "async", "grad_bytes_to_target", 4)
            out.append(line)
    return out


def _ratio(value, med: dict, ref: str, key: str, digits: int = 3):
    base = med.get(ref, {}).get(key)
    return round(value / base, digits) if value is not None and base else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--straggler", default="1,2", help="comma-separated slowdowns of worker 0")
    ap.add_argument("--jitter", type=float, default=0.0, help="std of the per-step noise")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--budget", type=float, default=20.0, help="wall seconds per run")
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy")
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--lr", type=float, default=0.05, help="per step of the global batch")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--push-momentum", type=float, default=None,
                    help="the shards' momentum (default: 1 - W (1 - momentum), at least 0)")
    ap.add_argument("--wait-own", action="store_true",
                    help="a gradbus worker waits for its push to be applied before its next step")
    ap.add_argument("--ssp", type=int, default=6, help="staleness bound S (versions)")
    ap.add_argument("--ssp-policy", choices=["refuse", "delay"], default="refuse",
                    help="what ssp does with a worker too far behind (Client.init's stale_policy)")
    ap.add_argument("--window", type=int, default=2, help="gradbus pushes in flight per worker")
    ap.add_argument("--eval-every", type=float, default=0.25)
    ap.add_argument("--smooth", type=float, default=1.0,
                    help="seconds of evaluations averaged for the time to the target")
    ap.add_argument("--final-window", type=float, default=2.0,
                    help="seconds of evaluations averaged for the final metric")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of an unmeasured run of each configuration first")
    ap.add_argument("--curves", default=None, help="write every run's curve here (JSON)")
    ap.add_argument("--plot", default=None, help="draw the median curves here (PNG)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 workers, 3 s, seed 0, straggler 2 (unless given)")
    a = ap.parse_args(argv)
    if a.quick:     # other defaults; what the command line gives still wins
        ap.set_defaults(workers=2, budget=3.0, seeds="0", straggler="2", warmup=0.5)
        a = ap.parse_args(argv)
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.stragglers = [float(s) for s in a.straggler.split(",")]
    a.configs = a.configs.split(",")
    unknown = [c for c in a.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    if a.workers < 1 or a.batch % a.workers:
        ap.error("--batch must be a multiple of --workers (each worker takes batch/W)")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    pool, cluster = Pool(a.workers), None
    runs, run_id = [], 0
    try:
        if any(CONFIGS[c]["kind"] == "gradbus" for c in a.configs):
            # one cluster for every gradbus run, a name prefix per run
            from gradbus.cluster import LocalCluster
            cluster = LocalCluster(a.shards, port=0).start()
        url = cluster.url if cluster else None
        if a.warmup > 0:
            # unmeasured: the first push of an optimizer or codec compiles its loops (numba)
            # in the shard and the worker, the first DDP step connects gloo's buffers
            short = argparse.Namespace(**{**vars(a), "budget": a.warmup})
            for name in a.configs:
                run_id += 1
                run_one(pool, name, a.seeds[0], a.stragglers[0], short, run_id, url)
        for straggler in a.stragglers:
            for i, seed in enumerate(a.seeds):
                k = i % len(a.configs)
                for name in a.configs[k:] + a.configs[:k]:      # rotated per seed
                    run_id += 1
                    r = run_one(pool, name, seed, straggler, a, run_id, url)
                    runs.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "curve"}),
                          file=sys.stderr, flush=True)
    finally:
        pool.close()
        if cluster is not None:
            cluster.stop()
    lines = aggregate(runs, a.target, a.budget)
    for line in lines:
        print(json.dumps(line), flush=True)
    if a.curves:
        with open(a.curves, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "runs": runs}, f)
    if a.plot:
        import tta_plot
        tta_plot.plot(runs, a, a.plot)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
