"""``gradbus demo``: asynchronous workers train an MLP on the handwritten digits.

The launcher starts a local cluster (unless given one), spawns the worker processes
(``gradbus worker``), shows each worker's progress, then scores the final server weights on the
held-out test set next to the same model trained in one process for the same epochs.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import numpy as np

import gradbus
from gradbus import demo_model as dm
from gradbus.codecs.errors import GradbusError
from gradbus.workers.tier_client import member_statuses

PARAM_PREFIX = "digits."
OPTIMIZERS = {  # the server-side rule; adam matches the single-process baseline
    "adam": lambda: gradbus.Adam(lr=dm.DEFAULT_LR),
    "momentum": lambda: gradbus.SGD(lr=0.02, momentum=0.9),
}
# Unacknowledged pushes per worker: step N+1 is computed while step N travels, and its push
# waits for N's ack. More in flight adds staleness: over 10 alternating runs each, 2 (with
# acks=0) ended 0.81 pp below the one-process baseline on average (3 runs more than 1 pp
# below), 1 with acks=1 0.39 pp (1 run), for about 10% more time.
WINDOW = 1


def worker_main(broker_url: str, index: int, workers: int, epochs: int | None, codec: str,
                seed: int, error_feedback: bool = True, accumulate: int = 1,
                optimizer: str = "adam", metrics: tuple = (None, "127.0.0.1")) -> None:
    """One asynchronous worker: pull the freshest weights, compute, push, never wait.
    ``metrics``: (port, host) to serve the client's Prometheus metrics on (port None: off)."""
    epochs = epochs or dm.DEFAULT_EPOCHS
    X, y, Xt, yt = dm.load_digits_split(seed)
    X, y = X[index::workers], y[index::workers]
    init = {PARAM_PREFIX + k: v for k, v in dm.init_params(dm.DEFAULT_SIZES, seed).items()}
    rng = np.random.default_rng(seed * 1000 + index)
    t0 = time.perf_counter()
    with gradbus.connect(broker_url, client_id=f"demo-worker-{index}-{rng.integers(1 << 30)}",
                         window=WINDOW, error_feedback=error_feedback, seed=seed * 1000 + index) as c:
        exporter = None
        if metrics[0] is not None:
            from gradbus.metrics import serve_client
            exporter = serve_client(c, metrics[0], metrics[1])
            print(json.dumps({"worker": index, "metrics": exporter.url}), flush=True)
        try:
            _worker_loop(c, index, epochs, codec, init, X, y, rng, t0, accumulate, optimizer,
                         (Xt, yt))
        finally:
            if exporter is not None:
                exporter.close()


def _worker_loop(c, index, epochs, codec, init, X, y, rng, t0, accumulate, optimizer,
                 test) -> None:
    _init_when_ready(c, init, OPTIMIZERS[optimizer]())
    if accumulate > 1:
        c.accumulate(every=accumulate)
    names = list(init)
    steps = 0
    for epoch in range(epochs):
        losses = []
        for Xb, yb in dm.iterate_minibatches(X, y, dm.DEFAULT_BATCH, rng):
            w = c.pull(names)
            params = {k[len(PARAM_PREFIX):]: v for k, v in w.items()}
            loss, grads = dm.loss_and_grads(params, Xb, yb)
            c.push({PARAM_PREFIX + k: g for k, g in grads.items()}, codec=codec, acks=1)
            losses.append(loss)
            steps += 1
        print(json.dumps({"worker": index, "epoch": epoch + 1, "epochs": epochs,
                          "loss": float(np.mean(losses)), "pushes": steps}), flush=True)
    c.flush()
    # the test accuracy of the weights this worker holds when it is done: its last line then
    # says whether training worked (the launcher scores the final weights itself)
    w = c.pull(names)
    acc = dm.accuracy({k[len(PARAM_PREFIX):]: v for k, v in w.items()}, *test)
    print(json.dumps({"worker": index, "done": True, "test_accuracy": round(acc, 4),
                      "pushes": steps,
                      "push_bytes": c.stats["push_bytes"], "recv_bytes": c.stats["recv_bytes"],
                      "push_raw_bytes": c.stats["push_raw_bytes"],
                      "cache": c.cache_stats,
                      "seconds": time.perf_counter() - t0}), flush=True)


def _init_when_ready(client, tensors, optimizer, wait: float = 60.0) -> None:
    """init, waiting (with back-off) while the cluster has no live shard yet: a worker started
    next to a fresh broker (containers) need not be started last."""
    when_ready(lambda: client.init(tensors, optimizer=optimizer), wait)


def when_ready(call, wait: float = 60.0):
    """``call()``, retried with back-off while the cluster has no live shard yet."""
    deadline, delay = time.monotonic() + wait, 0.2
    while True:
        try:
            return call()
        except GradbusError as e:
            code = getattr(e.code, "value", e.code)
            if code not in ("NO_SHARDS", "SHARD_UNAVAILABLE") or time.monotonic() > deadline:
                raise
            print(f"waiting for shards ({code})", file=sys.stderr, flush=True)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def progress_line(index: int, line: str, done: dict, echo=print) -> dict | None:
    """One line of worker ``index``'s output: a JSON progress message is returned; its final
    summary (``"done"``) is kept in ``done``, and other text is echoed as it is."""
    try:
        msg = json.loads(line)
    except ValueError:
        echo(line.rstrip())
        return None
    if not isinstance(msg, dict):
        return None
    if msg.get("done"):
        done[index] = msg
        return None
    return msg


