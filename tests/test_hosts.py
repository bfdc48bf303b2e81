"""bench/hosts.py's emulated hosts: a broker and shard in one network namespace, a client in
another, the link between them shaped; pushes cross it, and every namespace goes at the end.
Skips where network namespaces cannot be made (not root, no ip netns, no tbf)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import hosts_net  # noqa: E402
import peers  # noqa: E402  (gradbus up's start and stop)

DEADLINE = 90.0
PUSHES = 8
N = 1 << 16                 # 256 KiB of float32 per push
CLIENT = f"""
import json, sys
import numpy as np
import gradbus
with gradbus.connect(sys.argv[1], timeout=60) as c:
    c.init({{"w": np.zeros({N}, np.float32)}}, optimizer=gradbus.SGD(lr=1.0))
    g = np.full({N}, 0.25, np.float32)
    acks = [c.push({{"w": g}}, acks=1) for _ in range({PUSHES})]
    ver = max(f.result(60)["ver"] for f in acks)
    w = c.pull(["w"], min_version=ver)["w"]
    print(json.dumps({{"min": float(w.min()), "max": float(w.max()), "ver": ver}}))
"""


def test_pushes_cross_the_shaped_link_and_the_namespaces_go(tmp_path):
    why = hosts_net.permitted()
    if why:
        pytest.skip(f"emulated hosts: {why}")
    hosts = hosts_net.Hosts(1, "200mbit", "1gbit")
    up = None
    try:
        hosts.build()
        server, worker = hosts.server, hosts.workers[0]
        assert sorted(hosts.left()) == sorted([server, worker])
        shaped = hosts_net.run("tc", "-n", worker, "qdisc", "show", "dev", "eth0").stdout
        assert "tbf" in shaped and "200Mbit" in shaped, shaped
        log = tmp_path / "up.log"
        with open(log, "w") as out:
            up = subprocess.Popen(
                [*hosts.exec_prefix(server), sys.executable, "-m", "gradbus", "up",
                 "--shards", "1", "--host", hosts_net.SERVER_ADDR, "--port", "5555"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "GRADBUS_JIT": "0"})
        url = peers._wait_ready(up, str(log), DEADLINE)
        assert url == f"tcp://{hosts_net.SERVER_ADDR}:5555"
        before = {(ns, dev): hosts.qdisc_bytes(ns, dev)
                  for ns, dev in ((worker, "eth0"), (server, "up1"), (server, "up0"),
                                  (server, "w0"))}
        done = subprocess.run(
            [*hosts.exec_prefix(worker), sys.executable, "-c", CLIENT, url],
            capture_output=True, text=True, timeout=DEADLINE,
            env={**os.environ, "GRADBUS_SHM": "0", "GRADBUS_JIT": "0"})
        assert done.returncode == 0, done.stderr[-3000:]
        res = json.loads(done.stdout.strip().splitlines()[-1])
        assert res["min"] == res["max"] == -PUSHES * 0.25      # every push applied once
        crossed = {k: hosts.qdisc_bytes(*k) - v for k, v in before.items()}
        pushed = PUSHES * 4 * N
        # the gradients left the worker through its shaper and reached the server through
        # the server link's; the weights came back through both the other way
        assert crossed[(worker, "eth0")] >= pushed, crossed
        assert crossed[(server, "up1")] >= pushed, crossed
        assert crossed[(server, "up0")] >= 4 * N, crossed
        assert crossed[(server, "w0")] >= 4 * N, crossed
    finally:
        if up is not None:
            peers._end_group(up)
        hosts.close()
    assert hosts.left() == []
    assert not [ns for ns in hosts_net.namespaces()
                if ns.startswith(f"{hosts_net.PREFIX}{os.getpid()}-")]


def test_rates_and_delays_are_read_as_tc_writes_them():
    assert hosts_net.parse_rate("1gbit") == 10**9
    assert hosts_net.parse_rate("10gbit") == 10**10
    assert hosts_net.parse_rate("250mbit") == 250 * 10**6
    for bad in ("1gbps", "fast", "0gbit", "-1mbit", ""):
        with pytest.raises(ValueError):
            hosts_net.parse_rate(bad)
    assert hosts_net.parse_delay("0") == 0
    assert hosts_net.parse_delay("0.1ms") == pytest.approx(1e-4)
    assert hosts_net.parse_delay("50us") == pytest.approx(5e-5)
    for bad in ("soon", "2s", "1 hour"):
        with pytest.raises(ValueError):
            hosts_net.parse_delay(bad)


TIER_CLIENT = f"""
import json, sys
import numpy as np
import gradbus
names = sys.argv[2:]
with gradbus.connect(sys.argv[1], timeout=60, shm=False) as c:
    c.init({{n: np.zeros({N}, np.float32) for n in names}}, optimizer=gradbus.SGD(lr=1.0))
    g = {{n: np.full({N}, 0.25, np.float32) for n in names}}
    for f in [c.push(g, acks=1) for _ in range({PUSHES})]:
        f.result(60)
    w = c.pull(names, min_version={PUSHES})
    print(json.dumps({{n: [float(a.min()), float(a.max())] for n, a in w.items()}}))
