"""The broker's answer to "does some subscriber follow this topic?" (ZeroMQ's prefix match),
kept between subscription notices, must change as soon as a notice comes."""
from types import SimpleNamespace

import pytest

from gradbus.broker import shm_io
from gradbus.broker.shm_io import ShmIO


@pytest.fixture
def io():
    core = SimpleNamespace(meters=SimpleNamespace(counters={}))
    return ShmIO(core, "tcp://127.0.0.1:1", enabled=False)


def test_a_topic_is_followed_exactly_while_a_prefix_of_it_is_subscribed(io):
    assert not io._followed(b"p12")
    io.subscription(b"\x01p1")                 # a prefix of p12 and of p1, not of r12
    assert io._followed(b"p12") and io._followed(b"p1")
    assert not io._followed(b"r12") and not io._followed(b"p")
    io.subscription(b"\x01")                   # the empty topic: everything
    assert io._followed(b"r12") and io._followed(b"p")
    io.subscription(b"\x00")
    assert not io._followed(b"r12") and io._followed(b"p12")
    io.subscription(b"\x00p1")
    assert not io._followed(b"p12") and not io._followed(b"p1")


def test_the_answers_kept_are_bounded(io, monkeypatch):
    monkeypatch.setattr(shm_io, "MATCHES_KEPT", 8)
    io.subscription(b"\x01p")
    for i in range(100):
        assert io._followed(b"p%d" % i) and not io._followed(b"r%d" % i)
        assert len(io._matches) <= 8