def worker_line(index: int, line: str, done: dict, echo=print) -> None:
    """One line of worker ``index``'s output: its final summary (``"done"``) is kept in
    ``done``; the progress of its first and every fifth epoch is echoed, other text as it is."""
    msg = progress_line(index, line, done, echo)
    if msg is None:
        return
    if "epoch" not in msg:
        echo(f"  worker {index}  " + "  ".join(f"{k} {v}" for k, v in msg.items()
                                               if k != "worker"))
    elif msg["epoch"] % 5 == 0 or msg["epoch"] == 1:
        echo(f"  worker {index}  epoch {msg['epoch']:>3}/{msg['epochs']}  "
             f"loss {msg['loss']:.4f}  pushes {msg['pushes']}")


@contextlib.contextmanager
def cluster_at(broker_url: str | None, shards: int, echo=print):
    """The given broker URL, or a local cluster of ``shards`` shards started for the block."""
    if broker_url is not None:
        yield broker_url
        return
    from gradbus.cluster import LocalCluster
    echo(f"starting a local cluster: 1 broker, {shards} shards")
    cluster = LocalCluster(shards, port=0).start()
    try:
        yield cluster.url
    finally:
        cluster.stop()


def run_workers(argvs: list[list[str]], on_line, env=None) -> dict[int, dict]:
    """Run one worker process per argv; each line of worker ``i``'s output goes to
    ``on_line(i, line, done)``, which puts its final summary in ``done[i]``. Raises if a worker
    fails or ends without one; no worker outlives the call."""
    procs = []
    try:
        for argv in argvs:
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
        done: dict[int, dict] = {}
        for i, p in enumerate(procs):   # lines arrive interleaved in time; read each to its end
            for line in p.stdout:
                on_line(i, line, done)
            if p.wait() != 0 or i not in done:
                raise GradbusError(f"worker {i} failed (exit {p.returncode})")
        return done
    finally:
        from gradbus.cluster import end_processes
        end_processes(procs, grace=0.0)


def run(workers: int = 2, shards: int = 2, epochs: int | None = None, codec: str = "raw",
        broker_url: str | None = None, seed: int = 0, echo=print, error_feedback: bool = True,
        accumulate: int = 1, baseline: bool = True, optimizer: str = "adam") -> dict:
    epochs = epochs or dm.DEFAULT_EPOCHS
    t0 = time.perf_counter()
    with cluster_at(broker_url, shards, echo) as broker_url:
        echo(f"broker {broker_url}; {workers} workers, {epochs} epochs, codec {codec}")
        done = run_workers(
            [[sys.executable, "-m", "gradbus", "worker", "--broker", broker_url, "--index",
              str(i), "--workers", str(workers), "--epochs", str(epochs), "--codec", codec,
              "--seed", str(seed), "--accumulate", str(accumulate), "--optimizer", optimizer,
              "--error-feedback" if error_feedback else "--no-error-feedback"]
             for i in range(workers)],
            lambda i, line, done: worker_line(i, line, done, echo))
        with gradbus.connect(broker_url) as c:
            names = [PARAM_PREFIX + k for k in dm.init_params(dm.DEFAULT_SIZES, seed)]
            w = c.pull(names)
            st = c.status()
    params = {k[len(PARAM_PREFIX):]: v for k, v in w.items()}
    _, _, Xt, yt = dm.load_digits_split(seed)
    acc = dm.accuracy(params, Xt, yt)
    seconds = time.perf_counter() - t0
    base = dm.train_single_process(epochs=epochs, seed=seed) if baseline else None
    return {"test_accuracy": round(acc, 4),
            "baseline_accuracy": round(base["test_accuracy"], 4) if base else None,
            # of a tier, every member applies its part of each push: the most any member did
            "pushes": max(int(m["counters"].get("pushes_applied", 0))
                          for m in member_statuses(st)),
            "wire_bytes": int(sum(d["push_bytes"] + d["recv_bytes"] for d in done.values())),
            "push_bytes": int(sum(d["push_bytes"] for d in done.values())),
            "push_raw_bytes": int(sum(d["push_raw_bytes"] for d in done.values())),
            "weight_gaps": int(sum(d["cache"].get("gaps", 0) for d in done.values())),
            "error_feedback": error_feedback, "accumulate": accumulate,
            "optimizer": optimizer,
            "seconds": round(seconds, 2), "workers": workers, "shards": shards,
            "epochs": epochs, "codec": codec}


def format_summary(s: dict) -> str:
    mb = s["wire_bytes"] / 2**20
    return (f"\ntest accuracy {s['test_accuracy']:.4f} (one process, same epochs: "
            f"{s['baseline_accuracy']:.4f})\npushes applied {s['pushes']}  bytes on the wire "
            f"{mb:.1f} MiB  seconds {s['seconds']:.1f}")
