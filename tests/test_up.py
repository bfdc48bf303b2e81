"""`gradbus up` keeps its processes running: a broker or shard that dies is started again (the
broker on its ports, a shard from its checkpoints), within a bounded number of restarts; up
exits non-zero when it gives up, or when a process fails at the stop."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

import gradbus
from gradbus import admin
from gradbus.cluster import RestartPolicy
from gradbus.codecs import cores, net

from .rigs import wait_for, zombie_or_gone

LR = 2.0 ** -6
FAST = {"GRADBUS_BROKER_HEARTBEAT_INTERVAL": "0.1", "GRADBUS_BROKER_LIVENESS": "5"}


# -- the restart policy, without processes --------------------------------------------------

def test_restart_policy_backs_off_and_gives_up_within_its_window():
    p = RestartPolicy(max_restarts=3, window=60.0, backoff_min=0.5, backoff_max=1.5)
    assert [p.delay("broker", t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 1.5]
    assert p.delay("broker", 3.0) is None           # a fourth death within 60 s: give up
    assert p.delay("shard-0", 3.0) == 0.5            # counted per process
    assert p.delay("broker", 61.5) == 1.0            # the deaths at 0 and 1 s left the window
    assert RestartPolicy(max_restarts=0).delay("broker", 0.0) is None


# -- up as a real process tree ----------------------------------------------------------------

class Up:
    """`gradbus up ARGS` with its stderr in a file; the processes it runs by role."""

    def __init__(self, tmp_path, *args):
        self.err_path = tmp_path / "up.err"
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradbus", "up", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.err, text=True, env={**os.environ, **FAST})
        self.seen: set[int] = set()

    def ready(self) -> str:
        line = wait_for(lambda: self.proc.stdout.readline().strip(), 60, "the ready line")
        assert line.startswith("ready: "), (line, self.stderr())
        self.url = line.split(" ", 1)[1]
        return self.url

    def children(self) -> dict[str, int]:
        """role ("broker" or the shard id) -> pid, of the processes alive under up (of a
        broker pair: "broker:PORT", by its client port)."""
        out = {}
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                pids = [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode().split("\0")
            except FileNotFoundError:
                continue
            if zombie_or_gone(pid) or "gradbus" not in argv:
                continue
            cmd = argv[argv.index("gradbus") + 1]
            if cmd not in ("broker", "shard"):   # forked, not yet the program it runs
                continue
            self.seen.add(pid)
            if cmd == "broker" and "--peer" in argv:
                out[f"broker:{argv[argv.index('--port') + 1]}"] = pid
            else:
                out["broker" if cmd == "broker" else argv[argv.index("--id") + 1]] = pid
        return out

    def stderr(self) -> str:
        self.err.flush()
        return self.err_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.err.close()
        for pid in self.seen:       # every child ends with up (PR_SET_PDEATHSIG)
            wait_for(lambda pid=pid: zombie_or_gone(pid), 10, f"child {pid} to exit")


@pytest.fixture
def up(tmp_path):
    started = []

    def start(*args) -> Up:
        u = Up(tmp_path, *args)
        started.append(u)
        return u
    yield start
    for u in started:
        u.close()


def _ports(url: str) -> tuple[int, int]:
    h = net.hello(zmq.Context.instance(), url, "client", 5.0)
    return h["backend"], h["events"]


def _alive(url: str) -> int:
    try:
        return sum(1 for s in admin.status(url, timeout=1.0)["shards"] if s["alive"])
    except gradbus.GradbusError:
        return 0


def test_a_sigkilled_broker_comes_back_on_its_ports_and_no_acked_push_is_lost(up):
    u = up("--shards", "2")
    url = u.ready()
    ports = _ports(url)
    first = u.children()
    assert set(first) == {"broker", "shard-0", "shard-1"}
    n, w0 = 40, np.full(3000, 1.0, np.float32)
    with gradbus.connect(url, block_bytes=2048, resend_after=0.5) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        for _ in range(n):
            c.push({"w": np.ones_like(w0)}, acks=1)
        c.flush()
        os.kill(first["broker"], signal.SIGKILL)
        wait_for(lambda: u.children().get("broker") not in (None, first["broker"]), 30,
                 "up to start the broker again")
        wait_for(lambda: _alive(url) == 2, 30, "the shards to register with it")
        assert _ports(url) == ports                 # the same client, shard and events ports
        # the client may have called the broker silent while it was down (flush then raises
        # at once); its SUB reconnects with back-off: wait until it hears the broker again
        wait_for(lambda: c.broker_alive, 30, "the client to hear the broker again")
        for _ in range(n):
            c.push({"w": np.ones_like(w0)})
        c.flush(30)
        w = c.pull(["w"], min_version=2 * n, timeout=30)["w"]
    assert np.array_equal(w, w0 - 2 * n * LR)
    assert {k: v for k, v in u.children().items() if k != "broker"} == {
        "shard-0": first["shard-0"], "shard-1": first["shard-1"]}   # the shards stayed up
    assert "broker exited with -9; starting it again" in u.stderr()
    u.proc.send_signal(signal.SIGTERM)
    assert u.proc.wait(30) == 0, u.stderr()


def test_up_runs_a_broker_pair_and_a_killed_active_broker_comes_back_as_the_standby(up):
    u = up("--shards", "2", "--brokers", "2", "--replicas", "2")
    url = u.ready()
    assert len(url.split(",")) == 2
    wait_for(lambda: [b["role"] for b in admin.status(url)["brokers"]].count("active") == 1,
             30, "one active broker")
    active = next(b for b in admin.status(url)["brokers"] if b["role"] == "active")
    port = net.split_url(active["url"])[1]
    first = u.children()
    assert len([k for k in first if k.startswith("broker:")]) == 2
    n, w0 = 30, np.zeros(3000, np.float32)
    with gradbus.connect(url, block_bytes=2048) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        for _ in range(n):
            c.push({"w": np.ones_like(w0)}, acks="all")
        c.flush(30)
        os.kill(first[f"broker:{port}"], signal.SIGKILL)
        for _ in range(n):       # through the standby, at once
            c.push({"w": np.ones_like(w0)}, acks="all")
        c.flush(60)
        w = c.pull(["w"], min_version=2 * n, timeout=30)["w"]
        assert c.url != active["url"]
    assert np.array_equal(w, w0 - 2 * n * LR)
    wait_for(lambda: u.children().get(f"broker:{port}") not in (None, first[f"broker:{port}"]),
             30, "up to start the killed broker again")
    wait_for(lambda: {b["url"]: b["role"] for b in admin.status(url)["brokers"]}
             == {active["url"]: "standby",
                 next(x for x in url.split(",") if x != active["url"]): "active"},
             30, "the killed broker back as the standby")
    u.proc.send_signal(signal.SIGTERM)
    assert u.proc.wait(30) == 0, u.stderr()


def test_a_sigkilled_shard_is_started_again_from_its_checkpoint(up, tmp_path):
    data = tmp_path / "data"
    u = up("--shards", "1", "--data-dir", str(data))
    url = u.ready()
    first = u.children()
    w0 = np.full(3000, 1.0, np.float32)
    with gradbus.connect(url, block_bytes=2048, resend_after=0.5) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        for _ in range(10):
            c.push({"w": np.ones_like(w0)}).result(10)
        ck = admin.checkpoint(url)[0]["path"]
        assert ck.startswith(str(data / "shard-0"))
        os.kill(first["shard-0"], signal.SIGKILL)
        pid = wait_for(lambda: u.children().get("shard-0") not in (None, first["shard-0"])
                       and u.children()["shard-0"], 30, "up to start the shard again")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert ["--restore", ck] == [a for a in f.read().decode().split("\0")
                                         if a in ("--restore", ck)]
        wait_for(lambda: _alive(url) == 1 and not admin.status(url)["partitions_down"], 30,
                 "the shard back with its partitions")
        c.push({"w": np.ones_like(w0)}).result(20)
        w = c.pull(["w"], min_version=11, timeout=30)["w"]
    assert np.array_equal(w, w0 - 11 * LR)
    assert "shard-0 exited with -9; starting it again" in u.stderr()
    u.proc.send_signal(signal.SIGTERM)
    assert u.proc.wait(30) == 0, u.stderr()


def test_a_sigkilled_broker_with_inproc_shards_comes_back_from_their_checkpoints(up, tmp_path):
    # the shards die with the broker: what was acknowledged after their newest checkpoint is
    # lost (operations.md, "Shards inside the broker's process"), the rest comes back
    data = tmp_path / "data"
    u = up("--shards", "2", "--inproc", "--data-dir", str(data))
    url = u.ready()
    first = u.children()
    assert set(first) == {"broker"}                 # no shard process
    w0 = np.full(3000, 1.0, np.float32)
    with gradbus.connect(url, block_bytes=2048) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        for _ in range(10):
            c.push({"w": np.ones_like(w0)}).result(10)
        paths = sorted(r["path"] for r in admin.checkpoint(url))
        assert [p.startswith(str(data / f"shard-{i}")) for i, p in enumerate(paths)] == [True] * 2
        for _ in range(5):                           # acknowledged, not checkpointed
            c.push({"w": np.ones_like(w0)}).result(10)
    os.kill(first["broker"], signal.SIGKILL)
    wait_for(lambda: u.children().get("broker") not in (None, first["broker"]), 30,
             "up to start the broker again")
    wait_for(lambda: _alive(url) == 2 and not admin.status(url)["partitions_down"], 30,
             "the shards back with their partitions")
    with gradbus.connect(url) as c:
        assert np.array_equal(c.pull(["w"], timeout=30)["w"], w0 - 10 * LR)
        ack = c.push({"w": np.ones_like(w0)}).result(20)
        w = c.pull(["w"], min_version=ack["ver"], timeout=30)["w"]
    assert np.array_equal(w, w0 - 11 * LR)
    assert "broker exited with -9; starting it again" in u.stderr()
    u.proc.send_signal(signal.SIGTERM)
    assert u.proc.wait(30) == 0, u.stderr()


def test_a_broker_that_keeps_dying_makes_up_give_up_non_zero(up):
    u = up("--shards", "1", "--max-restarts", "2")
    u.ready()
    killed = []
    for _ in range(3):          # two restarts allowed: the third death is one too many
        broker = wait_for(lambda: u.children().get("broker") not in (None, *killed)
                          and u.children()["broker"], 30, "a broker to kill")
        os.kill(broker, signal.SIGKILL)
        killed.append(broker)
    assert u.proc.wait(60) == 1
    err = u.stderr()
    assert err.count("broker exited with -9; starting it again") == 2, err
    assert "Error: broker exited with -9, its restart number 3 within 60s: giving up" in err, err


def test_a_shard_that_fails_at_the_stop_makes_up_exit_non_zero(up):
    u = up("--shards", "1")
    u.ready()
    shard = u.children()["shard-0"]
    os.kill(shard, signal.SIGSTOP)          # it cannot stop cleanly: killed after the grace
    try:
        u.proc.send_signal(signal.SIGTERM)
        assert u.proc.wait(60) == 1
    finally:
        if not zombie_or_gone(shard):
            os.kill(shard, signal.SIGCONT)
    assert "shard-0 exited with -9 while stopping" in u.stderr()


def test_a_stop_code_of_a_shard_is_what_up_exits_with(monkeypatch):
    """up's own logic, with a cluster whose shard exited 1 at the stop (as a shard whose final
    checkpoint failed does)."""
    import click

    from gradbus.cli import serve

    class Cluster:
        url, keys = "tcp://127.0.0.1:1", None

        def start(self):
            pass

        def supervise(self, stop, policy, say):
            return None

        def stop(self):
            return {"shard-0": 1, "shard-1": 0, "broker": 0}
    with pytest.raises(click.ClickException) as e:
        serve._run_cluster(Cluster(), threading.Event())
    assert "shard-0 exited with 1 while stopping" in e.value.message
    assert "final checkpoint" in e.value.message


def test_a_failed_final_checkpoint_makes_up_exit_non_zero(up, tmp_path):
    data = tmp_path / "data"
    u = up("--shards", "1", "--data-dir", str(data))
    u.ready()
    assert "shard-0" in u.children()
    shutil.rmtree(data / "shard-0", ignore_errors=True)
    data.mkdir(exist_ok=True)
    (data / "shard-0").write_text("not a folder")      # the final checkpoint cannot be written
    u.proc.send_signal(signal.SIGTERM)
    try:
        code = u.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"up did not exit 60 s after SIGTERM; its children {u.children()}; "
                    f"its stderr:\n{u.stderr()}")
    assert code == 1, u.stderr()
    assert "shard-0 exited with" in u.stderr()


# -- the host's layout ------------------------------------------------------------------------

def test_the_local_layout_follows_the_cores():
    assert [cores.local_shards(n) for n in (1, 2, 8, 16, 24, 32, 64, 256)] == \
        [2, 2, 2, 2, 3, 4, 8, 8]


def _environ(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in pairs}


def test_up_says_its_layout_and_tells_the_shards_how_many_share_the_host(up, monkeypatch):
    monkeypatch.delenv(cores.HOST_SHARDS_ENV, raising=False)
    u = up()                                   # no --shards: from the host's cores
    u.ready()
    want = cores.local_shards()
    line = next(ln for ln in u.stderr().splitlines() if ln.startswith("layout: "))
    assert line.startswith(f"layout: {want} shards (from {cores.usable_cores()} usable cores)")
    assert f"{cores.pass_threads(host_shards=want)} pass thread" in line
    kids = wait_for(lambda: (lambda k: k if len(k) == want + 1 else None)(u.children()), 30,
                    "the broker and the shards")
    for role, pid in kids.items():
        assert _environ(pid)[cores.HOST_SHARDS_ENV] == str(want), role


def test_up_with_inproc_shards_shares_one_pool_and_says_so(up, monkeypatch):
    monkeypatch.delenv(cores.HOST_SHARDS_ENV, raising=False)
    u = up("--shards", "3", "--inproc")
    u.ready()
    line = next(ln for ln in u.stderr().splitlines() if ln.startswith("layout: "))
    assert line.startswith("layout: 3 shards in the broker process (set --shards)")
    assert "in all" in line
    kids = wait_for(lambda: u.children() or None, 30, "the broker")
    assert _environ(kids["broker"])[cores.HOST_SHARDS_ENV] == "1"
