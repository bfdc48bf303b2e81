"""A connection whose handshake fails never blocks past the caller's timeout.

When libzmq fails a connection's handshake (a CURVE key the broker refuses, a peer that does
not speak ZMTP), it drops the DEALER's pipe: a plain ``send`` on the socket then blocks for
ever. Right after ``connect`` that is a race (the handshake must fail before the first send),
so these tests also force the order: a patched ``connect`` returns only once the connection's
pipe is gone. A listener that accepts and stays silent does not drop the pipe (the request is
queued and the reply wait times out), so it is no way to reproduce the hang.

Each scenario runs in a child interpreter under a subprocess timeout: the hang detector.
"""
from __future__ import annotations

import time

from gradbus.codecs import security

from .child import in_child
from .rigs import TcpListener, drop_pipe_after_connect, until_dropped

TIMEOUT = 2.0                # the timeout the calls to silent or garbage peers are given
REFUSED_TIMEOUT = 30.0       # ... and the calls a broker refuses: long, so that a broker slow to
                             # refuse on a loaded machine is not read as a timeout
HANG = 120                   # a child still running after this many seconds hangs
REPEATS = 200                # calls per scenario that race the handshake naturally


def _in_child(workload: str, *args) -> str:
    return in_child("tests.test_curve_timeouts", workload, *args, timeout=HANG)


def _expect_error(call, errors, *match: str) -> None:
    """``call()`` raises one of ``errors`` whose text holds one of ``match``."""
    try:
        call()
    except errors as e:
        assert any(m in str(e) for m in match), f"unexpected error: {e}"
        return
    raise AssertionError("the call returned instead of raising")


def refused_workload(url: str, secret: str, server_key: str, forced: bool) -> None:
    """Against a broker that refuses this key: ``net.hello`` (as the SDK and a shard use it)
    and the ops requests behind ``gradbus status`` raise SecurityError; the CLI exits 1 saying
    so. ``forced``: each call until it met the pipe dropped before its first send; else
    REPEATS times as it comes."""
    import zmq
    from click.testing import CliRunner

    from gradbus import admin
    from gradbus.cli import main
    from gradbus.codecs import net
    curve = security.Curve.from_files(secret, server_key)
    ctx = zmq.Context.instance()
    refused = "refused this process's CURVE key"
    calls = [lambda: _expect_error(lambda: admin.status(url, REFUSED_TIMEOUT, curve=curve),
                                   security.SecurityError, refused)]
    calls += [lambda role=role: _expect_error(
        lambda: net.hello(ctx, url, role, REFUSED_TIMEOUT, curve=curve),
        security.SecurityError, refused) for role in ("client", "shard")]

    def cli():
        r = CliRunner().invoke(main, ["status", "--broker", url, "--timeout", str(REFUSED_TIMEOUT),
                                      "--curve-secret", secret, "--curve-server-key",
                                      server_key])
        assert r.exit_code == 1 and refused in r.output, r.output
    calls.append(cli)
    if forced:
        dropped = drop_pipe_after_connect()
        for call in calls:
            until_dropped(call, dropped)
    else:
        for i in range(REPEATS):
            calls[0]()
            calls[1 + i % 2]()
        for _ in range(5):
            cli()
    print("OK")


def garbage_workload(url: str) -> None:
    """Against a listener that answers garbage (libzmq drops the pipe on the protocol error),
    with the pipe dropped before the first send: hello and a status request raise the
    project's timeout errors (or, where libzmq read the garbage as another security
    mechanism, SecurityError)."""
    import zmq

    from gradbus import admin
    from gradbus.codecs import net
    from gradbus.codecs.errors import GradbusError
    dropped = drop_pipe_after_connect()
    ctx = zmq.Context.instance()
    until_dropped(lambda: _expect_error(lambda: admin.status(url, TIMEOUT), GradbusError,
                                        "could not send", "requires CURVE"), dropped)
    until_dropped(lambda: _expect_error(lambda: net.hello(ctx, url, "client", TIMEOUT),
                                        GradbusError, "no broker answered", "requires CURVE"),
                  dropped)
    print("OK")


def silent_workload(url: str) -> None:
    """Against a listener that accepts and says nothing: the pipe stays, the request is
    queued, and the wait for the reply times out."""
    import zmq

    from gradbus import admin
    from gradbus.codecs import net
    from gradbus.codecs.errors import GradbusError
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(url)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            assert s.poll(50, zmq.POLLOUT), "the silent listener's connection lost its pipe"
    finally:
        s.close(linger=0)
    _expect_error(lambda: admin.status(url, TIMEOUT), GradbusError, "no reply")
    _expect_error(lambda: net.hello(ctx, url, "client", TIMEOUT), GradbusError,
                  "no broker answered")
    print("OK")


def test_refused_key_fails_fast_when_the_handshake_fails_before_the_first_send(refusing_broker):
    assert "OK" in _in_child("refused_workload", *refusing_broker, True)


def test_refused_key_never_hangs_over_many_tries(refusing_broker):
    assert "OK" in _in_child("refused_workload", *refusing_broker, False)


def test_a_peer_that_breaks_the_protocol_times_out_instead_of_hanging():
    with TcpListener(b"\xff" * 64) as lst:
        assert "OK" in _in_child("garbage_workload", lst.url)


def test_a_silent_peer_keeps_the_pipe_and_times_out():
    with TcpListener(None) as lst:
        assert "OK" in _in_child("silent_workload", lst.url)
