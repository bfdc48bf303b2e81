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
    # a shard's snapshot is refreshed at its next heartbeat after it applied
    shard_m = wait_for(lambda: (ms := [_scrape(urls[sid]) for sid in ("shard-0", "shard-1")])
                       and sum(m["gradbus_shard_pushes_applied_total"] for m in ms) == n and ms,
                       10, "the shards' applied pushes")
    for m in shard_m:
        assert "gradbus_shard_apply_seconds_bucket{le=\"+Inf\"}" in m
        assert m['gradbus_shard_info{backend="numpy",device="cpu"}'] == 1.0
    # the ops command names them too
    r = subprocess.run([sys.executable, "-m", "gradbus", "status", "--json", "--broker",
                        cluster.url], capture_output=True, text=True, timeout=60)
    st = json.loads(r.stdout)
    assert st["metrics_urls"] == urls
    assert [(s["info"]["backend"], s["info"]["device"]) for s in st["shards"]] == [
        ("numpy", "cpu")] * 2


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
    from gradbus.shards.meters import ShardMeters
    from gradbus.shards.shm_io import ShardShm

    class Idle:
        stats, broker_alive, _credit_held = {}, True, {}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    names = [*BrokerCore(8).metrics(0), *ShardCore("s").metrics(),
             *ShardMeters().snapshot(ShardShm(False)), *client_snapshot(Idle())]
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


def _value(snap: dict, name: str, **labels):
    """The value of one series of a metrics snapshot (counters and gauges)."""
    key = tuple(sorted((k, str(v)) for k, v in labels.items()))
    return snap[name][2][key]


def test_the_alerts_series_follow_shard_deaths_and_the_partition_table():
    """shard_silent tells a shard gone silent from one that said bye; partitions without a
    standby, and down, follow the table (the state machines, no sockets)."""
    import numpy as np

    from gradbus.codecs import wire

    from .rigs import RepRig, init_msg
    rig = RepRig(("s0", "s1"), replicas=2, heartbeat_interval=0.1, liveness=3,
                 max_pending_bytes=3 << 20)
    frames, _ = init_msg(1, "w", np.arange(64, dtype=np.float32))
    rig.client(b"c", frames)
    b = rig.broker
    placed = sum(1 for o in b.owners if o)
    assert placed >= 1

    def snap():
        return b.metrics(rig.now)
    m = snap()
    assert _value(m, "gradbus_broker_replicas") == 2
    assert _value(m, "gradbus_broker_max_pending_bytes") == 3 << 20
    assert _value(m, "gradbus_broker_partitions_without_standby") == 0
    assert _value(m, "gradbus_broker_shard_silent", shard="s0") == 0
    # s0 goes silent: declared dead after liveness, its partitions fail over to s1, alone
    rig.dead = {"s0"}
    for _ in range(5):
        rig.tick(0.1)
    m = snap()
    assert _value(m, "gradbus_broker_shard_up", shard="s0") == 0
    assert _value(m, "gradbus_broker_shard_silent", shard="s0") == 1
    assert _value(m, "gradbus_broker_shard_silent", shard="s1") == 0
    assert _value(m, "gradbus_broker_partitions_without_standby") == placed
    assert _value(m, "gradbus_broker_partitions_down") == 0
    # s1 says bye (stopped on purpose): dead, not silent; every placed partition is down
    rig.deliver(b.on_backend(b"s1", [wire.pack(wire.BYE)], rig.now))
    m = snap()
    assert _value(m, "gradbus_broker_shard_up", shard="s1") == 0
    assert _value(m, "gradbus_broker_shard_silent", shard="s1") == 0
    assert _value(m, "gradbus_broker_partitions_down") == placed
    assert _value(m, "gradbus_broker_partitions_without_standby") == 0
    # s0 registers again: no longer silent
    rig.dead = set()
    rig.register("s0")
    assert _value(snap(), "gradbus_broker_shard_silent", shard="s0") == 0


def test_shard_checkpoint_series_before_and_after_checkpoints():
    from gradbus.shards.meters import ShardMeters
    from gradbus.shards.shm_io import ShardShm
    clock = iter([100.0])
    m = ShardMeters(60, "/data", wall=lambda: next(clock))
    shm = ShardShm(False)
    s = m.snapshot(shm)
    assert _value(s, "gradbus_shard_checkpoint_interval_seconds") == 60.0
    assert _value(s, "gradbus_shard_last_checkpoint_timestamp_seconds") == 100.0   # started
    m.checkpoint_written(160.5)
    m.checkpoint_failed()
    s = m.snapshot(shm)
    assert _value(s, "gradbus_shard_last_checkpoint_timestamp_seconds") == 160.5
    assert _value(s, "gradbus_shard_checkpoint_failures") == 1
    assert _value(s, "gradbus_shard_shm") == 0 and _value(s, "gradbus_shard_shm_exhausted") == 0
    # no data directory: no periodic checkpoints, whatever the interval says
    assert _value(ShardMeters(60, None).snapshot(shm),
                  "gradbus_shard_checkpoint_interval_seconds") == 0.0


def test_a_shard_process_exports_its_checkpoints_and_their_failures(make_cluster, tmp_path):
    import os
    import shutil
    import time
    data = str(tmp_path / "data")
    before = time.time()
    cluster = make_cluster(1, metrics_port=0, shard_args=["--data-dir", data,
                                                          "--checkpoint-interval", "0.2"])
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(100, np.float32)})
    url = wait_for(lambda: admin.status(cluster.url)["metrics_urls"].get("shard-0"), 15,
                   "the shard's metrics URL")
    m = wait_for(lambda: (m := _scrape(url)).get("gradbus_shard_checkpoints_total", 0) >= 2
                 and m, 30, "two periodic checkpoints in the shard's metrics")
    assert m["gradbus_shard_checkpoint_interval_seconds"] == 0.2
    assert m["gradbus_shard_last_checkpoint_timestamp_seconds"] >= before
    assert m["gradbus_shard_checkpoint_failures_total"] == 0
    # the shard's checkpoint directory becomes a file: the writes fail, and are counted
    base = os.path.join(data, "shard-0")
    shutil.rmtree(base)
    with open(base, "w") as f:
        f.write("in the way")
    try:
        m = wait_for(lambda: (m := _scrape(url)).get("gradbus_shard_checkpoint_failures_total",
                                                      0) >= 1 and m, 30, "a failed checkpoint")
        stuck = m["gradbus_shard_last_checkpoint_timestamp_seconds"]
        assert _scrape(url)["gradbus_shard_last_checkpoint_timestamp_seconds"] == stuck
    finally:
        os.remove(base)
