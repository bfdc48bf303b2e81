"""The `gradbus` command: up, status, demo, --help; clean shutdown with no orphans."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import gradbus
from gradbus.cli import main

from .rigs import wait_for
from .rigs import zombie_or_gone as _gone

COMMANDS = ["broker", "shard", "up", "demo", "status"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def test_up_ready_status_and_sigterm_leaves_no_orphans():
    proc = subprocess.Popen([sys.executable, "-m", "gradbus", "up", "--shards", "2", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = wait_for(lambda: proc.stdout.readline().strip(), 60, "ready line")
        assert line.startswith("ready: tcp://127.0.0.1:"), line
        url = line.split(" ", 1)[1]
        kids = _children(proc.pid)
        assert len(kids) == 3  # broker + 2 shards
        with gradbus.connect(url) as c:
            c.init({"w": np.zeros(10, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            c.push({"w": np.ones(10, np.float32)}).result(10)
            r = CliRunner().invoke(main, ["status", "--broker", url, "--json"])
            assert r.exit_code == 0, r.output
            st = json.loads(r.output)
            assert len(st["shards"]) == 2 and all(s["alive"] for s in st["shards"])
            assert st["counters"]["pushes_applied"] == 1
            assert st["tensors"][0]["name"] == "w" and st["tensors"][0]["version"] == 1
            assert len(st["workers"]) == 1
            r = CliRunner().invoke(main, ["status", "--broker", url])
            assert r.exit_code == 0 and "shard-0" in r.output and "alive" in r.output
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        for k in kids:
            wait_for(lambda k=k: _gone(k), 10, f"child {k} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_up_started_with_its_stop_signals_blocked_still_stops_on_sigterm():
    """A parent that holds SIGTERM and SIGINT blocked when it starts ``up`` (the mask passes
    across exec): up unblocks them, stops its children and exits."""
    blocked = {signal.SIGTERM, signal.SIGINT}
    proc = subprocess.Popen([sys.executable, "-m", "gradbus", "up", "--shards", "1", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked))
    kids: list[int] = []
    try:
        line = wait_for(lambda: proc.stdout.readline().strip(), 60, "ready line")
        assert line.startswith("ready: "), line
        kids = _children(proc.pid)
        assert len(kids) == 2
        with open(f"/proc/{proc.pid}/status") as f:
            mask = int(next(x for x in f if x.startswith("SigBlk:")).split()[1], 16)
        assert not mask & (1 << (signal.SIGTERM - 1) | 1 << (signal.SIGINT - 1)), hex(mask)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for k in kids:
            wait_for(lambda k=k: _gone(k), 10, f"child {k} to exit")
    finally:
        kids = [*kids, *_children(proc.pid)]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in kids:       # what up started, should the test fail before up stopped it
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdout.close()


def test_status_without_broker_is_a_clear_error():
    r = CliRunner().invoke(main, ["status", "--broker", "tcp://127.0.0.1:9", "--timeout", "0.3"])
    assert r.exit_code != 0 and "no reply from the broker" in r.output


def test_bad_broker_url_is_a_clear_error():
    r = CliRunner().invoke(main, ["status", "--broker", "http://nowhere"])
    assert r.exit_code != 0 and "tcp://HOST:PORT" in r.output


def _demo() -> dict:
    r = subprocess.run([sys.executable, "-m", "gradbus", "demo", "--json"], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip().splitlines()
    assert any("worker 1" in line for line in out)   # per-worker progress shown
    return json.loads(out[-1])


def test_demo_json_summary():
    s = _demo()
    assert {"test_accuracy", "pushes", "wire_bytes", "seconds"} <= set(s)
    assert s["pushes"] == 2 * 575 and s["wire_bytes"] > 0
    if s["test_accuracy"] < 0.95:
        # Asynchronous training varies run to run (measured: 0.967-0.978 in 17 of 18 runs,
        # once 0.944); a second run below the target is a real failure.
        s = _demo()
    assert s["test_accuracy"] >= 0.95, s
    assert s["baseline_accuracy"] - s["test_accuracy"] <= 0.03, s


def test_demo_worker_waits_for_shards_instead_of_failing():
    import threading

    import numpy as np

    import gradbus
    from gradbus import admin
    from gradbus.broker.server import BrokerServer
    from gradbus.demo import _init_when_ready
    from gradbus.shards.server import ShardServer

    from .rigs import wait_for

    broker = BrokerServer("127.0.0.1", 0)
    threads = [broker.start_thread()]
    shard = None
    try:
        with gradbus.connect(broker.url) as c:
            done = []
            t = threading.Thread(target=lambda: done.append(_init_when_ready(
                c, {"w": np.zeros(4, np.float32)}, gradbus.SGD(lr=0.1), wait=30)))
            t.start()
            wait_for(lambda: admin.status(broker.url)["errors"].get("NO_SHARDS"), 10,
                     "the worker to find no shard")
            shard = ShardServer(broker.url, "late-shard")
            threads.append(shard.start_thread())
            t.join(30)
            assert done == [None] and c.pull(["w"])["w"].shape == (4,)
    finally:
        if shard is not None:
            shard.stop()
        broker.stop()
        for th in threads:
            th.join(10)
