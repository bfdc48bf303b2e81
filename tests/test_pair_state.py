"""A broker pair's decisions without sockets: the roles (broker/pair.py), a shard's
registration moving between brokers and refusing a deposed one (shards/registration.py), and
the URL lists (protocol section 23)."""
from __future__ import annotations

import pytest

import gradbus
from gradbus.broker.pair import ACTIVE, STANDBY, Deposed, Pair
from gradbus.codecs import net, wire
from gradbus.codecs.errors import Code, GradbusError
from gradbus.shards.registration import Connect, Fence, Phase, Register, Registration

W = 1.0      # the liveness window (0.25 s x 4)


def pair(run=1, now=0.0, **kw) -> Pair:
    return Pair(run, now=now, heartbeat_interval=0.25, liveness=4, **kw)


def test_a_standby_takes_over_when_a_shard_comes_and_its_peer_is_silent():
    p = pair()
    p.link(True)
    p.peer(0.0, ACTIVE, 3, 7)
    assert p.claim(0.5) is None and p.role == STANDBY and p.refused == 1   # peer alive
    assert p.claim(0.5 + W + 0.01) == 4          # silent past liveness: epoch above the peer's
    assert p.role == ACTIVE and p.takeovers == 1
    assert p.claim(5.0) == 4                     # active: the next shards are simply taken


def test_a_closed_pair_link_counts_the_peer_gone_at_once():
    p = pair()
    p.peer(0.0, ACTIVE, 1, 7)
    assert p.claim(0.1) is None
    p.link(False)                                # its process went away
    assert p.claim(0.1) == 2


def test_the_new_epoch_is_above_every_epoch_known_a_shards_included():
    p = pair()
    assert p.claim(0.0, seen=9) == 10            # no peer ever heard; a shard saw 9


def test_two_standbys_starting_together_give_the_shards_to_the_higher_epoch_and_run():
    low, high = pair(run=1), pair(run=2)
    for a, b in ((low, high), (high, low)):
        a.link(True)
        a.peer(0.0, STANDBY, b.epoch, b.run)
    assert low.claim(0.1) is None                # sends the shard on
    assert high.claim(0.1) == 1
    assert low.peer(0.2, ACTIVE, 1, 2) is None and low.role == STANDBY and low.epoch == 1


def test_an_active_broker_hearing_a_newer_active_peer_is_deposed():
    p = pair(run=5)
    p.claim(0.0)                                 # active, epoch 1
    assert p.peer(1.0, ACTIVE, 1, 4) is None     # same epoch, lower run: it stays
    d = p.peer(1.0, ACTIVE, 2, 4)
    assert d == Deposed(2) and p.role == STANDBY and p.epoch == 2
    assert p.claim(1.0) is None                  # its peer is alive and active


def test_a_fenced_or_a_register_naming_a_newer_epoch_deposes_an_active_broker():
    p = pair()
    p.claim(0.0)
    assert p.fenced(1) is None and p.active      # not newer
    assert p.fenced(3) == Deposed(3) and not p.active
    q = pair()
    q.claim(0.0)
    assert q.claim(0.1, seen=2) is None and q.deposed == Deposed(2) and not q.active


def test_status_says_the_roles_epoch_and_takeovers():
    p = pair()
    p.link(True)
    p.peer(0.0, STANDBY, 0, 0)
    p.claim(0.1)
    st = p.status(0.2)
    assert st == {"role": ACTIVE, "epoch": 1, "takeovers": 1,
                  "peer": {"role": STANDBY, "epoch": 0}}
    assert p.status(5.0)["peer"]["role"] == "silent"
    assert p.beat() == {"role": ACTIVE, "epoch": 1, "run": 1}


def test_every_broker_exports_whether_it_is_active_and_hears_its_peer():
    from gradbus.broker import status
    from gradbus.broker.core import BrokerCore

    def gauges(core, now):
        m = status.metrics(core, now)
        return (m["gradbus_broker_pair_active"][2][()],
                m["gradbus_broker_pair_peer_unheard"][2][()], "gradbus_broker_pair_epoch" in m)
    core = BrokerCore(now=0.0)
    assert gauges(core, 0.0) == (1, 0, False)            # a lone broker: active, no peer
    p = pair()
    core.pair_status = p.status
    assert gauges(core, 0.0) == (0, 1, True)             # a standby that never heard its peer
    p.link(True)
    p.peer(0.0, STANDBY, 0, 0)
    p.claim(0.1)
    assert gauges(core, 0.2) == (1, 0, True)             # active, its standby heard
    assert gauges(core, 5.0) == (1, 1, True)             # active, its peer silent
    m = status.metrics(core, 5.0)
    assert m["gradbus_broker_pair_quorum"][2][()] == 0   # no "quorum" said: not acting
    core.pair_status = lambda now: {**p.status(now), "quorum": True}
    assert status.metrics(core, 5.0)["gradbus_broker_pair_quorum"][2][()] == 1


# ------------------------------------------------------------------ a shard's registration
def registered(reg: Registration, now: float, bepoch: int) -> list:
    reg.connected(now)
    return reg.heard(now, wire.REGISTERED, None, bepoch)


