"""The test harness's own leak checks can fail: a socket, a context or a descriptor left open
after a snapshot is named, and nothing is once it is closed."""
from __future__ import annotations

import os

import zmq

from tests import conftest, leaks


def test_open_socket_and_context_are_named():
    before_ctx = set(conftest._made["contexts"].keys())
    before_sock = set(conftest._made["sockets"].keys())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        found = conftest._open_zmq(before_ctx, before_sock)
        assert len(found) == 2
        assert found[0].startswith(f"socket {zmq.DEALER} made at test_harness.py:")
        assert found[1].startswith("context made at test_harness.py:")
    finally:
        sock.close(linger=0)
        ctx.term()
    assert conftest._open_zmq(before_ctx, before_sock) == []


def test_open_descriptor_is_seen(tmp_path):
    before = leaks.fds()
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    try:
        assert leaks.fds()[fd] == str(tmp_path / "f")
        assert fd not in before or before[fd] != str(tmp_path / "f")
    finally:
        os.close(fd)
    assert fd not in leaks.fds() or leaks.fds()[fd] != str(tmp_path / "f")
