"""Nemesis: a broker pair, its shards and its clients, each on a host of its own (network
namespaces, bench/hosts_net.py), while a seeded fault loop partitions the network, cuts links,
kills and freezes processes, and heals; afterwards the ledger says what became of every push.

Hosts: brokers ``a`` and ``b`` (``--peer`` each other, ``--replicas 2``), shards ``s0`` and
``s1`` (both brokers' URLs), clients ``c0`` and ``c1`` (bench/ledger_child.py: each pushes
``acks="all"`` one-hot rows of one shared ledger tensor, SGD lr 1, into rows of its own). Each
round injects one fault, for 1-4 s, then heals it (every rule removed, a frozen process
continued, a killed one started again with its command line) and waits for the pair to settle
(one broker acting, both shards live, no partition under-replicated) before the next:

    partition   the six hosts cut into two random sides (each side at least one host)
    link        the link between two random hosts cut
    kill        SIGKILL of a random broker or shard
    stop        SIGSTOP of a random broker or shard

At the end: everything healed, the clients stopped (their answers waited for), the ledger read
from the active broker. ``-ledger[j]`` is how many times row ``j`` was applied, so exactly:

    lost            acknowledged, applied 0 times (must be 0)
    applied_twice   applied more than once (must be 0)
    applied_unsent  applied, never sent (must be 0)

One JSON line: faults injected by kind, rounds that did not settle, pushes sent and acked, the
three counts above, whether the copies are identical and the pair has one acting broker, and
the longest stretch with no ack anywhere (seconds). As root; exits 2 where namespaces cannot
be made.

Usage: python bench/nemesis.py [--seconds 60 | --minutes M] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import hosts_net

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "ledger_child.py")
PORT, PAIR_PORT = 5555, 5560
ROWS = 1 << 15            # rows per client
NAMES = ["a", "b", "s0", "s1", "c0", "c1"]
KINDS = ("partition", "link", "kill", "stop")
SETTLE_S = 60.0


class Run:
    def __init__(self, hosts: hosts_net.Hosts, out: str):
        self.hosts, self.out = hosts, out
        self.ns = dict(zip(NAMES, hosts.workers))
        self.addr = {n: hosts.worker_addr(i) for i, n in enumerate(NAMES)}
        self.url = {b: f"tcp://{self.addr[b]}:{PORT}" for b in "ab"}
        self.both = f"{self.url['a']},{self.url['b']}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.rules: list[tuple[str, list]] = []      # (host, iptables rule) in force
        self.stopped: set = set()
        self.killed: set = set()

    def command(self, name: str) -> list:
        if name in "ab":
            o = "b" if name == "a" else "a"
            return ["-m", "gradbus", "broker", "--host", self.addr[name], "--port", PORT,
                    "--peer", f"tcp://{self.addr[o]}:{PAIR_PORT}", "--peer-port", PAIR_PORT,
                    "--replicas", 2, "--no-shm"]
        if name.startswith("s"):
            return ["-m", "gradbus", "shard", "--broker", self.both, "--id", name, "--no-shm"]
        i = int(name[1:])
        return [CHILD, "push", self.both, i * ROWS, ROWS, os.path.join(self.out, name)]

    def start(self, name: str) -> None:
        with open(os.path.join(self.out, f"{name}.log"), "a") as err:
            self.procs[name] = subprocess.Popen(
                [*self.hosts.exec_prefix(self.ns[name]), sys.executable,
                 *map(str, self.command(name))],
                stdout=subprocess.PIPE if name.startswith("c") else subprocess.DEVNULL,
                stderr=err, text=True, preexec_fn=hosts_net._die_with_parent)

    def ask(self, name: str, *args) -> object:
        """bench/ledger_child.py's answer, asked from host ``name``."""
        done = subprocess.run([*self.hosts.exec_prefix(self.ns[name]), sys.executable, CHILD,
                               *map(str, args)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return f"error: {done.stderr.strip()[-300:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    def roles(self) -> dict:
        return {b: self.ask(b, "role", self.url[b]) for b in "ab"}

    def settled(self) -> dict | None:
        """One broker acting with both shards and nothing under-replicated, the other its
        standby hearing it: the roles, else None."""
        r = self.roles()
        if not all(isinstance(v, list) for v in r.values()):
            return None
        acting = [v for v in r.values() if v[0] == "active" and v[3] and v[4] == 2
                  and v[5] == 0 and v[2] == "standby"]
        standby = [v for v in r.values() if v[0] == "standby" and v[2] == "active"]
        return r if len(acting) == 1 and len(standby) == 1 else None

    def wait_settled(self, timeout: float = SETTLE_S) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.settled():
                return True
        return False

    # -- faults -------------------------------------------------------------------------------
    def drop(self, x: str, y: str) -> None:
        """Every packet between hosts x and y dropped (both ways, by rules in x)."""
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            rule = [chain, flag, self.addr[y], "-j", "DROP"]
            hosts_net.run(*self.hosts.exec_prefix(self.ns[x]), "iptables", "-A", *rule)
            self.rules.append((x, rule))

    def inject(self, kind: str, rng: random.Random) -> str:
        if kind == "partition":
            names = NAMES[:]
            rng.shuffle(names)
            cut = rng.randint(1, len(names) - 1)
            side, other = names[:cut], names[cut:]
            for x in side:
                for y in other:
                    self.drop(x, y)
            return f"{sorted(side)} | {sorted(other)}"
        if kind == "link":
            x, y = rng.sample(NAMES, 2)
            self.drop(x, y)
            return f"{x} - {y}"
        name = rng.choice(["a", "b", "s0", "s1"])
        if kind == "kill":
            self.procs[name].kill()
            self.procs[name].wait()
            self.killed.add(name)
        else:
            self.procs[name].send_signal(signal.SIGSTOP)
            self.stopped.add(name)
        return name

    def heal(self) -> None:
        while self.rules:
            x, rule = self.rules.pop()
            hosts_net.run(*self.hosts.exec_prefix(self.ns[x]), "iptables", "-D", *rule,
                          check=False)
        for name in sorted(self.stopped):
            self.procs[name].send_signal(signal.SIGCONT)
        self.stopped.clear()
        for name in sorted(self.killed):
            self.start(name)
        self.killed.clear()

    def end(self) -> None:
        self.heal()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def longest_gap(times: list[float]) -> float:
    times = sorted(times)
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def run(seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    hosts_net.sweep()
    hosts = hosts_net.Hosts(len(NAMES), "1gbit", "1gbit")
    faults: Counter = Counter()
    unsettled = 0
    with tempfile.TemporaryDirectory(prefix="nemesis") as out:
        r = Run(hosts, out)
        try:
            hosts.build()
            for name in ("a", "b", "s0", "s1"):
                r.start(name)
            if not r.wait_settled():
                raise RuntimeError(f"the pair never settled: {r.roles()}")
            got = r.ask("c0", "init", r.both, 2 * ROWS)
            if not isinstance(got, dict):
                raise RuntimeError(f"init: {got}")
            r.start("c0")
            r.start("c1")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                kind = rng.choice(KINDS)
                r.inject(kind, rng)
                faults[kind] += 1
                hold = time.monotonic() + rng.uniform(1.0, 4.0)
                while time.monotonic() < hold:       # the fault's length
                    time.sleep(0.05)
                r.heal()
                unsettled += not r.wait_settled()
            for c in ("c0", "c1"):
                open(os.path.join(out, f"{c}.stop"), "w").close()
            outs = {}
            for c in ("c0", "c1"):
                text, _ = r.procs[c].communicate(timeout=180)
                outs[c] = json.loads(text.strip().splitlines()[-1])
            r.wait_settled()
            final = r.roles()
            active = next((b for b, v in final.items() if isinstance(v, list)
                           and v[0] == "active"), "a")
            ledger = r.ask(active, "ledger", r.both)
        finally:
            r.end()
            hosts.close()
    w = {int(j): v for j, v in ledger["w"].items()}
    acked, sent, times = set(), set(), []
    for i, c in enumerate(("c0", "c1")):
        acked |= {int(j) for j in outs[c]["acked"]}
        sent |= set(range(i * ROWS, i * ROWS + outs[c]["sent"]))
        times += list(outs[c]["acked"].values())
    copies = ledger["copies"].values()
    return {"seed": seed, "seconds": seconds, "faults": dict(faults), "unsettled": unsettled,
            "sent": len(sent), "acked": len(acked),
            "lost": sum(1 for j in acked if w.get(j, 0.0) == 0.0),
            "applied_twice": sum(1 for v in w.values() if v < -1.0),
            "applied_unsent": sum(1 for j in w if j not in sent),
            "replicas_identical": bool(copies) and all(len(c) == 2 and c[0] == c[1]
                                                         for c in copies),
            "one_active": sorted(v[0] for v in final.values() if isinstance(v, list))
            == ["active", "standby"],
            "longest_no_ack_s": round(longest_gap(times), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    why = hosts_net.cut_permitted()
    if why:
        print(f"nemesis: {why}", file=sys.stderr)
        sys.exit(2)
    seconds = a.minutes * 60 if a.minutes is not None else a.seconds
    print(json.dumps(run(seconds, a.seed)), flush=True)


if __name__ == "__main__":
    main()
