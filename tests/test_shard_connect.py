"""A shard's connection before it has heard the broker, and its stop in every state.

* Until the broker is heard on a backend connection, the shard's sends honour the hello
  timeout: libzmq drops the pipe of a connection whose handshake failed, and a plain send then
  blocks for ever. The order is forced as in tests/test_curve_timeouts.py (a patched
  ``connect`` returns only once the pipe is gone); each workload runs in a child interpreter
  under a subprocess timeout, the hang detector. A key the broker's backend refuses is a clear
  SecurityError; any other failed connection, or a send that cannot go out by the deadline, is
  a lost connection: the shard says HELLO again.
* SIGTERM stops a shard process promptly while it looks for a broker that is not there, after
  its broker was killed, and while it serves: it exits 0 within a generous wait (the detector).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import zmq

from gradbus.cluster import STOP_GRACE, end_processes, free_ports
from gradbus.codecs import security, wire
from gradbus.shards.registration import Connect, Phase, Registration

from .child import in_child
from .rigs import wait_for

TIMEOUT = 2.0       # the shards' hello timeout in the child workloads
HANG = 120          # a child still running after this many seconds hangs
STOP_WAIT = 4 * STOP_GRACE   # a shard still running this long after SIGTERM ignored it
#: a ZMTP 3.0 greeting (NULL mechanism) followed by a command NULL does not expect: libzmq
#: fails the handshake with a protocol error and drops the pipe (not a mechanism mismatch)
BAD_HANDSHAKE = (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
                 + b"\0" + bytes(31) + b"\x04\x06\x05HELLO")


def _in_child(workload: str, *args) -> str:
    return in_child("tests.test_shard_connect", workload, *args, timeout=HANG)


def _force_dropped_pipe(targets: set) -> list:
    """A ``connect`` to an address in ``targets`` returns only once libzmq dropped the pipe
    (tests/rigs.py's drop_pipe_after_connect, limited to those addresses); the list of
    connects whose pipe was gone."""
    plain = zmq.Socket.connect
    from .rigs import drop_pipe_after_connect
    dropped = drop_pipe_after_connect()
    forced = zmq.Socket.connect

    def connect(self, addr):
        return (forced if addr in targets else plain)(self, addr)
    zmq.Socket.connect = connect
    return dropped


def test_a_lost_connection_means_a_new_one():
    reg = Registration(1.0, 3)
    reg.start()
    reg.connected(10.0)
    assert reg.lost(10.5) == [Connect(silent_for=0.5, lost=True)]
    assert reg.phase is Phase.DISCONNECTED and not reg.registered
    assert len(reg.connected(11.0)) == 1 and reg.phase is Phase.REGISTERING


# -- a backend that refuses the shard's key -------------------------------------------------------

def refused_backend_workload(url: str, secret: str, server_key: str, allowed: str,
                             forced: bool) -> None:
    """The shard's key is allowed for its HELLO, then revoked (removed from the broker's allow
    directory) before it connects to the backend: the shard's run raises SecurityError saying
    the key was refused. Five runs as it comes; ``forced``: the backend's pipe is gone before
    REGISTER is sent, runs until one met that."""
    from gradbus.codecs import net
    from gradbus.codecs.errors import SecurityError
    from gradbus.shards.server import ShardServer
    curve = security.Curve.from_files(secret, server_key)
    key = open(allowed, "rb").read()
    real, dropped = net.hello_any, []

    def hello_any(ctx, urls, first, *a, **k):
        at, welcome = real(ctx, urls, first, *a, **k)
        if os.path.exists(allowed):
            os.remove(allowed)                  # the broker refuses the key from now on
            if forced and not dropped:
                backend = net.url(net.split_url(urls[at])[0], welcome["backend"])
                dropped.extend([backend, _force_dropped_pipe({backend})])
        return at, welcome
    net.hello_any = hello_any
    for i in range(5):
        with open(allowed, "wb") as f:
            f.write(key)
        srv = ShardServer(url, f"s{i}", curve=curve, hello_timeout=TIMEOUT)
        try:
            srv.run()
        except SecurityError as e:
            assert "refused this process's CURVE key" in str(e), str(e)
            if forced:
                assert dropped[0] in str(e) and url not in str(e), str(e)   # the backend
        else:
            raise AssertionError("the shard ran without its key")
        if forced and dropped[1]:
            break                               # a REGISTER met a dropped pipe
    if forced:      # libzmq now and then keeps a failed connection's pipe: up to 5 runs
        assert dropped[1] and set(dropped[1]) == {dropped[0]}, dropped
    print("OK")


@pytest.fixture
def curve_broker(refusing_broker, tmp_path):  # noqa: F811 - the fixture
    """A CURVE broker process (tests/test_curve_timeouts.py's) that admits the shard's key:
    its public key file copied into the broker's allow directory."""
    url, secret, server_key = refusing_broker
    allowed = tmp_path / "allow" / "shard.key"
    shutil.copyfile(secret[:-len("_secret")], allowed)
    return url, secret, server_key, str(allowed)


@pytest.mark.parametrize("forced", [True, False], ids=["pipe-dropped-first", "as-it-comes"])
def test_a_backend_that_refuses_the_key_is_a_clear_error(curve_broker, forced):
    assert "OK" in _in_child("refused_backend_workload", *curve_broker, forced)


# -- a backend whose handshake fails, or that never takes a send --------------------------------

def lost_backend_workload(hide_failures: bool) -> None:
    """A broker whose HELLO answers name a backend that fails every handshake (its pipe gone
    before REGISTER): the shard goes back to HELLO, again and again, and stops when told.
    ``hide_failures``: the handshake failures go unseen, so only the send's deadline ends
    each try."""
    from gradbus.shards.server import ShardServer

    from .rigs import TcpListener
    if hide_failures:
        security.HandshakeWatch.check = lambda self: None
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.linger = 0
    port = front.bind_to_random_port("tcp://127.0.0.1")
    hellos: list = []
    done = threading.Event()
    with TcpListener(BAD_HANDSHAKE) as backend:
        dropped = _force_dropped_pipe({backend.url})

        def answer():
            while not done.is_set():
                if front.poll(20):
                    ident, msg = front.recv_multipart()
                    hellos.append(wire.unpack_header(msg, frozenset({wire.HELLO})))
                    front.send_multipart([ident, wire.pack(
                        wire.WELCOME, events=1, partitions=1,
                        backend=int(backend.url.rsplit(":", 1)[1]))])
        t = threading.Thread(target=answer, name="test-front")
        t.start()
        srv = ShardServer(f"tcp://127.0.0.1:{port}", "s0", hello_timeout=TIMEOUT)
        run = srv.start_thread()
        try:
            wait_for(lambda: len(hellos) >= 3 and len(dropped) >= 2, 60,
                     "the shard to say HELLO again, twice after a dropped pipe")
        finally:
            srv.stop()
            run.join(30)
            done.set()
            t.join(10)
            front.close()
            ctx.term()
        assert not run.is_alive(), "the shard did not stop"
        assert len(dropped) >= 2 and all(h["role"] == "shard" for h in hellos), (dropped, hellos)
    print("OK")


@pytest.mark.parametrize("hide_failures", [False, True], ids=["handshake-failed", "deadline"])
def test_a_backend_connection_that_fails_makes_the_shard_connect_again(hide_failures):
    assert "OK" in _in_child("lost_backend_workload", hide_failures)


# -- SIGTERM in every state ---------------------------------------------------------------------

class _Proc:
    """A gradbus process whose stderr lines are gathered by a thread."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "gradbus", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, name="test-stderr", daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait_said(self, text: str, timeout: float = 60.0) -> None:
        wait_for(lambda: self.said(text) or self.proc.poll() is not None, timeout, repr(text))
        assert self.said(text), f"exited {self.proc.returncode}: {''.join(self.lines)}"

    def terminated(self) -> int | None:
        """SIGTERM, then its exit status, or None if it still runs after STOP_WAIT seconds."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            return None

    def close(self):
        _end(self.proc)
        self.thread.join(10)
        self.proc.stderr.close()


def _end(proc: subprocess.Popen) -> None:
    """Stop a process as an operator would (SIGTERM: it removes what it made, its shared-memory
    probe included), SIGKILL only if it does not exit."""
    end_processes([proc], 20)


def _shard(url: str) -> _Proc:
    return _Proc("shard", "--broker", url, "--id", "s0", "-v")


def test_sigterm_stops_a_shard_looking_for_a_broker_that_is_not_there():
    shard = _shard(f"tcp://127.0.0.1:{free_ports(1)[0]}")
    try:
        shard.wait_said("asking the broker")
        code = shard.terminated()
        assert code == 0, f"exit {code} after SIGTERM: {''.join(shard.lines)}"
    finally:
        shard.close()


@pytest.mark.parametrize("broker_killed", [True, False], ids=["broker-killed", "serving"])
def test_sigterm_stops_a_shard_whose_broker_was_killed_or_that_serves(broker_killed):
    broker = subprocess.Popen([sys.executable, "-m", "gradbus", "broker", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    shard = None
    try:
        line = broker.stdout.readline().strip()
        assert line.startswith("listening: "), line
        shard = _shard(line.split(" ", 1)[1])
        shard.wait_said("registered with")
        if broker_killed:
            broker.kill()
            shard.wait_said("reconnecting")
            wait_for(lambda: sum("asking the broker" in x for x in shard.lines) >= 2, 60,
                     "the shard to look for its broker again")
        code = shard.terminated()
        assert code == 0, f"exit {code} after SIGTERM: {''.join(shard.lines)}"
    finally:
        if shard is not None:
            shard.close()
        _end(broker)
