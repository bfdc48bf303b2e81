"""A broker pair whose brokers lose each other while the shards and clients still see both
(protocol section 23): each broker on a host of its own (a network namespace), the shards and
the clients on a third; the test cuts the link between the two brokers alone (iptables drops
in one broker's namespace). Exactly one broker accepts pushes before, during and after the
cut, and the known answer is exact. Skips where network namespaces cannot be made, or where
iptables is not installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .rigs import _end_with_test, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import hosts_net  # noqa: E402

pytestmark = pytest.mark.timeout(180)
PORT, PAIR_PORT = 5555, 5560
N = 1024
# in the shards' and clients' host: "push K" (K acks=1 pushes of ones, then the weights),
# "roles URL..." (each broker's role as it says, or the error)
CHILD = """
import json, sys
import numpy as np
import gradbus
from gradbus import admin
mode, args = sys.argv[1], sys.argv[2:]
if mode == "push":
    url, k = args[0], int(args[1])
    with gradbus.connect(url, timeout=30) as c:
        c.init({"w": np.zeros(%d, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        vers = [c.push({"w": np.ones(%d, np.float32)}).result(30)["ver"] for _ in range(k)]
        w = c.pull(["w"], min_version=max(vers), timeout=30)["w"]
        print(json.dumps({"url": c.url, "w": [float(w.min()), float(w.max())],
                          "ver": c.version("w")}))
else:
    out = {}
    for url in args:
        try:
            p = admin.status(url, timeout=2.0)["pair"]
            out[url] = [p["role"], p["epoch"], p["peer"]["role"]]
        except gradbus.GradbusError as e:
            out[url] = str(e)
    print(json.dumps(out))
""" % (N, N)


def test_a_cut_link_between_the_brokers_alone_leaves_one_accepting_pushes():
    why = hosts_net.cut_permitted()
    if why:
        pytest.skip(f"emulated hosts: {why}")
    hosts = hosts_net.Hosts(2, "1gbit", "1gbit")
    procs: list = []
    try:
        hosts.build()
        a, b = hosts.workers            # a broker on each; shards and clients on the server
        addr = {a: hosts.worker_addr(0), b: hosts.worker_addr(1)}
        urls = {ns: f"tcp://{addr[ns]}:{PORT}" for ns in (a, b)}
        both = f"{urls[a]},{urls[b]}"

        def spawn(ns, *args):
            p = subprocess.Popen([*hosts.exec_prefix(ns), sys.executable, "-m", "gradbus",
                                  *map(str, args)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, preexec_fn=_end_with_test)
            procs.append(p)

        def child(*args) -> dict:
            done = subprocess.run([*hosts.exec_prefix(hosts.server), sys.executable, "-c",
                                   CHILD, *map(str, args)], capture_output=True, text=True,
                                  timeout=90, cwd=ROOT)
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        for ns, peer in ((a, b), (b, a)):
            spawn(ns, "broker", "--host", addr[ns], "--port", PORT, "--peer",
                  f"tcp://{addr[peer]}:{PAIR_PORT}", "--peer-port", PAIR_PORT, "--no-shm")
        for i in range(2):
            spawn(hosts.server, "shard", "--broker", both, "--id", f"s{i}", "--no-shm")

        def roles():
            return child("roles", urls[a], urls[b])

        def settled():
            """One broker active, each hearing the other (its peer's role), else None."""
            r = roles()
            got = [v for v in r.values() if isinstance(v, list)]
            other = {"active": "standby", "standby": "active"}
            return (len(got) == 2 and [v[0] for v in got].count("active") == 1
                    and all(v[2] == other[v[0]] for v in got) and r) or None
        before = wait_for(settled, 60, "one active broker, each hearing the other")
        active = next(ns for ns in (a, b) if before[urls[ns]][0] == "active")
        got = child("push", both, 20)
        assert got["url"] == urls[active] and got["w"] == [-20.0, -20.0], got

        # the link between the brokers alone: dropped both ways in broker a's host
        other = b if a == active else a
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            hosts_net.run(*hosts.exec_prefix(a), "iptables", "-A", chain, flag, addr[b],
                          "-j", "DROP")
        wait_for(lambda: (lambda r: r[urls[active]][2] == "silent"
                          and r[urls[other]][2] == "silent" and r)(roles()), 30,
                 "each broker to count its peer silent")
        got = child("push", both, 20)          # the shards still hear the active one
        assert got["url"] == urls[active] and got["w"] == [-40.0, -40.0], got
        r = roles()
        assert [r[urls[active]][0], r[urls[other]][0]] == ["active", "standby"], r
        assert r[urls[active]][1] == before[urls[active]][1]      # no take-over, no new epoch
        with pytest.raises(AssertionError, match="NOT_ACTIVE"):
            child("push", urls[other], 1)      # the standby accepts nothing

        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            hosts_net.run(*hosts.exec_prefix(a), "iptables", "-D", chain, flag, addr[b],
                          "-j", "DROP")
        after = wait_for(settled, 30, "the link back")
        assert after[urls[active]][0] == "active", after
        got = child("push", both, 10)
        assert got["url"] == urls[active] and got["w"] == [-50.0, -50.0], got
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        hosts.close()
    assert not hosts.left()
