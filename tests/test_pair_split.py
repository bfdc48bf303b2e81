"""A broker pair and its shards cut into two sides (protocol section 23, the voters' rule):
side A holds broker a, shard s0 and a client, side B broker b, shard s1 and another client,
each side a host of its own (a network namespace, bench/hosts_net.py); the pair runs 2
replicas. Both clients push acks="all" one-hot rows of one shared ledger tensor (SGD, lr 1),
each into its own half; the test drops every packet between the sides, then lets them
through again.

While cut, each broker sees one copy of the partition and no peer: neither has a majority of
its voters, so neither side acknowledges anything (the standby side claims the pair, and
waits). After healing, one broker is active with its votes, every acknowledged push is in the
weights exactly once, nothing unsent is, and the two copies are the same. Skips where network
namespaces cannot be made, or where iptables is not installed."""
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
K = 4000                 # rows per client: client c writes rows c*K ..
CUT = 8.0                # seconds the sides stay cut (as in the case)
CHILD = """
import json, os, sys, time, threading
import numpy as np
import gradbus
from gradbus import admin
K = %d
mode, args = sys.argv[1], sys.argv[2:]
if mode == "init":
    with gradbus.connect(args[0], timeout=60) as c:
        c.init({"ledger": np.zeros(2 * K, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
    print("{}")
elif mode == "push":       # urls, client number, file prefix; until PREFIX.stop appears
    urls, base, out = args[0], int(args[1]) * K, args[2]
    acked, failed, lock = {}, {}, threading.Lock()
    def settled(i):
        def cb(f):
            t, e = time.monotonic(), f.exception()
            with lock:
                if e is None:
                    acked[i] = t
                else:
                    failed[i] = str(e)[:200]
        return cb
    futs, tries, i = [], 0, 0
    with gradbus.connect(urls, timeout=60, window=8) as c:
        while i < K and not os.path.exists(out + ".stop"):
            tries += 1
            g = np.zeros(2 * K, np.float32)
            g[base + i] = 1.0
            try:
                f = c.push({"ledger": g}, acks="all", timeout=0.3)
            except gradbus.BackPressureError:
                f = None          # not sent: the same row again
            if f is not None:
                f.add_done_callback(settled(i))
                futs.append(f)
                i += 1
                try:
                    f.result(0.3)
                except Exception:
                    pass
            with lock:
                state = {"sent": i, "acked": len(acked), "tries": tries}
            with open(out + ".tmp", "w") as fh:
                json.dump(state, fh)
            os.replace(out + ".tmp", out + ".progress")
        end = time.monotonic() + 60
        for f in futs:
            try:
                f.result(max(0.01, end - time.monotonic()))
            except Exception:
                pass
    with lock:
        print(json.dumps({"sent": i, "acked": acked, "failed": failed}))
elif mode == "ledger":     # the weights and each partition's copies, once fully replicated
    url = args[0]
    deadline = time.monotonic() + 60
    while admin.status(url, timeout=5)["under_replicated"] and time.monotonic() < deadline:
        time.sleep(0.05)
    copies = {}
    for parts in admin.digest(url).values():
        for p, sd in parts.items():
            copies.setdefault(str(p), []).append(list(sd))
    with gradbus.connect(url, timeout=60) as c:
        w = c.pull(["ledger"], timeout=60)["ledger"]
    print(json.dumps({"w": {int(j): float(w[j]) for j in np.flatnonzero(w)},
                      "copies": copies}))
else:                      # "role URL": the broker's pair state as it says, or the error
    try:
        st = admin.status(args[0], timeout=2.0)
        p = st["pair"]
        print(json.dumps([p["role"], p["epoch"], p["peer"]["role"], p.get("quorum"),
                          sum(s["alive"] for s in st["shards"])]))
    except gradbus.GradbusError as e:
        print(json.dumps(str(e)))
""" % K


