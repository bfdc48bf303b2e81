"""One worker process of bench/time_to_accuracy.py: the training loops on an emulated accelerator.

The launcher starts W of these once (``--rank r --world W --ddp-port P``); each joins a gloo
process group at start-up and then serves runs, one JSON line each way:

    launcher -> worker   {"cmd": "run", ...the run's settings...}
    worker -> launcher   {"ready": true}                    set up, waiting for the start time
    launcher -> worker   {"start": T}                        time.monotonic() of the common start
    worker -> launcher   {"result": {...}}                   steps, bytes, trace, curve
    launcher -> worker   {"cmd": "exit"}

A step is the real forward and backward pass of the model on this worker's batch plus a sleep
that stands for the device's time (``step_ms`` x this worker's factor x the jitter's draw),
placed between the forward and the backward. Every ``eval_every`` seconds of the run each worker
notes its steps and gradient bytes; the recording worker (``record``) also copies the weights
it holds, and scores the copies on the test split once the run is over, outside the timed part.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradbus
import gradbus.torch
from gradbus import demo_model as dm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from torch_digits import make_model  # noqa: E402  the demo's MLP in torch, seeded

STOP_EVERY = 8          # DDP ranks agree whether the budget is spent every this many steps
PG_TIMEOUT = 300.0      # seconds a gloo collective may wait (a rank still setting up a run)


def batches(X: np.ndarray, y: np.ndarray, size: int, rng: np.random.Generator):
    """Full batches of ``size`` forever, each epoch in a fresh order (a last partial batch is
    dropped, so every step sees the same number of examples)."""
    if size > len(X):
        raise ValueError(f"batch {size} is larger than this worker's {len(X)} examples")
    while True:
        order = rng.permutation(len(X))
        for start in range(0, len(X) - size + 1, size):
            idx = order[start:start + size]
            yield torch.from_numpy(X[idx]), torch.from_numpy(y[idx])


class Device:
    """The emulated accelerator: sleeps ``ms`` x ``factor`` per step, times a draw of
    ``1 + jitter * N(0, 1)`` (at least 0.1) when ``jitter`` is set."""

    def __init__(self, ms: float, factor: float, jitter: float, rng: np.random.Generator):
        self.seconds, self.jitter, self.rng = ms * factor / 1000.0, jitter, rng

    def step(self) -> None:
        s = self.seconds
        if self.jitter:
            s *= max(0.1, 1.0 + self.jitter * float(self.rng.standard_normal()))
        time.sleep(s)


class Recorder:
    """Every ``every`` seconds (checked after each step): this worker's steps and gradient
    bytes, and with ``weights`` a copy of the model's parameters, stamped with the time since
    the start."""

    def __init__(self, t0: float, every: float, weights: bool):
        self.t0, self.every, self.weights = t0, every, weights
        self.next = 0.0
        self.trace: list[list] = []
        self.snaps: list[tuple[float, list[torch.Tensor]]] = []

    def tick(self, model: torch.nn.Module, steps: int, nbytes: int, force: bool = False) -> None:
        t = time.monotonic() - self.t0
        if t < self.next and not force:
            return
        self.trace.append([round(t, 3), steps, int(nbytes)])
        if self.weights:
            self.snaps.append((t, [p.detach().clone() for p in model.parameters()]))
        self.next = (int(t / self.every) + 1) * self.every

    def curve(self, model: torch.nn.Module, Xt: np.ndarray, yt: np.ndarray) -> list[list]:
        """[t, test accuracy, test log loss] of every copy, scored with ``model``."""
        out = []
        x, y = torch.from_numpy(Xt), torch.from_numpy(yt)
        with torch.no_grad():
            for t, params in self.snaps:
                for p, v in zip(model.parameters(), params):
                    p.copy_(v)
                logits = model(x)
                acc = float((logits.argmax(1) == y).float().mean())
                out.append([round(t, 3), round(acc, 5), round(float(F.cross_entropy(logits, y)),
                                                             5)])
        return out


def _setup(rank: int, world: int, cfg: dict):
    """This worker's data, device, model and optimizer rule for a run."""
    seed = cfg["seed"]
    X, y, Xt, yt = dm.load_digits_split(seed)
    single = cfg["kind"] == "single"
    if not single:
        X, y = X[rank::world], y[rank::world]
    batch = cfg["batch"] if single else cfg["batch"] // world
    rng = np.random.default_rng(seed * 1000 + rank)
    factor = cfg["straggler"] if rank == 0 and not single else 1.0
    device = Device(cfg["step_ms"], factor, cfg["jitter"], np.random.default_rng(seed * 7 + rank))
    return batches(X, y, batch, rng), device, make_model(seed), (Xt, yt)


