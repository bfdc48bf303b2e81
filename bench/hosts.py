"""gradbus and PyTorch RPC across emulated hosts: network namespaces joined by shaped links.

The hosts (bench/hosts_net.py): a server namespace with the broker and its shards (or the RPC
server) and the switch, and one namespace per worker, each joined to the switch by a veth pair
shaped with tc in both directions: ``--link`` (and ``--delay``) for the workers' links,
``--server-link`` (and ``--server-delay``) for the server host's. They are made once per run,
for the most workers asked, and deleted at its end, on an error, at Ctrl-C and at SIGTERM;
at start, namespaces a killed run of this bench left are swept.

Systems, in the same namespaces and the same run (bench/peers.py's workers, ``--depth`` D
updates in flight per worker: each waits for its oldest, takes weights that include it and
sends the next):

    gradbus   ``gradbus up --shards S --host 10.77.0.1`` in the server namespace (its broker and
              shards on one host, shared memory between them), SDK workers in the worker
              namespaces with GRADBUS_SHM=0, pushing with ``acks=1`` and ``--codec``; once the
              oldest push's ACK is in, ``pull(["w"], min_version=ack["ver"])``. The shard's
              ``--weights-codec`` comes from ``--weights-codec`` (as GRADBUS_SHARD_WEIGHTS_CODEC).
    rpc       bench/peers_rpc.py's parameter server, TensorPipe held to TCP (``_transports=
              ["uv"], _channels=["basic"]``), TP_SOCKET_IFNAME each namespace's interface; raw
              only (it has no codecs)

One JSON line per system, size, workers W, depth, codec and weights codec (medians of the
``--repeat`` rounds, which are interleaved):

    updates_per_s        updates made fresh per second, all workers
    rx_per_push, tx_per_push
                         bytes the workers' interfaces received and sent, per push (all
                         workers' bytes over all their pushes in the window; IP, TCP and
                         Ethernet headers included)
    rx_per_raw, tx_per_raw
                         the same over the raw tensor's bytes (1.0: a whole fp32 tensor)
    rx_over_tx           each worker's bytes received over its bytes sent
    worker_down_util, worker_up_util
                         the workers' links, each way: bits over the window against the rate,
                         the mean of the workers
    server_in_util, server_out_util
                         the server host's link, each way
    fresh_p50_ms, fresh_p99_ms
                         push to the worker holding weights that include it
    drops_per_s          packets the links' shapers dropped per second (a queue of 5 ms of
                         the link's rate was full), all links
    cpu_util             CPU seconds of every process of the configuration over the window,
                         per second and per core of this machine (1.0: every core busy)
    cpu_ms_server, cpu_ms_workers
                         CPU milliseconds per update of the server host's processes (gradbus
                         up, its broker and shards; the RPC server) and of all the workers
    vs_rpc               updates_per_s over rpc's at the same size, W and depth (each round's
                         ratio, then their median)
    vs_raw               over gradbus's with raw gradients and raw weights at the same size, W
                         and depth
    vs_w1                over the same system and codecs with one worker

Usage (as root): python bench/hosts.py [--link 1gbit] [--server-link 10gbit] [--delay 0]
    [--server-delay 0] [--systems gradbus,rpc] [--workers 1,2,4] [--depth 1,4] [--sizes 4M]
    [--codec raw] [--weights-codec raw] [--pairs G/W,...] [--shards 1] [--seconds 4]
    [--warmup 1.5] [--repeat 1]
Lists (``--codec raw,bf16``) run every combination (stages of a chain are joined by ``|``);
``--pairs raw/raw,topk:0.01|int8/delta|bf16`` runs the gradient/weights pairs given instead.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_net  # noqa: E402  (the namespaces and links)
import peers  # noqa: E402  (the workers, gradbus up's start and stop, CPU accounting)
import throughput  # noqa: E402  (the sizes)
from floor import Samples, count_window  # noqa: E402
from hosts_net import SERVER_ADDR, SERVER_DEV, WORKER_DEV, HostsError  # noqa: E402

SYSTEMS = ("gradbus", "rpc")
READY_TIMEOUT = 180.0


def _start(system: str, hosts, run: dict, counters, stop, lat, pids: dict):
    """bench/peers.py's configuration of ``system`` placed on the hosts."""
    if system == "gradbus":      # workers on other hosts: frames, no shared memory
        return peers.gradbus_config(run, counters, stop, lat, "0", hosts=hosts, pids=pids)
    return peers.rpc_config(run, counters, stop, lat, tcp_only=True, clone=False, hosts=hosts,
                            pids=pids)


