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
