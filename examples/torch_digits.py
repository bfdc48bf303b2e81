"""Train a PyTorch MLP on scikit-learn's handwritten digits with asynchronous gradbus workers.

    python examples/torch_digits.py                 # 2 workers, 2 shards, 25 epochs
    python examples/torch_digits.py --codec 'topk:0.01|int8|zstd' --optimizer momentum
    python examples/torch_digits.py --json          # last line: a JSON summary

The launcher starts a local cluster (a broker and shard processes), runs the workers as child
processes of this script, shows their progress, then loads the server's final weights into a
fresh model and scores it on the held-out test set. Needs ``gradbus[torch,demo]``.
"""
from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import torch

import gradbus
import gradbus.torch
from gradbus import demo_model as dm
from gradbus.cluster import LocalCluster
from gradbus.demo import worker_line

PREFIX = "torch_digits."
OPTIMIZERS = {
    "adam": lambda lr: gradbus.Adam(lr=lr or dm.DEFAULT_LR),
    "momentum": lambda lr: gradbus.SGD(lr=lr or 0.02, momentum=0.9),
}
WINDOW = 2   # pushes in flight per worker: compute step N+1 while step N travels


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    sizes = dm.DEFAULT_SIZES
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    return torch.nn.Sequential(*layers)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def worker(args) -> None:
    """One asynchronous worker: forward and backward on the freshest weights, push, repeat."""
    torch.set_num_threads(1)
    X, y, _, _ = dm.load_digits_split(args.seed)
    X, y = X[args.index::args.workers], y[args.index::args.workers]
    rng = np.random.default_rng(args.seed * 1000 + args.index)
    model = make_model(args.seed)
    t0 = time.perf_counter()
    with gradbus.connect(args.broker, window=WINDOW, client_id=f"torch-digits-{args.index}-"
                         f"{rng.integers(1 << 30)}", seed=args.seed * 1000 + args.index) as client:
        ps = gradbus.torch.ParameterServerModule(
            model, client, optimizer=OPTIMIZERS[args.optimizer](args.lr), codec=args.codec,
            prefix=PREFIX)
        pushes = 0
        for epoch in range(1, args.epochs + 1):
            losses = []
            for Xb, yb in dm.iterate_minibatches(X, y, dm.DEFAULT_BATCH, rng):
                loss = torch.nn.functional.cross_entropy(ps(torch.from_numpy(Xb)),
                                                         torch.from_numpy(yb))
                loss.backward()
                ps.step()
                losses.append(loss.item())
                pushes += 1
            emit(worker=args.index, epoch=epoch, epochs=args.epochs,
                 loss=float(np.mean(losses)), pushes=pushes)
        client.flush()
        emit(worker=args.index, done=True, pushes=pushes, push_bytes=client.stats["push_bytes"],
             push_raw_bytes=client.stats["push_raw_bytes"],
             seconds=round(time.perf_counter() - t0, 2))


def evaluate(url: str, seed: int) -> float:
    """Load the server's weights into a fresh model and score it on the test split."""
    _, _, Xt, yt = dm.load_digits_split(seed)
    with gradbus.connect(url) as client:
        ps = gradbus.torch.ParameterServerModule(make_model(seed), client, prefix=PREFIX)
        ps.eval()
        with torch.no_grad():
            pred = ps(torch.from_numpy(Xt)).argmax(dim=1).numpy()
    return float(np.mean(pred == yt))


def _relay(i: int, proc: subprocess.Popen, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put((i, line))
    lines.put((i, None))


def launch(args, echo=print) -> dict:
    t0 = time.perf_counter()
    echo(f"starting a local cluster: 1 broker, {args.shards} shards")
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    with LocalCluster(args.shards, port=0) as cluster:
        try:
            echo(f"broker {cluster.url}; {args.workers} workers, {args.epochs} epochs, "
                 f"codec {args.codec}, optimizer {args.optimizer}")
            lines: queue.Queue = queue.Queue()
            for i in range(args.workers):
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--broker", cluster.url, "--index", str(i),
                     "--workers", str(args.workers), "--epochs", str(args.epochs),
                     "--codec", args.codec, "--optimizer", args.optimizer,
                     "--seed", str(args.seed), *(["--lr", str(args.lr)] if args.lr else [])],
                    stdout=subprocess.PIPE, text=True))
                relays.append(threading.Thread(target=_relay, args=(i, procs[-1], lines),
                                               daemon=True))
                relays[-1].start()
            done, open_ = {}, args.workers
            while open_:
                i, line = lines.get()
                if line is None:
                    open_ -= 1
                else:
                    worker_line(i, line, done, echo)
            for i, p in enumerate(procs):
                if p.wait() != 0 or i not in done:
                    raise SystemExit(f"worker {i} failed (exit {p.returncode})")
            acc = evaluate(cluster.url, args.seed)
            with gradbus.connect(cluster.url) as client:
                counters = client.status()["counters"]
        finally:
            for p, relay in zip(procs, relays):
                if p.poll() is None:
                    p.kill()
                p.wait()
                relay.join(5)     # reads to the end of the pipe, then the pipe is closed
                p.stdout.close()
    return {"test_accuracy": round(acc, 4),
            "pushes": int(counters.get("pushes_applied", 0)),
            "push_bytes": int(sum(d["push_bytes"] for d in done.values())),
            "push_raw_bytes": int(sum(d["push_raw_bytes"] for d in done.values())),
            "seconds": round(time.perf_counter() - t0, 2), "workers": args.workers,
            "shards": args.shards, "epochs": args.epochs, "codec": args.codec,
            "optimizer": args.optimizer}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=dm.DEFAULT_EPOCHS)
    ap.add_argument("--codec", default="raw", help="gradient codec chain, e.g. bf16")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    ap.add_argument("--lr", type=float, default=None, help="default: adam 2e-3, momentum 0.02")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--broker", help=argparse.SUPPRESS)       # set for the worker processes
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.broker:
        worker(args)
        return
    s = launch(args)
    print(f"\ntest accuracy {s['test_accuracy']:.4f}  pushes applied {s['pushes']}  "
          f"gradient bytes {s['push_bytes'] / 2**20:.1f} MiB  seconds {s['seconds']:.1f}")
    if args.json:
        print(json.dumps(s))


if __name__ == "__main__":
    main()