def test_a_shard_told_not_active_goes_to_the_other_broker_once():
    reg = Registration(0.25, 4)
    reg.start()
    assert reg.connected(0.0) == [Register(rejoin=False)]
    out = reg.heard(0.1, wire.ERROR, Code.NOT_ACTIVE.value)
    assert len(out) == 1 and type(out[0]) is Connect and out[0].next
    assert reg.phase is Phase.DISCONNECTED
    assert reg.heard(0.1, wire.ERROR, Code.NOT_ACTIVE.value) == []   # already leaving


def test_a_shard_records_the_broker_epoch_and_fences_a_lower_one():
    reg = Registration(0.25, 4)
    reg.start()
    assert registered(reg, 0.0, 2) == [] and reg.registered and reg.bepoch == 2
    assert registered(reg, 1.0, 3) == [] and reg.bepoch == 3      # a take-over: newer
    out = registered(reg, 2.0, 2)                                  # a deposed broker
    assert out[0] == Fence(3) and type(out[1]) is Connect and out[1].next
    assert not reg.registered and reg.bepoch == 3
    assert registered(reg, 3.0, 0) and not reg.registered          # not a pair's at all


def test_broker_url_lists_are_checked():
    assert net.broker_urls("tcp://a:1") == ["tcp://a:1"]
    assert net.broker_urls("tcp://a:1, tcp://b:2") == ["tcp://a:1", "tcp://b:2"]
    for bad in ("", "tcp://a:1,", "tcp://a:1,http://b:2", "tcp://a:1,tcp://a:1"):
        with pytest.raises(GradbusError):
            net.broker_urls(bad)


# ------------------------------------------------------------------ one broker's loop
@pytest.fixture
def lone_pair_broker():
    """A broker of a pair whose peer never answers (its pair address is a free port)."""
    from gradbus.broker.server import BrokerServer
    from gradbus.cluster import free_ports
    peer, mine = free_ports(2)
    srv = BrokerServer("127.0.0.1", 0, shm=False, peer=f"tcp://127.0.0.1:{peer}",
                       peer_port=mine)
    t = srv.start_thread()
    yield srv
    srv.stop()
    t.join(10)


def test_a_lone_standby_answers_not_active_then_a_shard_makes_it_active(lone_pair_broker):
    from gradbus import admin

    from .rigs import backend_peer, unpack, wait_for
    srv = lone_pair_broker
    assert admin.status(srv.url)["pair"]["role"] == STANDBY       # ops may ask a standby
    with pytest.raises(GradbusError) as e:
        gradbus.connect(srv.url, timeout=5)
    assert e.value.code == Code.NOT_ACTIVE
    # named with another broker that does not answer: the error says which was the standby
    from gradbus.cluster import free_ports
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(GradbusError, match="answered as the standby") as e:
        gradbus.connect(f"{dead},{srv.url}", timeout=1)
    assert e.value.code == Code.NOT_ACTIVE and srv.url in str(e.value)
    with backend_peer(srv.url, routing_id=b"S1") as s:
        s.send(wire.pack(wire.HEARTBEAT))         # not a REGISTER: refused, nothing changes
        assert s.poll(10_000) and unpack(s.recv())["code"] == Code.NOT_ACTIVE.value
        s.send(wire.pack(wire.REGISTER, shard="s0", holds=[], bepoch=6))
        assert s.poll(10_000)
        got = unpack(s.recv())
        assert got["kind"] == wire.REGISTERED and got["bepoch"] == 7, got
        assert srv.pair.active and srv.core.broker_epoch == 7
        # a shard that has seen a newer broker epoch fences it: its loop ends, deposed
        s.send(wire.error(Code.FENCED, "seen newer", bepoch=9))
        wait_for(lambda: srv.deposed is not None, 10, "the broker deposed")
    assert srv.deposed.epoch == 9 and not srv.pair.active
    # started again on its pair state (as `gradbus broker` does): a standby, not deposed again
    from gradbus.broker.server import BrokerServer
    again = BrokerServer("127.0.0.1", 0, shm=False, peer=srv.pair_link.peer, peer_port=0,
                         pair=srv.pair)
    try:
        again.gate.tick(again.clock())
        assert again.deposed is None and again.pair.epoch == 9 and not again.pair.active
    finally:
        again.close()



def test_ops_requests_to_a_pair_skip_a_broker_that_is_down_at_once(lone_pair_broker):
    """A refused connection (nothing listens) sends an ops request on to the pair's other
    broker at once, not after its timeout; the status of the pair says which is down."""
    import time

    from gradbus import admin
    from gradbus.cluster import free_ports
    srv = lone_pair_broker
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    t0 = time.monotonic()
    st = admin.status(f"{dead},{srv.url}", timeout=60)
    got = admin.request(f"{dead},{srv.url}", wire.STATUS, timeout=60)
    took = time.monotonic() - t0
    assert got["kind"] == wire.STATUS_REPLY and got["status"]["pair"]["role"] == STANDBY
    assert [b["role"] for b in st["brokers"]] == ["unreachable", STANDBY]
    assert "nothing listens" in st["brokers"][0]["error"], st["brokers"][0]
    assert took < 30, f"waited {took:.1f}s on the broker that is down (timeout 60 s)"
    # one broker named alone: a refused connection is waited on (it may be starting)
    with pytest.raises(admin.Unanswered, match="within 0.5s"):
        admin.status(dead, timeout=0.5)
