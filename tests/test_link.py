"""Local links (codecs/link.py): framing both ways, large messages through partial writes, the
queue's bound, a peer that goes away or sends garbage, and the listener's introductions."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from gradbus.codecs import link

DEADLINE = 30.0


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    la, lb = link.Link(a), link.Link(b)
    yield la, lb
    la.close()
    lb.close()


def _take(lnk, count: int) -> list:
    """``count`` messages from ``lnk``, waiting for its socket to be readable."""
    import select
    got = []
    p = select.poll()
    p.register(lnk.fd, select.POLLIN)
    while len(got) < count:
        m = lnk.recv()
        if m is None:
            assert p.poll(int(DEADLINE * 1000)), "nothing came"
            continue
        got.append([bytes(f) for f in m])
    return got


def test_messages_of_every_frame_kind_arrive_whole_and_in_order(pair):
    a, b = pair
    arr = np.arange(10, dtype=np.float32)
    sent = [[b"header", b""], [memoryview(b"xy"), arr, bytearray(b"z")], [b"one"],
            [b"h"] + [bytes([i]) * i for i in range(40)]]
    for m in sent:
        assert a.send(m)
    got = _take(b, len(sent))
    assert got[0] == [b"header", b""]
    assert got[1] == [b"xy", arr.tobytes(), b"z"]
    assert got[2] == [b"one"]
    assert got[3] == [b"h"] + [bytes([i]) * i for i in range(40)]
    assert b.recv() is None and not b.buffered
    assert b.send([b"back"]) and _take(a, 1) == [[b"back"]]


def test_a_read_that_emptied_the_socket_is_not_followed_by_a_failing_one(pair):
    """After a read that took all the socket had, the next ``recv`` says "nothing yet" without
    a system call (which would fail with EAGAIN); the one after reads again, so a message
    that came meanwhile is not missed, and neither is the peer closing."""
    a, b = pair

    class Counting:                 # the reader's socket, its reads counted
        def __init__(self, sock):
            self.sock, self.reads = sock, 0

        def recv_into(self, buf):
            self.reads += 1
            return self.sock.recv_into(buf)

        def __getattr__(self, name):
            return getattr(self.sock, name)

    counting = Counting(b.sock)
    b.sock = counting
    assert a.send([b"one"])
    assert _take(b, 1) == [[b"one"]]
    reads = counting.reads
    assert reads >= 1
    assert b.recv() is None and counting.reads == reads          # no failing read
    assert a.send([b"two"]) and a.send([b"three"])
    assert _take(b, 2) == [[b"two"], [b"three"]]
    a.sock.close()
    with pytest.raises(link.LinkClosed):
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            b.recv()


def _framed(frames: list) -> bytes:
    """A message as a link writes it (the module's framing, written out here independently)."""
    return (struct.pack(f"<I{len(frames)}Q", len(frames), *map(len, frames))
            + b"".join(frames))


def _poll_take(lnk) -> list:
    """Every whole message ``lnk`` has now (reading until the socket is empty)."""
    got = []
    for _ in range(3):               # a read that emptied the socket skips the next read
        while (m := lnk.recv()) is not None:
            got.append([bytes(f) for f in m])
    return got


def test_messages_cut_anywhere_arrive_whole_and_in_order(pair):
    """Messages written in pieces of every size, cut inside the framing and inside the frames,
    several in one read and the last one partly: each arrives whole, once, in order."""
    a, b = pair
    msgs = [[b"head-%d" % i, bytes([i]) * (i * 37 % 300), b""] for i in range(40)]
    wire_bytes = b"".join(_framed(m) for m in msgs)
    got, pos, cut = [], 0, 1
    while pos < len(wire_bytes):
        a.sock.sendall(wire_bytes[pos:pos + cut])
        pos += cut
        cut = cut % 97 + 1 if cut < 97 else 1000    # 1, 2, ... 97 bytes, then larger pieces
        got += _poll_take(b)
    got += _poll_take(b)
    assert got == msgs
    assert not b.rbuf and not b.buffered


def test_links_read_by_one_thread_keep_their_partial_messages_apart():
    """One thread reads both links through the same read buffer: what each has of a message
    not yet whole stays its own."""
    ends = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    readers = [link.Link(r) for _, r in ends]
    try:
        one, two = _framed([b"one", b"x" * 500]), _framed([b"two", b"y" * 700])
        ends[0][0].sendall(one[:300])
        ends[1][0].sendall(two[:11])
        assert _poll_take(readers[0]) == [] and _poll_take(readers[1]) == []
        ends[1][0].sendall(two[11:] + two)
        ends[0][0].sendall(one[300:])
        assert _poll_take(readers[1]) == [[b"two", b"y" * 700]] * 2
        assert _poll_take(readers[0]) == [[b"one", b"x" * 500]]
    finally:
        for lnk in readers:
            lnk.close()
        for w, _ in ends:
            w.close()


def test_garbage_after_a_partial_message_closes_the_link(pair):
    a, b = pair
    whole = _framed([b"fine"])
    a.sock.sendall(whole + whole[:3])
    assert _poll_take(b) == [[b"fine"]]
    assert len(b.rbuf) == 3                  # the next message's start, kept
    a.sock.sendall(whole[3:] + struct.pack("<I", link.MAX_FRAMES + 1) + bytes(64))
    got = []
    with pytest.raises(link.LinkClosed):
        for _ in range(100):
            m = b.recv()
            if m is not None:
                got.append([bytes(f) for f in m])
    assert got == [[b"fine"]]
    assert "frames" in b.bad and not b.rbuf


def test_a_large_message_goes_out_in_pieces_while_the_reader_reads():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    la, lb = link.Link(a, limit=1 << 30), link.Link(b)
    big = np.random.default_rng(0).integers(0, 255, 24 << 20, dtype=np.uint8)
    try:
        assert la.send([b"head", big, b"tail"])
        assert la.pending > 0             # more than the socket's buffer: queued
        assert la.send([b"after"])        # queued behind it, in order
        done = threading.Event()

        def writer():
            import select
            p = select.poll()
            p.register(la.fd, select.POLLOUT)
            while not la.flush():
                p.poll(1000)
            done.set()

        t = threading.Thread(target=writer)
        t.start()
        got = _take(lb, 2)
        t.join(DEADLINE)
        assert done.is_set()
        assert got[0][0] == b"head" and got[0][2] == b"tail"
        assert np.array_equal(np.frombuffer(got[0][1], np.uint8), big)
        assert got[1] == [b"after"]
    finally:
        la.close()
        lb.close()


def test_a_full_queue_refuses_whole_messages():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    la, lb = link.Link(a, limit=4 << 20), link.Link(b)
    try:
        chunk = bytes(1 << 20)
        sent = 0
        while la.send([b"m", chunk]):      # nobody reads: the socket's buffer, then the queue
            sent += 1
            assert sent < 64, "the queue never filled"
        assert la.refused == 1
        got = 0                            # every message it took arrives whole, no more
        for _ in range(10_000):
            la.flush()
            m = lb.recv()
            if m is not None:
                assert [bytes(f) for f in m] == [b"m", chunk]
                got += 1
            elif got == sent and not la.pending:
                break
        assert got == sent and lb.recv() is None
    finally:
        la.close()
        lb.close()


def test_the_peer_going_away_is_seen_after_what_it_sent(pair):
    a, b = pair
    assert a.send([b"last"])
    a.close()
    assert _take(b, 1) == [[b"last"]]
    with pytest.raises(link.LinkClosed):
        for _ in range(100):
            assert b.recv() is None
    assert not b.send([b"to nobody"])


def test_garbage_closes_the_link(pair):
    a, b = pair
    a.sock.send(struct.pack("<I", link.MAX_FRAMES + 1) + bytes(64))
    with pytest.raises(link.LinkClosed):
        for _ in range(100):
            b.recv()
    assert "frames" in b.bad


def test_listener_accepts_its_user_and_reads_the_introduction():
    listener, name = link.listen("0badcafe")
    try:
        assert link.connect(name + "-nobody", b"client", b"x") is None
        c = link.connect(name, b"client", b"client-id")
        assert c is not None
        s = None
        for _ in range(100):
            s = link.accept(listener)
            if s is not None:
                break
        assert s is not None
        (first,) = _take(s, 1)
        assert link.introduction(first) == (b"client", b"client-id")
        assert link.introduction([link.MAGIC, b"worker", b"x"]) is None
        assert link.introduction([b"hello", b"client", b"x"]) is None
        assert link.introduction([link.MAGIC, b"shard", b""]) is None
        assert link.accept(listener) is None          # nothing else waits
        c.close()
        s.close()
    finally:
        listener.close()
    assert link.connect("bad\0name", b"client", b"x") is None
    assert os.getuid() >= 0


def test_a_link_socket_takes_whole_messages_and_says_none_when_there_is_none(pair):
    a, b = pair
    sock = link.LinkSocket(b)
    assert sock.take() is None
    a.send([b"head", b"body"])
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        sock.poll(100)
        got = sock.take()
    assert [bytes(f) for f in got] == [b"head", b"body"]
    assert sock.take() is None and not sock.lost
    a.sock.close()                      # the peer goes away: lost, for good
    while not sock.lost and time.monotonic() < deadline:
        sock.poll(100)
        assert sock.take() is None
    assert sock.lost and sock.take() is None
    import zmq
    with pytest.raises(zmq.Again):
        sock.recv_multipart()
