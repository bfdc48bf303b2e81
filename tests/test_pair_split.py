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
CHILD = os.path.join(ROOT, "bench", "ledger_child.py")


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

        def spawn(s, name, *args, out=subprocess.DEVNULL):
            """A process in side ``s``'s host; what it logs goes to NAME.log."""
            with open(tmp_path / f"{name}.log", "w") as err:
                p = subprocess.Popen([*hosts.exec_prefix(side[s]), sys.executable,
                                      *map(str, args)], stdout=out, stderr=err, text=True,
                                     cwd=ROOT, preexec_fn=_end_with_test)
            procs.append(p)
            return p

        def child(s, *args):
            done = subprocess.run([*hosts.exec_prefix(side[s]), sys.executable, CHILD,
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
                return {"sent": 0, "acked": 0}

        for s, o in (("A", "B"), ("B", "A")):
            spawn(s, f"broker-{s}", "-m", "gradbus", "broker", "--host", addr[s],
                  "--port", PORT,
                  "--peer", f"tcp://{addr[o]}:{PAIR_PORT}", "--peer-port", PAIR_PORT,
                  "--replicas", 2, "--no-shm")
        for i, s in enumerate("AB"):
            spawn(s, f"s{i}", "-m", "gradbus", "shard", "--broker", both[s], "--id", f"s{i}",
                  "--no-shm")

        def settled():
            """One broker acting, both shards live on it, the other the standby hearing it."""
            r = roles()
            ok = (all(isinstance(v, list) for v in r.values())
                  and sorted(v[0] for v in r.values()) == ["active", "standby"]
                  and all(v[3] is not False and v[4] == 2 for v in r.values()
                          if v[0] == "active")
                  and all(v[2] != "silent" for v in r.values()))
            return ok and r
        wait_for(settled, 60, "one acting broker with both shards, heard by the other")
        child("A", "init", both["A"], 2 * K)
        clients = {s: spawn(s, f"client-{s}", CHILD, "push", both[s], i * K, K, tmp_path / s,
                            out=subprocess.PIPE) for i, s in enumerate("AB")}
        wait_for(lambda: all(progress(s)["acked"] >= 20 for s in "AB"), 60,
                 "both clients acknowledged before the cut")

        def in_sync():
            r = settled()
            return r and r[active_of(r)][5] == 0 and r
        before = wait_for(in_sync, 60, "both copies of the ledger in sync before the cut")

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
        active = active_of(after)
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
        acked = {int(r) for r in got[s]["acked"]}
        sent = set(range(i * K, i * K + got[s]["sent"]))
        lost = sorted(j for j in acked if w.get(j) != -1.0)
        assert not lost, f"{len(lost)} acknowledged pushes of {s} not applied once: {lost[:10]}"
        assert all(j in sent for j in w if i * K <= j < (i + 1) * K)
    assert all(v == -1.0 for v in w.values()), {j: v for j, v in w.items() if v != -1.0}
    # the side that claimed the pair while cut did not act: one copy, no peer's vote (the
    # other may say it acts when its only copy there had been dropped: then it has nothing
    # of the ledger to write)
    assert during[standby][0] == "active" and during[standby][3] is False, during
    assert ledger["copies"] and all(len(c) == 2 and c[0] == c[1]
                                    for c in ledger["copies"].values()), ledger["copies"]


def active_of(r: dict) -> str:
    return next(s for s in "AB" if r[s][0] == "active")


def _now() -> float:
    import time
    return time.monotonic()
