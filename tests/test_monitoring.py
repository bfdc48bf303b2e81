"""The monitoring against live processes: the Grafana dashboard and the alert rules name only
series that a running cluster's processes export (scraped from their /metrics), and, slow,
docker/monitoring_check.py: a real Prometheus and Alertmanager on loopback against
``gradbus up --shards 2 --replicas 2``, every target up, the key series moving, and a shard
SIGSTOPped: its alerts pending then firing within their ``for:`` plus one scrape, resolved
after SIGCONT."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.metrics import serve_client

from .rigs import wait_for

pytest.importorskip("yaml")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docker"))
import monitoring_lib as ml  # noqa: E402


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_exported_names_come_from_type_lines_samples_or_not():
    text = ("# HELP gradbus_x_total x\n# TYPE gradbus_x_total counter\n"
            "# HELP gradbus_e_total e\n# TYPE gradbus_e_total counter\n"      # no samples yet
            "gradbus_x_total 3.0\n# TYPE gradbus_h_seconds histogram\n"
            "# TYPE gradbus_g gauge\ngradbus_g 1\n")
    assert ml.exported_names(text) == {
        "gradbus_x_total", "gradbus_e_total", "gradbus_h_seconds_bucket",
        "gradbus_h_seconds_sum", "gradbus_h_seconds_count", "gradbus_g"}


def test_the_dashboard_and_the_rules_use_only_series_a_live_cluster_exports(make_cluster):
    cluster = make_cluster(2, replicas=2, metrics_port=0)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(1000, np.float32)})
        c.push({"w": np.ones(1000, np.float32)}).result(30)
        exporter = serve_client(c)
        try:
            urls = wait_for(lambda: len(u := admin.status(cluster.url)["metrics_urls"]) == 3
                            and u, 15, "every process's metrics URL")
            exported = set()
            for url in [*urls.values(), exporter.url]:
                exported |= ml.exported_names(_text(url))
        finally:
            exporter.close()
    dashboard, rules = ml.dashboard_names(), ml.rule_names()
    assert len(dashboard) > 40 and len(rules) >= 10
    assert sorted(dashboard - exported) == []
    assert sorted(rules - exported) == []
    # a panel for every series an alert reads
    assert sorted(rules - dashboard) == []
    # and the check can fail: a name nobody exports
    assert "gradbus_broker_pushes_aplied_total" not in exported


def test_an_alert_firing_late_early_or_never_fails_the_check():
    import monitoring_check as mc

    class Samples:          # Prometheus's ALERTS samples: pending from 10.0, firing from `fire`
        def __init__(self, fire):
            self.fire = fire

        def samples(self, expr, seconds):
            if 'alertstate="pending"' in expr:
                return [(10.0 + k, {}) for k in range(3)]
            return [] if self.fire is None else [(self.fire + k, {}) for k in range(4)]

    def check(fire):
        return mc.alert_figures(Samples(fire), "GradbusPartitionDown", {}, 0.0, 100.0,
                                for_s=3.0, interval=1.0, stopped_at=8.0, continued_at=20.0)
    good = check(13.0)
    assert good["ok"] and good["pending_to_firing_s"] == 3.0
    assert good["pending_after_stop_s"] == 2.0 and good["firing_after_stop_s"] == 5.0
    assert check(14.0)["ok"]                       # within for: plus one evaluation
    assert not check(15.0)["ok"]                   # late
    assert not check(12.0)["ok"]                   # before its for: passed
    assert not check(None)["ok"]                   # never fired


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus is not installed (Debian: apt-get install prometheus)")
def test_a_real_prometheus_scrapes_the_cluster_and_the_alerts_fire_and_resolve():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "docker", "monitoring_check.py")],
                       capture_output=True, text=True, timeout=400, check=False)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    checks = {}
    for d in lines:
        checks.setdefault(d["check"], []).append(d)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert all(d["ok"] for d in lines)
    (targets,) = checks["targets"]
    assert len(targets["targets"]) == 4 and set(targets["targets"].values()) == {"up"}
    (series,) = checks["series"]
    assert series["shard_up"] == {"shard-0": 1.0, "shard-1": 1.0}
    assert all(after > before for before, after in series["moved"].values())
    (stop,) = checks["sigstop"]
    assert stop["partition_down_after_shard0"] is None            # its standby took over
    assert stop["alertmanager"] == ["GradbusPartitionDown"]
    fired = {(a["alert"], a["labels"].get("shard")): a for a in checks["alert"]}
    assert set(fired) == {("GradbusShardSilent", "shard-0"), ("GradbusTargetDown", "shard-0"),
                          ("GradbusNoStandby", None), ("GradbusPartitionDown", None),
                          ("GradbusShardSilent", "shard-1"),
                          ("GradbusClientPushesFailing", None)}
    for a in fired.values():          # Prometheus's own times: for: <= to firing <= for: + 1 s
        assert a["for_s"] <= a["pending_to_firing_s"] + 1e-3 <= a["for_s"] + 1.0 + 2e-3, a
        assert 0 < a["pending_after_stop_s"] < a["firing_after_stop_s"]
    (names,) = checks["names"]
    assert names["not_exported"] == [] and names["no_samples"] == []
