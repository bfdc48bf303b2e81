"""CurveZMQ: key files, who gets in (clients, shards, subscribers, ops commands), and
encryption on the wire, against real brokers and shards on ephemeral ports."""
from __future__ import annotations

import json
import os
import pathlib
import re
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq
from click.testing import CliRunner

import gradbus
from gradbus import admin
from gradbus.broker.server import BrokerServer
from gradbus.cli import main
from gradbus.codecs import net, security, wire
from gradbus.workers import client as client_mod

from .rigs import gradbus_up, wait_for

FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No GRADBUS_* variable (a CURVE key, a config file) leaks in from the environment."""
    for name in list(os.environ):
        if name.startswith("GRADBUS_"):
            monkeypatch.delenv(name)


@pytest.fixture
def keys(tmp_path):
    return security.ClusterKeys.ensure(tmp_path / "keys")


def _rogue(tmp_path, name: str = "rogue") -> str:
    """A key pair the broker has never seen; returns the secret file."""
    return security.generate(tmp_path / "other", name)[1]


def _failed_handshake(mon: zmq.Socket, timeout: float = 10.0) -> int:
    """Wait for a failed-handshake event on a monitor socket; returns the event."""
    def event():
        if mon.poll(20):
            ev, _ = struct.unpack("=HI", mon.recv_multipart()[0][:6])
            return ev
        return None
    return wait_for(event, timeout, "a failed handshake")


# -- key files ------------------------------------------------------------------------------

def test_keys_generate_writes_usable_files(tmp_path):
    d = tmp_path / "k"
    r = CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "worker-1"])
    assert r.exit_code == 0, r.output
    pub, sec = d / "worker-1.key", d / "worker-1.key_secret"
    assert f"public key: {pub}" in r.output and f"secret key: {sec}" in r.output
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    public, secret = security.load_secret(sec)
    assert security.load_public(pub) == public and len(secret) == 40
    assert "secret-key" not in pub.read_text()

    # existing keys are kept unless --force
    r = CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "worker-1"])
    assert r.exit_code != 0 and "exists" in r.output
    assert security.load_public(pub) == public
    r = CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "worker-1", "--force"])
    assert r.exit_code == 0 and security.load_public(pub) != public
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    assert CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "../x"]).exit_code != 0

    # usable: a broker admits the new key once its public file is in the allow directory,
    # and refuses it again once removed (the directory is reread when it changes)
    CliRunner().invoke(main, ["keys", "generate", str(d), "--name", "broker"])
    allow = tmp_path / "allow"
    allow.mkdir()
    srv = BrokerServer("127.0.0.1", 0, curve=security.Curve.from_files(
        d / "broker.key_secret", allow=allow))
    t = srv.start_thread()
    try:
        me = security.Curve.from_files(sec, d / "broker.key")
        with pytest.raises(gradbus.SecurityError, match="refused this process's CURVE key"):
            admin.status(srv.url, 5.0, curve=me)
        shutil.copy(pub, allow / "worker-1.key")
        assert admin.status(srv.url, 5.0, curve=me)["partitions"] == 256
        os.remove(allow / "worker-1.key")
        with pytest.raises(gradbus.SecurityError, match="refused"):
            admin.status(srv.url, 5.0, curve=me)
    finally:
        srv.stop()
        t.join(10)


def test_bad_key_files_and_flags_are_clear_errors(tmp_path, keys):
    with pytest.raises(gradbus.SecurityError, match="holds no secret key"):
        security.Curve.from_files(keys.path("client"))
    with pytest.raises(gradbus.SecurityError, match="holds a secret key"):
        security.Curve.from_files(keys.path("client", True), keys.path("broker", True))
    with pytest.raises(gradbus.SecurityError, match="cannot read"):
        security.Curve.from_files(tmp_path / "nope.key_secret")
    text = pathlib.Path(keys.path("client", True)).read_text()
    other = security.load_secret(keys.path("shard", True))[1].decode()
    mixed = tmp_path / "mixed.key_secret"
    mixed.write_text(re.sub(r'secret-key = ".*"', f'secret-key = "{other}"', text))
    with pytest.raises(gradbus.SecurityError, match="not the one of its secret key"):
        security.Curve.from_files(mixed)
    mixed.write_text(re.sub(r'secret-key = ".*"', 'secret-key = "short"', text))
    with pytest.raises(gradbus.SecurityError, match="40 characters of Z85"):
        security.Curve.from_files(mixed)
    runner = CliRunner()
    r = runner.invoke(main, ["broker", "--curve-secret", keys.path("broker", True)])
    assert r.exit_code == 2 and "--curve-secret needs --curve-allow DIR" in r.output
    r = runner.invoke(main, ["shard", "--curve-server-key", keys.path("broker")])
    assert r.exit_code == 2 and "--curve-server-key needs --curve-secret" in r.output
    r = runner.invoke(main, ["status", "--curve-secret", keys.path("client"),
                             "--curve-server-key", keys.path("broker")])
    assert r.exit_code == 2 and "holds no secret key" in r.output
    with pytest.raises(gradbus.SecurityError, match="allow directory"):
        BrokerServer("127.0.0.1", 0, curve=security.Curve.from_files(keys.path("broker", True)))
    assert keys.client().secret.decode() not in repr(keys.client())


# -- who gets in --------------------------------------------------------------------------------

@pytest.fixture
def curve_cluster(make_cluster, keys):
    return make_cluster(2, curve_dir=keys.directory)


def test_allowed_client_init_push_pull_and_ops_commands(curve_cluster, tmp_path):
    c = curve_cluster
    with gradbus.connect(c.url, curve=c.curve) as cl:
        cl.init({"w": np.zeros(8, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
        for _ in range(3):
            cl.push({"w": np.ones(8, np.float32)}).result(10)
        np.testing.assert_array_equal(cl.pull(min_version=3)["w"], np.full(8, -1.5, np.float32))
    # an ops command with the [security] settings of a config file ...
    cfg = tmp_path / "gradbus.toml"
    cfg.write_text(f"[client]\nbroker = '{c.url}'\n[security]\n"
                   f"curve_secret = '{c.keys.path('client', True)}'\n"
                   f"curve_server_key = '{c.keys.path('broker')}'\n")
    r = CliRunner().invoke(main, ["status", "--config", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    assert st["counters"]["pushes_applied"] == 3 and len(st["shards"]) == 2
    # ... and with flags; without keys it is refused with a clear message
    r = CliRunner().invoke(main, ["partitions", "--broker", c.url, "--json",
                                  "--curve-secret", c.keys.path("client", True),
                                  "--curve-server-key", c.keys.path("broker")])
    assert r.exit_code == 0, r.output
    for cmd in (["status"], ["partitions"], ["checkpoint"]):
        r = CliRunner().invoke(main, [*cmd, "--broker", c.url, "--timeout", "10"])
        assert r.exit_code != 0 and "requires CURVE" in r.output, (cmd, r.output)
    with pytest.raises(gradbus.SecurityError, match="requires CURVE"):
        admin.status(c.url, 10)


def test_client_without_an_allowed_key_cannot_connect_push_or_pull(curve_cluster, tmp_path,
                                                                    monkeypatch):
    c = curve_cluster
    with gradbus.connect(c.url, curve=c.curve) as cl:
        cl.init({"w": np.zeros(8, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        cl.push({"w": np.ones(8, np.float32)}).result(10)
    rogue = security.Curve.from_files(_rogue(tmp_path), c.keys.path("broker"))

    # At once, not at the end of the timeout: with a timeout far longer than the detector's
    # deadline, only an immediate refusal ends the call in time.
    outcome: list = []

    def refused():
        try:
            gradbus.connect(c.url, curve=rogue, timeout=3600).close()
        except Exception as e:           # handed to the test's thread
            outcome.append(e)
        else:
            outcome.append(None)
    t = threading.Thread(target=refused, daemon=True)
    t.start()
    wait_for(lambda: outcome, 60, "the refused connect to return")
    t.join(10)
    with pytest.raises(gradbus.SecurityError, match="refused this process's CURVE key"):
        raise outcome[0] or AssertionError("a refused key connected")
    with pytest.raises(gradbus.SecurityError, match="requires CURVE"):
        gradbus.connect(c.url, curve=False, timeout=20)
    wrong_server = security.Curve.from_files(c.keys.path("client", True), c.keys.path("shard"))
    with pytest.raises(gradbus.SecurityError, match="is the server key"):
        gradbus.connect(c.url, curve=wrong_server, timeout=20)

    # Past discovery (WELCOME handed over as if HELLO had worked, as for a client whose key
    # is revoked before it reconnects), the refused key's DEALER and SUB still get nowhere:
    # a push and a pull both fail with the refusal.
    welcome = net.hello(zmq.Context.instance(), c.url, "client", 10, curve=c.curve)
    with monkeypatch.context() as m:
        m.setattr(client_mod.net, "hello_any", lambda *a, **k: (0, welcome))
        bad = gradbus.connect(c.url, curve=rogue, timeout=10)
    with bad:
        with pytest.raises(gradbus.SecurityError, match="refused"):
            bad.push({"w": np.ones(8, np.float32)})
        with pytest.raises(gradbus.SecurityError, match="refused"):
            bad.pull(["w"])
        assert bad.stats["updates_received"] == 0

    st = wait_for(lambda: (lambda s: s if s["errors"].get("curve_denied", 0) >= 2 and
                           s["errors"].get("curve_handshake_failed", 0) >= 1 else None)(
        admin.status(c.url, 10, curve=c.curve)), 10, "refusals counted")
    assert st["counters"]["pushes_received"] == 1       # only the allowed client's push
    assert st["tensors"][0]["version"] == 1
    assert all(w["pushes"] == 1 for w in st["workers"])


def test_subscribers_without_the_right_keys_get_no_weights(make_cluster, keys, tmp_path):
    c = make_cluster(1, processes=False, curve_dir=keys.directory)   # ZAP thread in-process
    events = net.hello(zmq.Context.instance(), c.url, "client", 10, curve=c.curve)["events"]
    rogue = security.Curve.from_files(_rogue(tmp_path), keys.path("broker"))
    wrong_server = security.Curve.from_files(keys.path("client", True), keys.path("shard"))
    ctx = zmq.Context()
    subs, mons = {}, {}
    try:
        for name, curve in (("plain", None), ("rogue", rogue), ("wrong_server", wrong_server),
                            ("allowed", c.curve)):
            s = subs[name] = ctx.socket(zmq.SUB)
            s.linger = 0
            if curve is not None:
                security.client_setup(s, curve)
            if name != "allowed":
                mons[name] = s.get_monitor_socket(FAILED)
            s.subscribe(b"")
            s.connect(net.url("127.0.0.1", events))
        assert _failed_handshake(mons["rogue"]) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        _failed_handshake(mons["plain"])
        _failed_handshake(mons["wrong_server"])

        updates = []

        def allowed_sees_updates():
            cl.push({"w": np.ones(64, np.float32)}).result(10)
            while subs["allowed"].poll(0):
                frames = subs["allowed"].recv_multipart()
                if frames[0][:1] == wire.topic_partition(0)[:1]:   # an UPDATE, any partition
                    updates.append(frames)
            return len(updates) >= 3
        with gradbus.connect(c.url, curve=c.curve) as cl:
            cl.init({"w": np.zeros(64, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            wait_for(allowed_sees_updates, 20, "weight updates on the allowed subscriber")
        for name in ("plain", "rogue", "wrong_server"):
            assert not subs[name].poll(0), name          # not one message, not a heartbeat
    finally:
        for name, s in subs.items():
            if name in mons:
                s.disable_monitor()
                mons[name].close(linger=0)
            s.close(linger=0)
        ctx.term()


def _shard(url: str, shard_id: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradbus", "shard", "--broker", url,
                           "--id", shard_id, *args], capture_output=True, text=True, timeout=60)


def test_shard_without_an_allowed_key_cannot_register(curve_cluster, tmp_path):
    c = curve_cluster
    r = _shard(c.url, "rogue", "--curve-secret", _rogue(tmp_path),
               "--curve-server-key", c.keys.path("broker"))
    assert r.returncode != 0 and "refused this process's CURVE key" in r.stderr, r.stderr
    r = _shard(c.url, "plain")
    assert r.returncode != 0 and "requires CURVE" in r.stderr, r.stderr
    st = admin.status(c.url, 10, curve=c.curve)
    assert sorted(s["id"] for s in st["shards"]) == ["shard-0", "shard-1"]


def test_up_with_curve(tmp_path):
    d = tmp_path / "keys"
    with gradbus_up("--shards", 1, "--port", 0, "--curve", d) as (proc, url):
        assert url.startswith("tcp://127.0.0.1:"), url
        hint = proc.stdout.readline().strip()
        assert hint == (f"curve: clients use --curve-secret {d / 'client.key_secret'} "
                        f"--curve-server-key {d / 'broker.key'}"), hint
        for name in ("broker", "shard", "client"):
            assert stat.S_IMODE(os.stat(d / f"{name}.key_secret").st_mode) == 0o600
        assert sorted(os.listdir(d / "allowed")) == ["client.key", "shard.key"]
        curve = gradbus.Curve.from_files(d / "client.key_secret", d / "broker.key")
        with gradbus.connect(url, curve=curve) as cl:
            cl.init({"w": np.zeros(4, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            cl.push({"w": np.ones(4, np.float32)}).result(10)
        with pytest.raises(gradbus.SecurityError):
            gradbus.connect(url, curve=False, timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_sdk_reads_keys_from_the_environment(make_cluster, keys, monkeypatch):
    c = make_cluster(1, processes=False, curve_dir=keys.directory)
    monkeypatch.setenv(security.ENV_SECRET, c.keys.path("client", True))
    with pytest.raises(gradbus.SecurityError, match="set both"):
        gradbus.connect(c.url)
    monkeypatch.setenv(security.ENV_SERVER_KEY, c.keys.path("broker"))
    with gradbus.connect(c.url) as cl:
        assert cl.curve.public == c.curve.public
        assert cl.status()["partitions"] == 256


# -- encryption on the wire ----------------------------------------------------------------------

class Relay:
    """A TCP relay between clients and ``port`` that records every byte it forwards."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gradbus-test-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        peer: dict[socket.socket, socket.socket] = {}
        try:
            while not self.stopping.is_set():
                for key, _ in sel.select(0.05):
                    s = key.fileobj
                    if s is self.listener:
                        a, _ = s.accept()
                        b = socket.create_connection(("127.0.0.1", self.target))
                        peer[a], peer[b] = b, a
                        sel.register(a, selectors.EVENT_READ)
                        sel.register(b, selectors.EVENT_READ)
                        continue
                    if s not in peer:  # closed earlier in this batch with its peer
                        continue
                    try:
                        data = s.recv(1 << 16)
                    except OSError:
                        data = b""
                    if data:
                        self.seen += data
                        try:
                            peer[s].sendall(data)
                            continue
                        except OSError:
                            pass
                    for x in (s, peer.pop(s)):
                        peer.pop(x, None)
                        sel.unregister(x)
                        x.close()
        finally:
            for x in list(peer):
                x.close()
            sel.close()
            self.listener.close()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)


@pytest.mark.parametrize("curve_on", [True, False], ids=["curve", "plain"])
def test_traffic_on_the_wire_is_encrypted(make_cluster, keys, curve_on, monkeypatch):
    # the bytes in question cross TCP: frames (on one host they would go through shared memory)
    monkeypatch.setenv("GRADBUS_SHM", "0")
    c = make_cluster(1, processes=False, curve_dir=keys.directory if curve_on else None)
    relay = Relay(net.split_url(c.url)[1])
    grad = np.tile(np.array([1234.5678, -8765.4321, 3.14159e7, 2.71828e-7], np.float32), 1024)
    pattern = grad[:8].tobytes()
    try:
        with gradbus.connect(f"tcp://127.0.0.1:{relay.port}",
                             curve=c.curve if curve_on else False) as cl:
            cl.init({"g": np.zeros(grad.size, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            for _ in range(3):
                cl.push({"g": grad}).result(10)
            np.testing.assert_array_equal(cl.pull(min_version=3)["g"], -3 * grad)
    finally:
        relay.close()
    assert len(relay.seen) > 3 * grad.nbytes
    assert (pattern in relay.seen) is not curve_on
