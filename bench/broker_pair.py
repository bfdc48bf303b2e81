"""How soon a broker pair serves again after its active broker is SIGKILLed, and that nothing
is lost or applied twice over many kills (protocol section 23).

A broker pair (``LocalCluster(brokers=2)``: two ``gradbus broker --peer`` processes), two
shards with ``--replicas 2``, and two SDK client processes pushing ``acks="all"`` without pause
(bench/broker_restart.py's clients: each push also adds one to its own slot of a ledger
tensor, so the count each push was applied is read back exactly). Each of ``--kills`` rounds
SIGKILLs whichever broker is active, then starts the killed one again (it comes back as the
standby) before the next round: the kills alternate between the two. Wall-clock times, one
clock for every process of the host:

    takeover_s     kill -> the other broker says it is active
    first_ack_s    kill -> the first acknowledgement any client got through the other broker
    both_acked_s   kill -> the later of the two clients' first acknowledgement through it

One JSON line: each round, the median and maximum of each time, the pushes sent and
acknowledged, ``lost`` (acknowledged, applied 0 times) and ``duplicates`` (applied more than
once), the shared tensor's known answer (``exact``: every weight is minus the number of
pushes applied), and whether the replicas of every partition hold the same bytes.

Usage: python bench/broker_pair.py [--kills 10] [--settle 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from broker_restart import (
    _wait,
    end_clients,
    init_ledgers,
    ledger_counts,
    read_ledgers,
    start_clients,
)

import gradbus
from gradbus import admin
from gradbus.cluster import LocalCluster, end_processes
from gradbus.codecs.errors import GradbusError


def role(cluster: LocalCluster, name: str):
    try:
        return admin.status(cluster.broker_url(name), timeout=1.0)["pair"]["role"]
    except GradbusError:
        return None


def replicas_identical(url: str) -> bool:
    _wait(lambda: admin.status(url)["under_replicated"] == 0, 60, "full replication")
    by_p: dict = {}
    for parts in admin.digest(url, timeout=30).values():
        for p, seq_digest in parts.items():
            by_p.setdefault(p, set()).add(tuple(seq_digest))
    return bool(by_p) and all(len(v) == 1 for v in by_p.values())


LEDGER = 1 << 17        # pushes per client at most: more than 10 rounds of pushing take


def run(kills: int, settle: float) -> dict:
    cluster = LocalCluster(2, brokers=2, replicas=2).start()
    clients: list = []
    rounds = []
    try:
        url = cluster.url
        init_ledgers(url, ledger=LEDGER)
        start_clients(url, clients, ledger=LEDGER)
        for _ in range(kills):
            time.sleep(settle)
            active = next(n for n in cluster.broker_names if role(cluster, n) == "active")
            other = next(n for n in cluster.broker_names if n != active)
            proc = cluster.broker_procs[active]
            proc.kill()
            t_kill = time.time()
            _wait(lambda o=other: role(cluster, o) == "active", 30, "a take-over")
            t_active = time.time()
            proc.wait()
            cluster.start_broker(active)
            _wait(lambda a=active: role(cluster, a) == "standby", 30, "the standby back")
            rounds.append({"kill": t_kill, "takeover_s": round(t_active - t_kill, 3),
                           "to": cluster.broker_url(other)})
        time.sleep(settle)
        outs = end_clients(clients)
        clients = []
        ledgers = read_ledgers(url)
        with gradbus.connect(url, timeout=60) as c:
            w = c.pull(["w"], timeout=60)["w"]
        identical = replicas_identical(url)
    finally:
        end_processes(clients, 10)
        cluster.stop()
    counts = ledger_counts(outs, ledgers)
    applied = int(round(sum(float(-ledger.sum()) for ledger in ledgers)))
    for r in rounds:
        firsts = [min((rec[3] for rec in o["records"] if rec[4] is True and rec[3] > r["kill"]
                       and rec[5] == r["to"]), default=None) for o in outs]
        got = [f for f in firsts if f is not None]
        r["first_ack_s"] = round(min(got) - r["kill"], 3) if got else None
        r["both_acked_s"] = round(max(got) - r["kill"], 3) if len(got) == len(firsts) else None
        del r["kill"], r["to"]

    def stat(key):
        xs = [r[key] for r in rounds if r[key] is not None]
        return {f"{key}_median": round(statistics.median(xs), 3) if xs else None,
                f"{key}_max": max(xs) if xs else None}
    idle = sum(1 for r in rounds if r["both_acked_s"] is None)
    return {"bench": "broker_pair", "kills": kills,
            "rounds_without_both_clients": idle,      # a client had stopped (its ledger full)
            **stat("takeover_s"),
            **stat("first_ack_s"), **stat("both_acked_s"), **counts,
            "applied": applied, "exact": bool(np.all(w == -applied)),
            "replicas_identical": identical, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds of pushing between kills")
    a = ap.parse_args()
    print(json.dumps(run(a.kills, a.settle)), flush=True)


if __name__ == "__main__":
    main()
