"""Push throughput of gradbus against a plain ZeroMQ C proxy, measured in the same run.

For each configuration (gradient size x workers x shards x codec) it starts a real local cluster
(broker + shard processes) and worker processes that push gradients of one tensor as fast as
their credit window allows while following the tensor's weights. In the same run, the same number
of producer processes push messages of the same size through ``zmq.proxy`` (PULL -> PUSH, the C
loop) to as many consumers as there are shards. One JSON line per configuration:

    pushes_per_s      pushes acknowledged as applied, per second, all workers
    grad_gbps         gradient bytes (decoded fp32) applied per second, GB/s
    updates_per_s     weight updates received by the workers, per second, all workers
    proxy_msgs_per_s  the C proxy's one-way messages per second on the same work
    ratio             pushes_per_s / proxy_msgs_per_s

With ``--repeat N`` each configuration runs N times, each gradbus run right after a proxy run;
the line gives the medians, the ratio as the median of the N ratios, and ``ratios`` (each run's).

With ``--curve on`` (or ``both``) the gradbus cluster runs with CurveZMQ on (keys made in a
temporary folder) and the line says ``"curve": true``; the proxy stays plain.

``--backends numpy,cupy`` runs each configuration's cluster once per shard backend
(``GRADBUS_BACKEND`` for its shard processes), in the same run, one line each with
``"backend"``; ``--optimizer adam`` has the workers create the tensor with Adam (default SGD).

Usage: python bench/throughput.py [--quick] [--seconds S] [--sizes 64K,4M] [--codec raw]
                                  [--curve off|on|both] [--repeat N]
                                  [--backends numpy,cupy] [--optimizer sgd|adam]
                                  [--broker-args '--shard-credit 4']
                                  [--shard-args '--weights-codec bf16']
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import zmq

SIZES = {"64K": 64 << 10, "1M": 1 << 20, "4M": 4 << 20, "16M": 16 << 20}


def parts(n: int, k: int) -> list[int]:
    """``n`` elements cut into ``k`` parts as equal as they come (a model split over servers)."""
    return [n // k + (i < n % k) for i in range(k)]


# ----------------------------------------------------------------------------- gradbus
def _gradbus_worker(url, index, nbytes, codec, warmup, seconds, out, curve=False,
                    optimizer="sgd"):
    import gradbus
    n = nbytes // 4
    opt = gradbus.Adam(lr=1e-6) if optimizer == "adam" else gradbus.SGD(lr=1e-6)
    with gradbus.connect(url, timeout=60, curve=curve) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=opt)
        c.pull(["w"])                       # follow the tensor: fresh weights arrive by subscription
        g = np.random.default_rng(index).standard_normal(n).astype(np.float32)
        t0 = time.perf_counter()
        marks = {}
        while True:
            now = time.perf_counter() - t0
            if "a" not in marks and now >= warmup:
                marks["a"] = (now, c.stats["pushes_acked"], c.stats["updates_received"])
            if now >= warmup + seconds:
                marks["b"] = (now, c.stats["pushes_acked"], c.stats["updates_received"])
                break
            c.push({"w": g}, codec=codec, acks=1)
        (ta, pa, ua), (tb, pb, ub) = marks["a"], marks["b"]
        out.put({"pushes": pb - pa, "updates": ub - ua, "seconds": tb - ta})
        c.flush(60)


def run_gradbus(nbytes, workers, shards, codec, warmup, seconds, broker_args=(),
                curve_dir=None, shard_args=(), backend=None, optimizer="sgd") -> dict:
    from gradbus.cluster import LocalCluster
    ctx = mp.get_context("spawn")
    saved = os.environ.get("GRADBUS_BACKEND")
    if backend:          # the shard processes inherit it (restarted ones too)
        os.environ["GRADBUS_BACKEND"] = backend
    try:
        with LocalCluster(shards, port=0, broker_args=list(broker_args),
                          shard_args=list(shard_args), curve_dir=curve_dir) as cluster:
            out = ctx.Queue()
            procs = [ctx.Process(target=_gradbus_worker,
                                 args=(cluster.url, i, nbytes, codec, warmup, seconds, out,
                                       cluster.curve or False, optimizer))
                     for i in range(workers)]
            for p in procs:
                p.start()
            res = [out.get(timeout=warmup + seconds + 120) for _ in procs]
            for p in procs:
                p.join(60)
    finally:
        if backend:
            os.environ.pop("GRADBUS_BACKEND", None)
            if saved is not None:
                os.environ["GRADBUS_BACKEND"] = saved
    secs = max(r["seconds"] for r in res)
    pushes = sum(r["pushes"] for r in res) / secs
    return {"pushes_per_s": round(pushes, 1),
            "grad_gbps": round(pushes * nbytes / 1e9, 3),
            "updates_per_s": round(sum(r["updates"] for r in res) / secs, 1)}


# ----------------------------------------------------------------------------- C proxy
PROXY_HWM = 16   # bounded queues, as gradbus bounds its own; 1000 x 16 MiB would thrash memory


def _proxy(front, back):
    ctx = zmq.Context()
    f = ctx.socket(zmq.PULL)
    f.rcvhwm = PROXY_HWM
    f.bind(front)
    b = ctx.socket(zmq.PUSH)
    b.sndhwm = PROXY_HWM
    b.bind(back)
    try:
        zmq.proxy(f, b)
    except zmq.ContextTerminated:
        pass


def _producer(front, nbytes, stop_at):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.sndhwm = PROXY_HWM
    s.connect(front)
    payload = np.ones(nbytes // 4, np.float32)
    header = b"\x81\xa4kind\xa4push"
    s.sndtimeo = 200
    while time.time() < stop_at:
        try:
            s.send_multipart([header, payload], copy=False)
        except zmq.Again:
            pass
    s.close(linger=0)
    ctx.term()


class Meter:
    """Counts events in a window: from the first one ``warmup`` seconds after it is made, for
    ``seconds``. ``tick()`` per event says whether the window is over; ``rate()`` is the events
    per second inside it."""

    def __init__(self, warmup: float, seconds: float):
        self.warmup, self.end = warmup, warmup + seconds
        self.t0, self.start, self.count, self.now = time.perf_counter(), None, 0, 0.0

    def tick(self) -> bool:
        self.now = time.perf_counter() - self.t0
        if self.start is None:
            if self.now >= self.warmup:
                self.start = self.now
        else:
            self.count += 1
        return self.start is not None and self.now >= self.end

    def overdue(self, grace: float) -> bool:
        return time.perf_counter() - self.t0 > self.end + grace

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.t0 - (self.start or 0.0)
        return self.count / max(elapsed, 1e-9)


def _consumer(back, warmup, seconds, out):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.rcvhwm = PROXY_HWM
    s.connect(back)
    meter = Meter(warmup, seconds)
    while True:
        if s.poll(200):
            s.recv_multipart(copy=False)
            if meter.tick():
                break
        elif meter.overdue(5):
            break
    out.put(meter.rate())
    s.close(linger=0)
    ctx.term()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (below the ephemeral range)."""
    from gradbus.cluster import free_ports
    return free_ports(1)[0]


