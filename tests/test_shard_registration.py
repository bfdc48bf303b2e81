"""The shard's registration and liveness state machine, driven without sockets on a fake clock."""
from __future__ import annotations

from gradbus.codecs import wire
from gradbus.codecs.errors import Code
from gradbus.shards.registration import Connect, Heartbeat, Phase, Register, Registration

HB, LIVE = 1.0, 3          # a peer is gone after 3 s of silence
NOT_REGISTERED = Code.NOT_REGISTERED.value


def _joined(now=0.0) -> Registration:
    reg = Registration(HB, LIVE)
    assert reg.start() == [Connect()]
    assert reg.connected(now) == [Register(rejoin=False)]
    assert reg.heard(now, wire.REGISTERED) == []
    return reg


def test_first_connect_registers_then_registered():
    reg = Registration(HB, LIVE)
    assert reg.phase is Phase.DISCONNECTED and not reg.registered
    assert reg.start() == [Connect(silent_for=None)]
    assert reg.connected(10.0) == [Register(rejoin=False)]
    assert reg.phase is Phase.REGISTERING and reg.registered_at == 10.0
    assert reg.tick(10.5) == []                      # nothing due yet
    assert reg.heard(10.5, wire.REGISTERED) == []
    assert reg.registered and reg.joined


def test_heartbeat_every_interval_busy_or_not():
    reg = _joined()
    assert reg.tick(0.9) == []
    assert reg.tick(1.0) == [Heartbeat()]
    reg.sent(1.5)                                    # a reply: the heartbeat is still due
    reg.heard(1.5, wire.BATCH)
    assert reg.tick(1.9) == []
    assert reg.tick(2.0) == [Heartbeat()]
    assert reg.tick(2.5) == []


def test_quiet_when_nothing_was_sent_for_an_interval():
    reg = _joined()
    assert not reg.quiet(0.5)
    assert reg.quiet(1.0)
    reg.sent(1.0)
    assert not reg.quiet(1.9) and reg.quiet(2.0)


def test_silent_broker_means_a_new_connection_and_a_rejoin():
    reg = _joined()                                  # last heard at 0
    for t in (1.0, 2.0, 3.0):
        assert reg.tick(t) == [Heartbeat()]          # a heartbeat even to a silent broker
    assert reg.registered                            # silent for exactly the window: not yet
    assert reg.tick(3.5) == [Connect(silent_for=3.5)]
    assert reg.phase is Phase.DISCONNECTED and not reg.registered
    # after the new HELLO, REGISTER says this process was part of a cluster before
    assert reg.connected(3.75) == [Register(rejoin=True)]
    assert reg.registered_at == 3.75
    assert reg.tick(6.5) == [Heartbeat()]            # the silence counts from the connect
    assert reg.tick(7.0) == [Connect(silent_for=3.25)]
    assert reg.connected(7.25) == [Register(rejoin=True)]
    assert reg.heard(7.5, wire.REGISTERED) == [] and reg.registered


def test_heartbeat_and_reconnect_due_together_come_in_that_order():
    reg = _joined()
    reg.heard(0.5, wire.HEARTBEAT)
    assert reg.tick(4.0) == [Heartbeat(), Connect(silent_for=3.5)]


def test_not_registered_registers_again_once_per_window():
    reg = _joined(now=0.0)
    # declared dead while alive: each message sent meanwhile gets NOT_REGISTERED
    assert reg.heard(5.0, wire.ERROR, NOT_REGISTERED) == [Register(rejoin=True)]
    assert reg.phase is Phase.REGISTERING and not reg.registered
    assert reg.registered_at == 5.0
    assert reg.heard(5.1, wire.ERROR, NOT_REGISTERED) == []
    assert reg.heard(8.0, wire.ERROR, NOT_REGISTERED) == []      # 3 s: not past the window
    assert reg.heard(8.5, wire.ERROR, NOT_REGISTERED) == [Register(rejoin=True)]
    assert reg.registered_at == 8.5
    assert reg.heard(8.6, wire.REGISTERED) == [] and reg.registered


def test_not_registered_soon_after_the_first_register_waits_for_the_window():
    reg = Registration(HB, LIVE)
    reg.start()
    assert reg.connected(0.0) == [Register(rejoin=False)]
    assert reg.heard(0.1, wire.ERROR, NOT_REGISTERED) == []
    assert reg.heard(3.1, wire.ERROR, NOT_REGISTERED) == [Register(rejoin=False)]


def test_other_errors_and_unparsed_messages_are_signs_of_life_only():
    reg = _joined()
    assert reg.heard(2.0, wire.ERROR, Code.BAD_FIELD.value) == []
    assert reg.heard(2.5, None) == []
    assert reg.registered
    assert reg.tick(5.5) == [Heartbeat()]            # heard 3 s ago: not past the window
    assert reg.tick(6.0) == [Connect(silent_for=3.5)]


def test_actions_are_frozen_values():
    assert Register(rejoin=True) == Register(True) != Register(False)
    assert Connect() != Connect(silent_for=1.0)
    try:
        Register(True).rejoin = False
    except AttributeError:
        pass
    else:
        raise AssertionError("actions must be frozen")
