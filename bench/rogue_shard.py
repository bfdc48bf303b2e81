"""A peer borrowing a live shard's name as its routing id, while a client pushes.

``gradbus up --shards 2`` (with ``--curve`` when given a key directory), one SDK client pushing
``acks=1`` once a second for ``--seconds``; after 3 s a DEALER of this script's own connects
to the broker's backend with routing id ``b"shard-0"``, sends one REGISTER for shard-0 and
stays connected. Prints one JSON line: pushes acknowledged and failed, shards the broker
declared lost, which shards are alive at the end, and what the rogue was answered.

    python bench/rogue_shard.py                 # CURVE off
    python bench/rogue_shard.py --curve DIR     # CURVE on (keys made in DIR)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

import gradbus
from gradbus import admin
from gradbus.codecs import net, security, wire

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (gradbus up's start and its ending)

ROGUE_AFTER = 3.0     # seconds of pushing before the rogue connects


def _rogue(ctx: zmq.Context, url: str, curve) -> zmq.Socket:
    welcome = net.hello(ctx, url, "shard", 10.0, curve=curve)
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if curve is not None:
        security.client_setup(s, curve)
    s.setsockopt(zmq.ROUTING_ID, b"shard-0")
    s.connect(net.url(net.split_url(url)[0], welcome["backend"]))
    s.send(wire.pack(wire.REGISTER, shard="shard-0", holds=[]))
    return s


def run(seconds: float, curve_dir: str | None) -> dict:
    cmd = [sys.executable, "-m", "gradbus", "up", "--shards", "2", "--port", "0"]
    if curve_dir:
        cmd += ["--curve", curve_dir]
    with tempfile.NamedTemporaryFile("w+", prefix="gradbus-rogue-", suffix=".log") as log:
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
        ctx, rogue = zmq.Context(), None
        try:
            url = peers._wait_ready(up, log.name, peers.READY_TIMEOUT)
            curve = security.Curve.from_files(os.path.join(curve_dir, "client.key_secret"),
                                              os.path.join(curve_dir, "broker.key")) \
                if curve_dir else None
            kw = {"curve": curve} if curve is not None else {}
            ok, failed, reply = 0, [], None
            with gradbus.connect(url, **kw) as c:
                c.init({"w": np.zeros(1000, np.float32)}, optimizer=gradbus.SGD(lr=0.1))
                t0 = time.monotonic()
                while time.monotonic() - t0 < seconds:
                    if rogue is None and time.monotonic() - t0 >= ROGUE_AFTER:
                        rogue = _rogue(ctx, url, curve)
                    try:
                        c.push({"w": np.ones(1000, np.float32)}, acks=1).result(10)
                        ok += 1
                    except gradbus.GradbusError as e:
                        failed.append(f"{type(e).__name__}: {e}")
                    if rogue is not None and reply is None and rogue.poll(0):
                        reply = msgpack.unpackb(rogue.recv())
                    time.sleep(1.0)
                st = admin.status(url, **kw)
            return {"bench": "rogue_shard", "curve": bool(curve_dir), "seconds": seconds,
                    "pushes_acked": ok, "pushes_failed": len(failed), "failures": failed[:5],
                    "shards_lost": st["counters"].get("shards_lost", 0),
                    "alive": {s["id"]: s["alive"] for s in st["shards"]},
                    "rogue_answer": {k: reply.get(k) for k in ("kind", "code")}
                    if reply else None}
        finally:
            if rogue is not None:
                rogue.close()
            ctx.term()
            peers._end_group(up)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--curve", metavar="DIR", help="CURVE on, its keys made (or reused) in DIR")
    a = ap.parse_args()
    line = run(a.seconds, a.curve)
    print(json.dumps(line), flush=True)
    return 0 if line["pushes_failed"] == 0 and line["shards_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