def measure(system: str, hosts, run: dict) -> dict:
    """One configuration: its updates, the bytes each worker's link and the server's carried,
    and the CPU its processes spent, over one window."""
    ctx = mp.get_context("spawn")
    w = run["workers"]
    counters, stop = ctx.RawArray("q", w), ctx.RawValue("b", 0)
    lat = [Samples(ctx) for _ in range(w)]
    samples, pids = [], {}

    with _start(system, hosts, run, counters, stop, lat, pids) as alive:
        def sample():
            s = {"t": time.monotonic(), "counts": list(counters),
                 "workers": [hosts_net.dev_bytes(pid, WORKER_DEV) for pid in pids["workers"]],
                 "server": hosts_net.dev_bytes(pids["server"], SERVER_DEV),
                 "cpu": peers.cpu_seconds(), "drops": hosts.drops()}
            samples.append(s)
            return s
        count_window(counters, alive, run["warmup"], run["seconds"], sample=sample,
                     ready_timeout=READY_TIMEOUT)
    first, last = samples
    secs = last["t"] - first["t"]
    pushes = [b - a for a, b in zip(first["counts"], last["counts"])]
    rx = [b[0] - a[0] for a, b in zip(first["workers"], last["workers"])]
    tx = [b[1] - a[1] for a, b in zip(first["workers"], last["workers"])]
    srx, stx = (b - a for a, b in zip(first["server"], last["server"]))
    fresh = []
    for s in lat:
        fresh += s.window(first["t"], last["t"])[1]
    done = sum(pushes)
    cpu = peers.cpu_between(first["cpu"], last["cpu"])
    cpu_workers = sum(last["cpu"].get(pid, 0.0) - first["cpu"].get(pid, 0.0)
                      for pid in pids["workers"])
    link, server = hosts.link_bps * secs / 8, hosts.server_bps * secs / 8   # bytes a window
    return {"updates_per_s": done / secs,
            "rx_per_push": sum(rx) / done if done else None,
            "tx_per_push": sum(tx) / done if done else None,
            "rx_over_tx": [r / t if t else None for r, t in zip(rx, tx)],
            "worker_down_util": statistics.mean(rx) / link,
            "worker_up_util": statistics.mean(tx) / link,
            "server_in_util": srx / server, "server_out_util": stx / server,
            "fresh_p50_ms": peers._ms(fresh, 50), "fresh_p99_ms": peers._ms(fresh, 99),
            "cpu_util": cpu / secs / os.cpu_count(),
            "cpu_ms_server": 1e3 * (cpu - cpu_workers) / done if done else None,
            "cpu_ms_workers": 1e3 * cpu_workers / done if done else None,
            "drops_per_s": (last["drops"] - first["drops"]) / secs}


# ----------------------------------------------------------------------------- output
def _median(values: list):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _sig(x, digits: int = 4):
    return None if x is None else float(f"{x:.{digits}g}")


def _ratio(rounds: list, key: tuple, ref: tuple):
    """The median over rounds of key's updates/s over ref's, in the same round."""
    vals = [r[key]["updates_per_s"] / r[ref]["updates_per_s"] for r in rounds
            if r.get(key, {}).get("updates_per_s") and r.get(ref, {}).get("updates_per_s")]
    return round(statistics.median(vals), 3) if vals else None


