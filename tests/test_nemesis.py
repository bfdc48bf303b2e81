"""bench/nemesis.py, seeded: a broker pair, its shards and clients on hosts of their own while
the network is partitioned, links are cut and processes are killed and frozen at random, then
healed. Every acknowledged push is applied exactly once, nothing unsent is applied, the copies
are identical and one broker acts. The short run is in the default suite; the long one is
marked slow. Skips where network namespaces cannot be made, or where iptables is not
installed."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import hosts_net  # noqa: E402
import nemesis  # noqa: E402


def _check(seconds: float, seed: int, faults_at_least: int) -> dict:
    why = hosts_net.cut_permitted()
    if why:
        pytest.skip(f"emulated hosts: {why}")
    got = nemesis.run(seconds, seed)
    assert sum(got["faults"].values()) >= faults_at_least, got
    assert got["acked"] > 0, got
    assert (got["lost"], got["applied_twice"], got["applied_unsent"]) == (0, 0, 0), got
    assert got["replicas_identical"] and got["one_active"], got
    assert got["unsettled"] == 0, got
    return got


@pytest.mark.timeout(240)
def test_a_short_seeded_nemesis_run_loses_nothing_and_applies_nothing_twice():
    _check(20.0, seed=7, faults_at_least=3)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_long_nemesis_run_loses_nothing_and_applies_nothing_twice():
    got = _check(600.0, seed=11, faults_at_least=60)
    assert all(got["faults"].get(k, 0) >= 5 for k in nemesis.KINDS), got