"""


def test_a_tier_across_two_server_hosts_sends_each_tensor_through_its_members_link():
    """Two server hosts, a tier member on each (bench/tier_hosts.py's brokers); a worker on a
    third host pushes one tensor each member holds: each is applied once, and each server
    host's link carried its member's tensor only."""
    why = hosts_net.permitted()
    if why:
        pytest.skip(f"emulated hosts: {why}")
    import tier_hosts

    from gradbus.cluster import end_processes
    from gradbus.codecs.tier import TierMap
    hosts = hosts_net.Hosts(1, "1gbit", "1gbit", servers=2)
    brokers = []
    try:
        hosts.build()
        assert sorted(hosts.left()) == sorted([*hosts.servers, hosts.workers[0]])
        brokers, urls = tier_hosts._start_tier(hosts, 2, subprocess.DEVNULL)
        tm = TierMap.spread(urls, 256)
        names = [next(f"t{i}" for i in range(99) if tm.owner(f"t{i}") == k) for k in (0, 1)]
        links = [(hosts.servers[0], "up1"), (hosts.servers[0], "s1")]   # into each member
        before = [hosts.qdisc_bytes(*k) for k in links]
        done = subprocess.run(
            [*hosts.exec_prefix(hosts.workers[0]), sys.executable, "-c", TIER_CLIENT,
             urls[1], *names], capture_output=True, text=True, timeout=DEADLINE,
            env={**os.environ, "GRADBUS_JIT": "0"})
        assert done.returncode == 0, done.stderr[-3000:]
        res = json.loads(done.stdout.strip().splitlines()[-1])
        assert res == {n: [-PUSHES * 0.25] * 2 for n in names}    # every push applied once
        crossed = [hosts.qdisc_bytes(*k) - b for k, b in zip(links, before)]
        pushed = PUSHES * 4 * N
        # each member's tensor went in through its host's link, and not through the other's
        assert all(pushed <= c < 2 * pushed for c in crossed), crossed
    finally:
        end_processes(brokers, 10)
        hosts.close()
    assert hosts.left() == []


def test_a_slow_server_link_carries_about_the_weights_the_workers_read():
    """bench/tier_hosts.py with one server host on a link that takes about a second per model:
    a worker's credit is answered after many heartbeats, and is waited for rather than granted
    again every half second (each grant again is the whole model once more). Each worker
    receives a few times what it pushes at most (it read one model per push), where it
    received about ten times with credits granted again every two heartbeats."""
    why = hosts_net.permitted()
    if why:
        pytest.skip(f"emulated hosts: {why}")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "tier_hosts.py"), "--servers", "1",
         "--workers", "2", "--tensors", "2", "--size", "1M", "--server-link", "16mbit",
         "--seconds", "5", "--warmup", "1"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "TIER_HOSTS_STATS": "1", "GRADBUS_JIT": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["updates_per_s"] > 0, line
    stats = [json.loads(s.split(": ", 1)[1]) for s in done.stderr.splitlines()
             if s.startswith("worker ")]
    assert len(stats) == 2, done.stderr[-3000:]
    for st in stats:
        assert st["pushes_acked"] >= 2, st
        assert st["recv_bytes"] <= 3 * st["push_bytes"], st
