"""The broker's memory under a stalled shard: many producers (SDK clients in threads, one raw
DEALER in another process that ignores its window and never resends), the only shard stopped
(SIGSTOP, liveness raised so that it is not failed over). The broker's RSS, sampled from /proc
for the whole stall, stays under its baseline + ``--max-pending-mb`` + an allowance; ``gradbus
status`` is answered during the stall; after SIGCONT every acknowledged push is applied exactly
once (known answer)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import zmq

import gradbus
from gradbus import admin
from gradbus.codecs import wire

from .child import ROOT

CAP_MIB = 32
# What the broker may hold beyond the cap: the message being read, the few in libzmq's pipes and
# socket buffers at a time (the loop reads the frontend all the time), and allocator slack.
ALLOWANCE_MIB = 64
N = 1 << 18                       # float32: 1 MiB pushes, one block "w/0"
LR = 2.0 ** -8


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:     # gone: the test fails on what it asserts, not here
        pass
    return 0.0


def flood(url: str, seconds: float, wait: float) -> None:
    """Push 1 MiB gradients of ``w`` as fast as the socket takes them for ``seconds``, never
    resending (a BUSY push is simply lost to this producer), then wait up to ``wait`` seconds
    for an answer to each; prints ``{"sent", "acked", "busy", "other"}`` as JSON."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.sndhwm = 16
    s.linger = 0
    s.connect(url)
    print("ready", flush=True)
    desc, buf = wire.encode_tensor("w/0", np.ones(N, np.float32), "raw")
    buf = bytes(buf)
    acked, busy, other = set(), set(), []
    sent = 0

    def answers(timeout_ms: int) -> None:
        if not s.poll(timeout_ms, zmq.POLLIN):
            return
        while True:
            try:
                h = wire.unpack_header(s.recv(zmq.NOBLOCK), wire.CLIENT_KINDS)
            except zmq.Again:
                return
            if h["kind"] == wire.ACK:
                acked.update(h.get("msgs") or [h["msg"]])
            elif h["kind"] == wire.ERROR and h.get("code") == "BUSY":
                busy.add(h["msg"])
            else:
                other.append(h)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.send_multipart([wire.pack(wire.PUSH, [desc], msg=sent + 1, acks=1), buf],
                             zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            answers(10)
        answers(0)
    end = time.monotonic() + wait
    while len(acked) + len(busy) + len(other) < sent and time.monotonic() < end:
        answers(100)
    print(json.dumps({"sent": sent, "acked": len(acked), "busy": len(busy),
                      "other": [str(h)[:200] for h in other[:5]]}), flush=True)
    s.close()
    ctx.term()


def _produce(c, acks, stop: threading.Event, refused: list) -> None:
    g = np.ones(N, np.float32)
    while not stop.is_set():
        try:
            c.push({"w": g}, acks=acks, timeout=0.3)
        except gradbus.BackPressureError:
            refused.append(1)


def test_stalled_shard_many_producers_memory_bounded_status_answered_nothing_lost(
        make_cluster, monkeypatch):
    # the bytes this bound is about pass through the broker: frames (with shared memory on, an
    # SDK client's pushes are references into its own ring, bounded by that ring)
    monkeypatch.setenv("GRADBUS_SHM", "0")
    hb = ["--heartbeat-interval", "0.5", "--liveness", "100"]        # 50 s: not failed over
    cluster = make_cluster(1, broker_args=[*hb, "--max-pending-mb", str(CAP_MIB)],
                           shard_args=hb)
    pid = cluster.broker_proc.pid
    shard = cluster.shard_procs["shard-0"]
    clients = [gradbus.connect(cluster.url, window=12, timeout=60) for _ in range(4)]
    stop, refused, threads, flooder = threading.Event(), [], [], None
    samples: list[float] = []
    sampling = threading.Event()
    sampler = None
    try:
        c0 = clients[0]
        c0.init({"w": np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
        assert admin.status(cluster.url)["tensors"][0]["blocks"] == 1
        c0.push({"w": np.ones(N, np.float32)}).result(20)
        rss0 = _rss_mib(pid)
        bound = rss0 + CAP_MIB + ALLOWANCE_MIB

        def sample() -> None:
            while not sampling.is_set():
                samples.append(_rss_mib(pid))
                sampling.wait(0.02)

        shard.send_signal(signal.SIGSTOP)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            flooder = subprocess.Popen(
                [sys.executable, "-c", "from tests.test_memory_bound import flood; "
                                       f"flood({cluster.url!r}, 6.0, 60.0)"],
                cwd=ROOT, stdout=subprocess.PIPE, text=True)
            assert flooder.stdout.readline().strip() == "ready"
            for i, c in enumerate(clients):     # two acks=0 producers, two acks=1
                t = threading.Thread(target=_produce, args=(c, i % 2, stop, refused),
                                     daemon=True)
                t.start()
                threads.append(t)
            answered = 0
            t_end = time.monotonic() + 6.0
            while time.monotonic() < t_end:     # the CLI is answered while producers wait
                out = subprocess.run([sys.executable, "-m", "gradbus", "status", "--json",
                                      "--broker", cluster.url, "--timeout", "5"],
                                     cwd=ROOT, capture_output=True, text=True, timeout=30)
                assert out.returncode == 0, out.stderr[-2000:]
                st = json.loads(out.stdout)
                assert st["pending_bytes"] <= CAP_MIB << 20
                answered += 1
            busy_seen = admin.status(cluster.url)["counters"].get("busy", 0)
        finally:
            stop.set()
            shard.send_signal(signal.SIGCONT)
        sampling.set()
        sampler.join(5)
        for t in threads:
            t.join(30)
        for c in clients:
            c.flush(60)
        res = json.loads(flooder.communicate(timeout=90)[0])
        acked = sum(c.stats["pushes_acked"] for c in clients) + res["acked"]
        w = c0.pull(["w"], min_version=acked, timeout=60)["w"]
        st = admin.status(cluster.url)
    finally:
        stop.set()
        sampling.set()
        if sampler is not None:
            sampler.join(5)
        if shard.poll() is None:
            shard.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
        if flooder is not None:
            if flooder.poll() is None:
                flooder.kill()
            flooder.communicate()
    peak = max(samples)
    if os.environ.get("GRADBUS_RSS_TRACE"):
        print("RSS trace", [round(x) for x in samples[::10]])
    print(f"broker RSS: baseline {rss0:.1f} MiB, peak {peak:.1f} MiB over {len(samples)} "
          f"samples, bound {bound:.1f} MiB; status answered {answered}x; busy {busy_seen}; "
          f"flooder {res}")
    assert answered >= 1 and busy_seen > 0 and res["busy"] > 0 and not res["other"]
    assert res["acked"] + res["busy"] == res["sent"]          # every push answered
    assert all(c.stats["push_errors"] == 0 for c in clients)
    assert sum(c.stats["busy_retries"] for c in clients) > 0
    assert peak <= bound, f"broker RSS peaked at {peak:.1f} MiB, bound {bound:.1f} MiB"
    assert st["counters"]["pushes_applied"] == acked
    assert np.array_equal(w, np.full(N, -acked * LR, np.float32))
    assert os.path.exists(f"/proc/{pid}")
