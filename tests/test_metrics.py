"""Prometheus metrics: every process serves /metrics, status names the URLs, and the figures
match what the test pushed."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np

import gradbus
from gradbus import admin
from gradbus.cluster import LocalCluster
from gradbus.codecs import stats
from gradbus.metrics import MetricsExporter, parse

from .rigs import wait_for


def _scrape(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return parse(r.read().decode())


def test_cluster_processes_serve_metrics_that_match_the_pushes(make_cluster):
    cluster = make_cluster(2, metrics_port=0)
    n = 20
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(1000, np.float32)}, optimizer=gradbus.SGD(lr=0.1))
        for _ in range(n):
            c.push({"w": np.ones(1000, np.float32)}, codec="bf16", version=c.version("w"))
        c.flush()
    urls = wait_for(lambda: (u := admin.status(cluster.url)["metrics_urls"]) and len(u) == 3
                    and u, 15, "every process's metrics URL in status")
    assert set(urls) == {"broker", "shard-0", "shard-1"}
    b = wait_for(lambda: (m := _scrape(urls["broker"])).get(
        "gradbus_broker_pushes_applied_total") == n and m, 10, "the broker's counters")
    assert b["gradbus_broker_pushes_received_total"] == n
    assert b["gradbus_broker_push_decoded_bytes_total"] == n * 4000
    assert b["gradbus_broker_push_wire_bytes_total"] == n * 2000          # bf16
    assert b["gradbus_broker_compression_ratio"] == 2.0
    assert b["gradbus_broker_push_to_ack_seconds_count"] == n
    assert b["gradbus_broker_push_to_visible_seconds_count"] == n
    assert b["gradbus_broker_staleness_count"] == n           # every push named its version
    assert b['gradbus_broker_shard_up{shard="shard-0"}'] == 1.0
    assert b["gradbus_broker_batch_entries_count"] >= 1
    applied = 0.0
    for sid in ("shard-0", "shard-1"):
        m = wait_for(lambda sid=sid: _scrape(urls[sid]), 5, sid)
        applied += m["gradbus_shard_pushes_applied_total"]
        assert "gradbus_shard_apply_seconds_bucket{le=\"+Inf\"}" in m
    assert applied == n
    # the ops command names them too
    r = subprocess.run([sys.executable, "-m", "gradbus", "status", "--json", "--broker",
                        cluster.url], capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)["metrics_urls"] == urls


def test_up_gives_each_process_its_own_port():
    c = LocalCluster(3, metrics_port=9300)
    assert c._metrics_args(0) == ["--metrics-port", "9300"]
    assert c._metrics_args(2) == ["--metrics-port", "9302"]
    assert LocalCluster(1, metrics_port=0)._metrics_args(5) == ["--metrics-port", "0"]
    assert LocalCluster(1)._metrics_args(0) == []


def test_exporter_serves_histograms_cumulatively_and_labels():
    h = stats.Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    e = MetricsExporter(0, name="test-metrics")
    try:
        e.update({"gradbus_x_seconds": stats.histogram("x", h),
                  "gradbus_y": stats.labelled("counter", "y", "code", {"A": 2, "B": 3}),
                  "gradbus_z": stats.gauge("z", 7)})
        m = _scrape(e.url)
    finally:
        e.close()
    assert m['gradbus_x_seconds_bucket{le="0.1"}'] == 1
    assert m['gradbus_x_seconds_bucket{le="1.0"}'] == 3
    assert m['gradbus_x_seconds_bucket{le="+Inf"}'] == 4
    assert m["gradbus_x_seconds_count"] == 4 and abs(m["gradbus_x_seconds_sum"] - 6.05) < 1e-9
    assert m['gradbus_y_total{code="A"}'] == 2 and m['gradbus_y_total{code="B"}'] == 3
    assert m["gradbus_z"] == 7
    assert h.quantile(0.5) == 1.0 and stats.Histogram().quantile(0.5) is None


def test_the_sdk_serves_its_own_metrics_on_request(make_cluster):
    from gradbus.metrics import serve_client
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(1000, np.float32)})
        exporter = serve_client(c, interval=0.05)
        try:
            for _ in range(5):
                c.push({"w": np.ones(1000, np.float32)}, codec="bf16")
            c.flush()
            m = wait_for(lambda: (m := _scrape(exporter.url)).get(
                "gradbus_client_pushes_acked_total") == 5 and m, 10, "the client's counters")
        finally:
            exporter.close()
    assert m["gradbus_client_pushes_total"] == 5
    assert m["gradbus_client_compression_ratio"] == 2.0 and m["gradbus_client_broker_up"] == 1


def test_every_metric_is_in_the_operations_guide():
    from pathlib import Path

    from gradbus.broker.core import BrokerCore
    from gradbus.metrics import client_snapshot
    from gradbus.shards.core import ShardCore

    class Idle:
        stats, broker_alive, _credit_held = {}, True, {}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    names = [*BrokerCore(8).metrics(0), *ShardCore("s").metrics(), *client_snapshot(Idle())]
    assert len(names) > 30
    missing = [n for n in names if f"`{n}" not in doc]
    assert not missing, missing


def test_a_demo_worker_serves_its_metrics(make_cluster):
    cluster = make_cluster(1)
    proc = subprocess.Popen([sys.executable, "-m", "gradbus", "worker", "--broker", cluster.url,
                             "--epochs", "200", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "the worker ended without naming its metrics URL"
            url = json.loads(line).get("metrics")
        m = wait_for(lambda: (m := _scrape(url)).get("gradbus_client_pushes_total", 0) > 0
                     and m, 30, "the worker's pushes in its metrics")
        assert m["gradbus_client_broker_up"] == 1
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