def line(key: tuple, rounds: list, a) -> dict:
    system, size, w, depth, codec, wcodec = key
    runs = [r[key] for r in rounds if key in r and "error" not in r[key]]
    nbytes = throughput.SIZES[size]
    out = {"bench": "hosts", "system": system, "size": size, "bytes": nbytes, "workers": w,
           "depth": depth, "codec": codec, "weights_codec": wcodec, "link": a.link,
           "server_link": a.server_link, "delay": a.delay, "server_delay": a.server_delay}
    med = {f: _median([r[f] for r in runs]) for f in runs[0] if f != "rx_over_tx"} if runs else {}
    out["updates_per_s"] = round(med["updates_per_s"], 2) if runs else None
    for f in ("rx_per_push", "tx_per_push"):
        out[f] = round(med[f]) if med.get(f) is not None else None
    for f, src in (("rx_per_raw", "rx_per_push"), ("tx_per_raw", "tx_per_push")):
        out[f] = _sig(med[src] / nbytes) if med.get(src) is not None else None
    out["rx_over_tx"] = [_sig(_median([r["rx_over_tx"][i] for r in runs]), 3)
                         for i in range(w)] if runs else None
    for f in ("worker_down_util", "worker_up_util", "server_in_util", "server_out_util",
              "cpu_util", "cpu_ms_server", "cpu_ms_workers", "drops_per_s"):
        out[f] = _sig(med.get(f), 3)
    for f in ("fresh_p50_ms", "fresh_p99_ms"):
        out[f] = _sig(med.get(f))
    out["vs_rpc"] = _ratio(rounds, key, ("rpc", size, w, depth, "raw", "raw"))
    out["vs_raw"] = _ratio(rounds, key, ("gradbus", size, w, depth, "raw", "raw")) \
        if system == "gradbus" else None
    out["vs_w1"] = _ratio(rounds, key, (system, size, 1, depth, codec, wcodec))
    out["repeats"] = len(rounds)
    out["rates"] = [round(r[key]["updates_per_s"], 2) if r.get(key, {}).get("updates_per_s")
                    else None for r in rounds]
    errors = [r[key]["error"] for r in rounds if "error" in r.get(key, {})]
    if errors:
        out["error"] = errors[0]
    out["cpus"] = os.cpu_count()
    return out


# ----------------------------------------------------------------------------- main
def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # every finally runs: processes ended, namespaces gone


