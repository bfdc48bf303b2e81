"""What a user sees when no broker answers (nothing listens at the URL, or at either address
of a broker pair): the SDK's BrokerUnavailableError (code BROKER_UNAVAILABLE), saying what to
check, from connect, from the ops requests and from ``gradbus status``."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

import gradbus
from gradbus import admin
from gradbus.cli import main
from gradbus.cluster import free_ports
from gradbus.codecs.errors import Code

pytestmark = pytest.mark.timeout(60)


def _dead(n: int) -> list[str]:
    """URLs nothing listens at (ports free a moment ago, not bound by anything here)."""
    return [f"tcp://127.0.0.1:{p}" for p in free_ports(n)]


def test_connect_with_no_broker_raises_broker_unavailable():
    url = _dead(1)[0]
    with pytest.raises(gradbus.BrokerUnavailableError) as got:
        gradbus.connect(url, timeout=1)
    e = got.value
    assert e.code == Code.BROKER_UNAVAILABLE and str(e).startswith("BROKER_UNAVAILABLE: ")
    assert f"no broker answered at {url} within 1.0s" in str(e)
    assert "$GRADBUS_BROKER" in str(e) and "both brokers' addresses" in str(e)


def test_connect_to_a_pair_with_both_brokers_dead_raises_broker_unavailable():
    urls = ",".join(_dead(2))
    with pytest.raises(gradbus.BrokerUnavailableError, match="no broker answered") as got:
        gradbus.connect(urls, timeout=1)
    assert urls in str(got.value) and "one of its two brokers is up" in str(got.value)


@pytest.mark.parametrize("n", [1, 2])
def test_status_with_no_broker_raises_broker_unavailable(n):
    urls = ",".join(_dead(n))
    with pytest.raises(gradbus.BrokerUnavailableError, match="GRADBUS_BROKER") as got:
        admin.status(urls, timeout=0.5)
    assert got.value.code == Code.BROKER_UNAVAILABLE


def test_status_command_with_no_broker_names_the_code_and_what_to_check():
    r = CliRunner().invoke(main, ["status", "--broker", _dead(1)[0], "--timeout", "0.3"])
    assert r.exit_code == 1, r.output
    assert "Error: BROKER_UNAVAILABLE: " in r.output and "$GRADBUS_BROKER" in r.output