def test_a_pair_cut_into_two_sides_acknowledges_on_one_side_at_most_and_loses_nothing(
        tmp_path):
    why = hosts_net.cut_permitted()
    if why:
        pytest.skip(f"emulated hosts: {why}")
    hosts = hosts_net.Hosts(2, "1gbit", "1gbit")
    procs: list = []
    cut_rules: list = []
    try:
        hosts.build()
        side = dict(zip("AB", hosts.workers))
        addr = {s: hosts.worker_addr(i) for i, s in enumerate("AB")}
        url = {s: f"tcp://{addr[s]}:{PORT}" for s in "AB"}
        both = {"A": f"{url['A']},{url['B']}", "B": f"{url['B']},{url['A']}"}

        def spawn(s, *args, out=subprocess.DEVNULL):
            p = subprocess.Popen([*hosts.exec_prefix(side[s]), sys.executable,
                                  *map(str, args)], stdout=out, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                                 preexec_fn=_end_with_test)
            procs.append(p)
            return p

        def child(s, *args):
            done = subprocess.run([*hosts.exec_prefix(side[s]), sys.executable, "-c", CHILD,
                                   *map(str, args)], capture_output=True, text=True,
                                  timeout=120, cwd=ROOT)
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        def roles():
            return {s: child(s, "role", url[s]) for s in "AB"}

        def progress(s):
            try:
                with open(tmp_path / f"{s}.progress") as f:
                    return json.load(f)
            except (OSError, ValueError):
                return {"sent": 0, "acked": 0, "tries": 0}

        for s, o in (("A", "B"), ("B", "A")):
            spawn(s, "-m", "gradbus", "broker", "--host", addr[s], "--port", PORT,
                  "--peer", f"tcp://{addr[o]}:{PAIR_PORT}", "--peer-port", PAIR_PORT,
                  "--replicas", 2, "--no-shm")
        for i, s in enumerate("AB"):
            spawn(s, "-m", "gradbus", "shard", "--broker", both[s], "--id", f"s{i}", "--no-shm")

        def settled():
            """One broker acting, both shards live on it, the other the standby hearing it."""
            r = roles()
            ok = (all(isinstance(v, list) for v in r.values())
                  and sorted(v[0] for v in r.values()) == ["active", "standby"]
                  and all(v[3] is not False and v[4] == 2 for v in r.values()
                          if v[0] == "active")
                  and all(v[2] != "silent" for v in r.values()))
            return ok and r
        before = wait_for(settled, 60, "one acting broker with both shards, heard by the other")
        child("A", "init", both["A"])
        clients = {s: spawn(s, "-c", CHILD, "push", both[s], i, tmp_path / s,
                            out=subprocess.PIPE) for i, s in enumerate("AB")}
        wait_for(lambda: all(progress(s)["acked"] >= 20 for s in "AB"), 60,
                 "both clients acknowledged before the cut")

        # the cut: every packet between the sides dropped, both ways, in side A's host
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            rule = [chain, flag, addr["B"], "-j", "DROP"]
            hosts_net.run(*hosts.exec_prefix(side["A"]), "iptables", "-A", *rule)
            cut_rules.append(rule)
        t_cut = _now()
        standby = next(s for s in "AB" if before[s][0] == "standby")

        def both_sides_alone():
            r = roles()
            return (all(isinstance(v, list) and v[2] == "silent" for v in r.values())
                    and r[standby][0] == "active" and r)
        during = wait_for(both_sides_alone, 30,
                          "each broker alone with its shard, the standby's side claiming")
        # the cut lasts CUT seconds more, the time either side would take to acknowledge
        # alone (a shard declared dead, a client moved): a length of the fault, not a wait
        # that anything below depends on
        wait_for(lambda: _now() >= t_cut + CUT, CUT + 30, "the cut's length")
        during = roles()
        for rule in cut_rules[:]:
            hosts_net.run(*hosts.exec_prefix(side["A"]), "iptables", "-D", *rule)
            cut_rules.remove(rule)
        t_heal = _now()

        after = wait_for(settled, 60, "one acting broker again")
        base = {s: progress(s)["acked"] for s in "AB"}
        wait_for(lambda: all(progress(s)["acked"] >= base[s] + 20 for s in "AB"), 90,
                 "both clients acknowledged after healing")
        (tmp_path / "A.stop").touch()
        (tmp_path / "B.stop").touch()
        got = {}
        for s, p in clients.items():
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-2000:]
            got[s] = json.loads(out.strip().splitlines()[-1])
        active = next(s for s in "AB" if after[s][0] == "active")
        ledger = child(active, "ledger", both[active])
    finally:
        for rule in cut_rules:
            hosts_net.run(*hosts.exec_prefix(side["A"]), "iptables", "-D", *rule, check=False)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        hosts.close()
    assert not hosts.left()

    # at most one side acknowledged anything while cut
    cut_acks = {s: sum(t_cut <= t <= t_heal for t in got[s]["acked"].values()) for s in "AB"}
    assert min(cut_acks.values()) == 0, (cut_acks, before, during, after)
    # every acknowledged push applied exactly once; nothing applied that was not sent
    w = {int(j): v for j, v in ledger["w"].items()}
    for i, s in enumerate("AB"):
        acked = {i * K + int(r) for r in got[s]["acked"]}
        sent = set(range(i * K, i * K + got[s]["sent"]))
        lost = sorted(j for j in acked if w.get(j) != -1.0)
        assert not lost, f"{len(lost)} acknowledged pushes of {s} not applied once: {lost[:10]}"
        assert all(j in sent for j in w if i * K <= j < (i + 1) * K)
    assert all(v == -1.0 for v in w.values()), {j: v for j, v in w.items() if v != -1.0}
    assert all(v[3] is False for v in during.values()), during     # neither side acted
    assert ledger["copies"] and all(len(c) == 2 and c[0] == c[1]
                                    for c in ledger["copies"].values()), ledger["copies"]


def _now() -> float:
    import time
    return time.monotonic()
