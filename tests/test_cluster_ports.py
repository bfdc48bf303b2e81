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


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(cluster_mod, "_ephemeral_low", lambda: cluster_mod.PINNED_LOW + 10)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


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


def test_a_broker_drawn_ports_are_pinned_and_it_comes_back_on_them(listener, monkeypatch):
    """Ports left to the cluster are drawn before the broker starts (one taken meanwhile: drawn
    again), and a killed broker is started again on the same three."""
    real, draws = cluster_mod.free_ports, []

    def once_taken(n, host="127.0.0.1"):
        ports = real(n, host)
        if not draws:
            ports[2] = listener           # the events port
        draws.append(ports)
        return ports

    monkeypatch.setattr(cluster_mod, "free_ports", once_taken)
    c = LocalCluster(1, quiet=True)
    try:
        c.start()
        assert len(draws) == 2
        pinned = [c.port, c.backend_port, c.events_port]
        assert pinned == draws[1] and listener not in pinned
        low = cluster_mod._ephemeral_low()
        assert all(p < low for p in pinned)
        c.broker_proc.kill()
        c.broker_proc.wait(10)
        c.start_broker()
        assert c.url == f"tcp://127.0.0.1:{pinned[0]}"
        assert [c.port, c.backend_port, c.events_port] == pinned
        c.wait_ready(1)
    finally:
        c.stop()