def _lists(a, ap) -> tuple:
    try:
        workers = [int(x) for x in a.workers.split(",")]
        depths = [int(x) for x in a.depth.split(",")]
    except ValueError:
        ap.error("--workers and --depth are lists of positive integers")
    systems, sizes = a.systems.split(","), a.sizes.split(",")
    if a.pairs:         # GRADIENT/WEIGHTS chains, each pair as given
        pairs = [tuple(p.split("/")) for p in a.pairs.split(",")]
        if any(len(p) != 2 for p in pairs):
            ap.error("--pairs is a list of GRADIENT/WEIGHTS chains, e.g. raw/raw,bf16/delta|bf16")
    else:
        pairs = list(itertools.product(a.codec.split(","), a.weights_codec.split(",")))
    codecs, wcodecs = {p[0] for p in pairs}, {p[1] for p in pairs}
    if (min(workers) < 1 or min(depths) < 1 or a.repeat < 1 or a.shards < 1
            or not set(systems) <= set(SYSTEMS) or not set(sizes) <= set(throughput.SIZES)):
        ap.error(f"--workers, --depth, --repeat and --shards must be at least 1, --systems a "
                 f"list of {', '.join(SYSTEMS)}, --sizes of {', '.join(throughput.SIZES)}")
    from gradbus.codecs import tensor, wire
    for chain in codecs:
        try:
            tensor.parse_chain(chain)
        except Exception as e:          # noqa: BLE001  (the codec's own message)
            ap.error(f"--codec {chain!r}: {e}")
    for chain in wcodecs:
        try:
            wire.split_weights_codec(chain)
        except Exception as e:          # noqa: BLE001
            ap.error(f"--weights-codec {chain!r}: {e}")
    for text, parse in ((a.link, hosts_net.parse_rate), (a.server_link, hosts_net.parse_rate),
                        (a.delay, hosts_net.parse_delay),
                        (a.server_delay, hosts_net.parse_delay)):
        try:
            parse(text)
        except ValueError as e:
            ap.error(str(e))
    keys = []
    for size, w, depth, (codec, wcodec), system in itertools.product(
            sizes, workers, depths, pairs, systems):
        if system == "rpc" and (codec, wcodec) != ("raw", "raw"):
            continue        # the RPC peer has no codecs
        keys.append((system, size, w, depth, codec, wcodec))
    return keys, max(workers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link", default="1gbit", help="each worker host's link (tc rate)")
    ap.add_argument("--server-link", default="10gbit", help="the server host's link")
    ap.add_argument("--delay", default="0", help="one-way delay added on each worker link, "
                                                 "each way (needs the netem qdisc)")
    ap.add_argument("--server-delay", default="0", help="the same on the server's link")
    ap.add_argument("--systems", default="gradbus,rpc")
    ap.add_argument("--workers", default="1,2,4", help="worker hosts, a list")
    ap.add_argument("--depth", default="1,4", help="updates in flight per worker, a list")
    ap.add_argument("--sizes", default="4M")
    ap.add_argument("--codec", default="raw", help="gradbus's gradient chains, a list")
    ap.add_argument("--weights-codec", default="raw", help="the shard's weights chains, a list")
    ap.add_argument("--pairs", default=None,
                    help="GRADIENT/WEIGHTS chain pairs instead of every combination of --codec "
                         "and --weights-codec, e.g. raw/raw,topk:0.01|int8/delta|bf16")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds; lines give medians")
    a = ap.parse_args(argv)
    keys, most = _lists(a, ap)
    why = hosts_net.permitted()
    if why:
        print(f"hosts: cannot make the emulated hosts: {why}. Run it as root, where network "
              f"namespaces are allowed (sudo .venv/bin/python bench/hosts.py ...).",
              file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    swept = hosts_net.sweep()
    if swept:
        print(f"hosts: removed namespaces a killed run left: {', '.join(swept)}",
              file=sys.stderr)
    hosts = hosts_net.Hosts(most, a.link, a.server_link, a.delay, a.server_delay)
    try:
        hosts.build()
        print(f"hosts: {hosts.server} (server, {SERVER_ADDR}, {a.server_link}) and "
              f"{len(hosts.workers)} worker hosts ({a.link} each)", file=sys.stderr, flush=True)
        return _run(a, keys, hosts)
    except HostsError as e:
        print(f"hosts: {e}", file=sys.stderr)
        return 2
    finally:
        hosts.close()
        left = hosts.left()
        if left:
            print(f"hosts: could not delete {', '.join(left)}", file=sys.stderr)
        with contextlib.suppress(Exception):     # multiprocessing's resource tracker
            from multiprocessing import resource_tracker
            resource_tracker._resource_tracker._stop()


def _run(a, keys: list, hosts) -> int:
    rounds = []
    for _ in range(a.repeat):
        round_ = {}
        for key in keys:
            system, size, w, depth, codec, wcodec = key
            run = {"bytes": throughput.SIZES[size], "workers": w, "depth": depth,
                   "codec": codec, "weights_codec": wcodec, "shards": a.shards,
                   "warmup": a.warmup, "seconds": a.seconds}
            try:
                round_[key] = measure(system, hosts, run)
            except HostsError:
                raise
            except Exception as e:       # noqa: BLE001  (the other configurations still run)
                round_[key] = {"error": f"{type(e).__name__}: {e}"}
                print(f"hosts: {key} failed: {e}", file=sys.stderr, flush=True)
        rounds.append(round_)
    for key in keys:
        print(json.dumps(line(key, rounds, a)), flush=True)
    return 0 if any("error" not in r[k] for r in rounds for k in keys) else 1


if __name__ == "__main__":
    sys.exit(main())
