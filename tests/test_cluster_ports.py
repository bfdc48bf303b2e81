"""The ports a local cluster pins for its brokers: drawn where no connection takes them, and a
pair whose drawn port something else bound starts on others."""
import socket

import pytest

import gradbus.cluster as cluster_mod
from gradbus import admin
from gradbus.cluster import LocalCluster, PortTaken, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = cluster_mod._ephemeral_low()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(cluster_mod.PINNED_LOW <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.fixture
def listener():
    """A port something else listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", free_ports(1)[0]))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_a_broker_asked_for_a_taken_port_says_which(listener):
    c = LocalCluster(1, port=listener, quiet=True)
    with pytest.raises(PortTaken, match=str(listener)):
        c.start()
    assert all(p.poll() is not None for p in c.broker_procs.values())


def test_a_pair_whose_drawn_port_was_taken_starts_on_others(listener, monkeypatch):
    real, draws = cluster_mod.free_ports, []

    def once_taken(n, host="127.0.0.1"):
        ports = real(n, host)
        if not draws:
            ports[5] = listener       # broker-b's backend port: the first broker starts first
        draws.append(ports)
        return ports

    monkeypatch.setattr(cluster_mod, "free_ports", once_taken)
    c = LocalCluster(1, brokers=2, quiet=True)
    try:
        c.start()
        assert len(draws) == 2
        assert listener not in sum(c.pair_ports.values(), [])
        st = admin.status(c.url)
        assert [b["role"] for b in st["brokers"]].count("active") == 1
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.broker_procs.values())