def run_proxy(nbytes, producers, consumers, warmup, seconds) -> float:
    ctx = mp.get_context("spawn")
    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proxy = ctx.Process(target=_proxy, args=(front, back), daemon=True)
    proxy.start()
    out = ctx.Queue()
    cons = [ctx.Process(target=_consumer, args=(back, warmup + 1.0, seconds, out))
            for _ in range(consumers)]
    for c in cons:
        c.start()
    stop_at = time.time() + 1.0 + warmup + seconds + 1.0
    prods = [ctx.Process(target=_producer, args=(front, nbytes, stop_at)) for _ in range(producers)]
    for p in prods:
        p.start()
    res = [out.get(timeout=warmup + seconds + 60) for _ in cons]
    for p in prods + cons:
        p.join(30)
    proxy.terminate()
    proxy.join(5)
    return sum(res)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M,4M,16M")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--shards", default="1,2")
    ap.add_argument("--codec", default="raw", help="comma-separated codec chains")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--quick", action="store_true", help="4M only, 2 workers, 1 shard, raw and bf16")
    ap.add_argument("--curve", choices=["off", "on", "both"], default="off",
                    help="CurveZMQ on the gradbus cluster")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each configuration, interleaved with proxy runs; the line "
                         "gives the medians and each run's ratio")
    ap.add_argument("--broker-args", default="", help="extra broker flags, e.g. "
                    "'--shard-credit 4' (the line then names them)")
    ap.add_argument("--shard-args", default="", help="extra shard flags, e.g. "
                    "'--weights-codec bf16'")
    ap.add_argument("--backends", default="", help="comma-separated shard backends, each a "
                    "cluster of its own in the same run (numpy,cupy); default: the environment's")
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    curves = {"off": [False], "on": [True], "both": [False, True]}[a.curve]
    keys = tempfile.TemporaryDirectory(prefix="gradbus-bench-keys-")
    broker_args, shard_args = a.broker_args.split(), a.shard_args.split()
    extra = {k: v for k, v in (("broker_args", a.broker_args), ("shard_args", a.shard_args),
                               ("optimizer", a.optimizer if a.optimizer != "sgd" else ""))
             if v}
    backends = a.backends.split(",") if a.backends else [None]
    if a.quick:
        a.sizes, a.workers, a.shards, a.codec = "4M", "2", "1", "raw,bf16"
    for size in a.sizes.split(","):
        nbytes = SIZES[size]
        for w in map(int, a.workers.split(",")):
            for s in map(int, a.shards.split(",")):
                runs = [(c, v, b) for c in a.codec.split(",") for v in curves for b in backends]
                proxies, results = [], {run: [] for run in runs}
                for _ in range(a.repeat):   # interleaved: both see the same drift of the machine
                    proxies.append(run_proxy(nbytes, w, s, a.warmup, a.seconds))
                    for codec, curve, be in runs:
                        results[codec, curve, be].append(run_gradbus(
                            nbytes, w, s, codec, a.warmup, a.seconds, broker_args=broker_args,
                            curve_dir=keys.name if curve else None, shard_args=shard_args,
                            backend=be, optimizer=a.optimizer))
                for (codec, curve, be), rs in results.items():
                    named = {**extra, "backend": be} if be else extra
                    print(json.dumps(_line(size, nbytes, w, s, codec, curve, named, rs, proxies)),
                          flush=True)


def ratio_fields(rates: list, proxies: list) -> dict:
    """``ratio``: the median of each run's rate over the proxy run just before it; with more
    than one run, also ``repeats`` and each run's ``ratios``."""
    ratios = [r / p if p else None for r, p in zip(rates, proxies)]
    out = {"ratio": round(statistics.median(ratios), 3) if None not in ratios else None}
    if len(ratios) > 1:
        out["repeats"] = len(ratios)
        out["ratios"] = [round(x, 3) if x is not None else None for x in ratios]
    return out


def _line(size, nbytes, workers, shards, codec, curve, extra, results, proxies) -> dict:
    """One configuration's JSON line: the medians of its repeats and their ratios."""
    return {"bench": "throughput", "size": size, "bytes": nbytes, "workers": workers,
            "shards": shards, "codec": codec, "curve": curve, **extra,
            **{k: round(statistics.median(r[k] for r in results), 3 if k == "grad_gbps" else 1)
               for k in results[0]},
            "proxy_msgs_per_s": round(statistics.median(proxies), 1),
            **ratio_fields([r["pushes_per_s"] for r in results], proxies),
            "cpus": os.cpu_count()}


if __name__ == "__main__":
    sys.exit(main())