def run(rank: int, world: int, cfg: dict, say, hear) -> dict:
    data, device, model, test = _setup(rank, world, cfg)
    kind = cfg["kind"]
    if kind == "gradbus":
        return _run_gradbus(rank, world, cfg, data, device, model, test, say, hear)
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
        step = _torch_step(ddp, opt, device)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
        step = _torch_step(model, opt, device)
    nbytes = 4 * sum(p.numel() for p in model.parameters())   # fp32 gradient per step
    say({"ready": True})
    t0 = _wait_start(hear)
    rec = Recorder(t0, cfg["eval_every"], rank == cfg["record"])
    steps, end = 0, t0 + cfg["budget"]
    while True:
        if kind == "ddp" and steps % STOP_EVERY == 0:
            flag = torch.tensor([1 if time.monotonic() >= end else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        elif kind != "ddp" and time.monotonic() >= end:
            break
        step(*next(data))
        steps += 1
        rec.tick(model, steps, steps * nbytes)
    rec.tick(model, steps, steps * nbytes, force=True)
    return _result(rec, steps, steps * nbytes, model, test)


def _torch_step(model, opt, device):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        device.step()
        loss.backward()               # DDP: the gradients are averaged over the ranks here
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _run_gradbus(rank, world, cfg, data, device, model, test, say, hear) -> dict:
    cid = f"tta-{cfg['prefix']}-{rank}"
    mu = cfg["push_momentum"]
    # W pushes of batch/W examples stand for one step of the global batch; a lower momentum on
    # the shards keeps the step's long-run size lr / (1 - momentum) per global batch
    lr = cfg["lr"] * cfg["push_lr_scale"] * (1.0 - mu) / (1.0 - cfg["momentum"])
    opt = gradbus.SGD(lr=lr, momentum=mu)
    with gradbus.connect(cfg["url"], window=cfg["window"], client_id=cid,
                         seed=cfg["seed"] * 1000 + rank) as client:
        ps = gradbus.torch.ParameterServerModule(
            model, client, optimizer=opt, codec=cfg["codec"], acks=1, prefix=cfg["prefix"],
            consistency=cfg["consistency"], stale_policy=cfg["stale_policy"])
        say({"ready": True})
        t0 = _wait_start(hear)
        rec = Recorder(t0, cfg["eval_every"], rank == cfg["record"])
        steps, refused, end, pending = 0, 0, t0 + cfg["budget"], []
        while time.monotonic() < end:
            x, y = next(data)
            loss = F.cross_entropy(ps(x), y)
            device.step()
            loss.backward()
            fut = ps.step()
            if cfg["wait_own"] and fut is not None:
                try:
                    fut.result(60)
                except gradbus.StaleError:
                    refused += 1
                ps.sync()
            else:
                pending.append(fut)
            steps += 1
            refused += _settled(pending)
            rec.tick(model, steps, client.stats["push_bytes"])
        rec.tick(model, steps, client.stats["push_bytes"], force=True)
        client.flush()
        refused += _settled(pending, wait=True)
        out = _result(rec, steps, client.stats["push_bytes"], model, test)
        out.update(refused=refused, push_raw_bytes=client.stats["push_raw_bytes"])
        return out


def _settled(pending: list, wait: bool = False) -> int:
    """Drop the resolved push Futures from ``pending`` (all of them with ``wait``); returns how
    many were refused as too stale (ssp). Any other failure is raised."""
    refused, keep = 0, []
    for fut in pending:
        if fut is None:
            continue
        if not wait and not fut.done():
            keep.append(fut)
            continue
        try:
            fut.result(60)
        except gradbus.StaleError:
            refused += 1
    pending[:] = keep
    return refused


def _result(rec: Recorder, steps: int, nbytes: int, model, test) -> dict:
    return {"steps": steps, "grad_bytes": int(nbytes), "trace": rec.trace,
            "curve": rec.curve(model, *test) if rec.weights else None}


def _wait_start(hear) -> float:
    t0 = float(hear()["start"])
    time.sleep(max(0.0, t0 - time.monotonic()))
    return t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ddp-port", type=int, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.ddp_port}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=PG_TIMEOUT))
    out = sys.stdout
    sys.stdout = sys.stderr          # stray prints must not break the protocol

    def say(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def hear() -> dict:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit(0)      # the launcher is gone
        return json.loads(line)

    try:
        while True:
            msg = hear()
            if msg.get("cmd") == "exit":
                break
            say({"result": run(a.rank, a.world, msg, say, hear)})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
