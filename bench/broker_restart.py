"""How soon clients are served again after the broker is killed and restarted, with CPU hogs.

The documented restartable broker (``gradbus broker`` with pinned ``--backend-port`` and
``--events-port``, ``--replicas 2``), two ``gradbus shard --data-dir`` processes, and two SDK
client processes pushing ``acks="all"`` without pause, each with its window of pushes in
flight. ``--hogs`` busy-loop processes run beside them the whole time (a loaded machine). Each
round SIGKILLs the broker and starts it again ``--pause`` seconds later with the same command
line (run by a process that did its imports before the kill: the figures are the cluster's
reaction, not an interpreter's start-up on a loaded machine). Times are wall-clock
(``time.time``), one clock for every process of the host:

    listen_s        kill -> the new broker says it listens
    registered_s    kill -> the last shard registered with it (the broker's own log line)
    first_ack_s     registered -> the later of the two clients' first ack from the new broker
    blocked_s       the longest a client's ``push()`` call blocked (waiting for credit)
    resends         pushes the clients' resend timers sent again (after no answer for a while)
    restart_resends pushes sent again at once when a client heard the restarted broker
    table_retries   pushes refused RECOVERING, sent again when a shard registered
    recovering_retries  pushes the restarted broker refused RECOVERING

One JSON line per ``--hogs`` value: per round and the maximum over rounds, with the clients'
pushes sent and acknowledged, and the exact count each push was applied (a one-hot ledger
tensor per client: ``lost`` acknowledged and applied 0 times, ``duplicates`` more than once).

Usage: python bench/broker_restart.py [--hogs 0 2] [--rounds 3] [--pause 0.5] [--liveness N]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import gradbus
from gradbus import admin
from gradbus.cluster import end_processes, free_ports

LEDGER = 1 << 15          # pushes per client the ledger counts (and the most it pushes)
N = 4096                  # floats of the pushed tensor
CLIENT = r"""
import json, sys, threading, time
import numpy as np
import gradbus
url, index, ledger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
STATS = ("resends", "restart_resends", "table_retries", "recovering_retries", "broker_restarts")
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
records, lock = [], threading.Lock()
with gradbus.connect(url, block_bytes=1 << 14, timeout=120) as c:
    g = np.ones(4096, np.float32)
    c.pull(["w", f"ledger{index}"])          # the layouts known before the first restart
    print("ready", flush=True)
    i = 0
    while not stop.is_set() and i < ledger:
        row = np.zeros(ledger, np.float32)
        row[i] = 1.0
        t0 = time.time()
        fut = c.push({"w": g, f"ledger{index}": row}, acks="all")
        rec = [i, t0, time.time(), None, None, None]
        def done(f, rec=rec):
            rec[3] = time.time()
            e = f.exception()
            rec[4] = e is None or getattr(e, "code", type(e).__name__)
            rec[5] = c.url          # the broker that answered (of a pair: the one it is on)
        fut.add_done_callback(done)
        records.append(rec)
        i += 1
    c.flush(120)
    print(json.dumps({"records": records, "stats": {k: c.stats.get(k, 0) for k in STATS}}),
          flush=True)
"""
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"   # ends with us
# a broker process with everything imported, started before the kill, that runs the broker
# command line when told: what is measured is the clients' and shards' reaction to the broker's
# return, not how long a loaded machine takes to start an interpreter
SPARE = ("import sys\nfrom gradbus.cli import main\nimport gradbus.broker.server\n"
         "print('spare', flush=True)\nsys.stdin.readline()\nmain(sys.argv[1:])")


def _stamp(line: str) -> float | None:
    """The wall-clock time of a log line ``2024-01-02 03:04:05,678 ...``."""
    try:
        t = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return t.timestamp()


class Broker:
    def __init__(self, ports, data, hb: list[str]):
        self.port, self.backend, self.events = ports
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.args = ["broker", "-v", "--port", str(self.port), "--backend-port",
                     str(self.backend), "--events-port", str(self.events), "--replicas", "2",
                     *hb]
        self.proc = self.spare = None
        self.registered: list[float] = []     # when a shard registered (its log line)

    def ready_spare(self) -> None:
        self.spare = subprocess.Popen([sys.executable, "-c", SPARE, *self.args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        if self.spare.stdout.readline().strip() != "spare":
            raise RuntimeError("the spare broker process did not start")

    def start(self) -> float:
        """Tell the spare to run the broker command line; when it listens."""
        self.registered = []
        self.proc, self.spare = self.spare, None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()
        line = self.proc.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"broker said {line!r}")
        t = time.time()
        threading.Thread(target=self._read, args=(self.proc, self.registered),
                         daemon=True).start()
        return t

    @staticmethod
    def _read(proc, registered):
        for line in proc.stderr:
            if " registered" in line and "gradbus.broker" in line:
                t = _stamp(line)
                if t is not None:
                    registered.append(t)

    def kill(self) -> float:
        self.proc.kill()
        t = time.time()
        self.proc.wait()
        self.proc.stdout.close()
        return t


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.02)


def ledger_counts(outs: list, ledgers: list) -> dict:
    """What the clients' records and their ledgers say: pushes sent, acknowledged and failed
    (by code), acknowledged ones applied 0 times (``lost``), ones applied more than once
    (``duplicates``), and the clients' counters summed."""
    sent = [len(o["records"]) for o in outs]
    acked = [sum(1 for r in o["records"] if r[4] is True) for o in outs]
    failed: dict = {}
    for o in outs:
        for r in o["records"]:
            if r[4] is not True:
                failed[str(r[4])] = failed.get(str(r[4]), 0) + 1
    lost = dup = 0
    for o, ledger in zip(outs, ledgers):
        applied = np.rint(-ledger[:len(o["records"])]).astype(int)
        lost += sum(1 for r, n in zip(o["records"], applied) if r[4] is True and n == 0)
        dup += int((applied > 1).sum())
    return {"pushes_sent": sum(sent), "pushes_acked": sum(acked), "pushes_failed": failed,
            "lost": lost, "duplicates": dup,
            **{k: sum(o["stats"][k] for o in outs) for k in outs[0]["stats"]}}


def start_clients(url: str, clients: list, n: int = 2, ledger: int = LEDGER) -> list:
    """``n`` CLIENT processes pushing to ``url`` (at most ``ledger`` pushes each), appended to
    ``clients`` as they start (ready: the layouts known)."""
    for i in range(n):
        p = subprocess.Popen([sys.executable, "-c", CLIENT, url, str(i), str(ledger)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        clients.append(p)
        assert p.stdout.readline().strip() == "ready"
    return clients


def end_clients(clients: list) -> list:
    """Tell the CLIENT processes to stop; their records and counters."""
    outs = []
    for p in clients:
        p.stdin.close()
        outs.append(json.loads(p.stdout.readline()))
        p.wait(60)
        p.stdout.close()
    return outs


def init_ledgers(url: str, n: int = 2, ledger: int = LEDGER) -> None:
    with gradbus.connect(url, timeout=60) as c:
        c.init({"w": np.zeros(N, np.float32),
                **{f"ledger{i}": np.zeros(ledger, np.float32) for i in range(n)}},
               optimizer=gradbus.SGD(lr=1.0))
    _wait(lambda: admin.status(url)["under_replicated"] == 0, 60, "replicas")


def read_ledgers(url: str, n: int = 2) -> list:
    with gradbus.connect(url, timeout=60) as c:    # a fresh snapshot from the primaries
        return [c.pull([f"ledger{i}"])[f"ledger{i}"].copy() for i in range(n)]


def run(hogs: int, rounds: int, pause: float, settle: float, liveness: int | None) -> dict:
    data = tempfile.mkdtemp(prefix="gradbus-restart-")
    hb = ["--liveness", str(liveness)] if liveness else []
    broker = Broker(free_ports(3), data, hb)
    url = broker.url
    procs: list = []
    hog_procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    clients = []
    try:
        broker.ready_spare()
        broker.start()
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gradbus", "shard", "--broker", url, "--id", f"s{i}",
                 "--data-dir", os.path.join(data, f"s{i}"), *hb],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: len(broker.registered) >= 2, 60, "2 shards")
        init_ledgers(url)
        start_clients(url, clients)
        time.sleep(settle)
        marks = []
        for _ in range(rounds):
            broker.ready_spare()         # its imports done before the kill
            time.sleep(settle)
            t_kill = broker.kill()
            time.sleep(pause)
            t_listen = broker.start()
            _wait(lambda: len(broker.registered) >= 2, 60, "the shards to register again")
            marks.append((t_kill, t_listen, max(broker.registered[:2])))
            time.sleep(settle)
        outs = end_clients(clients)
        ledgers = read_ledgers(url)
    finally:
        end_processes([*procs, broker.proc, broker.spare, *hog_procs, *clients], 10)
    per_round = []
    for t_kill, t_listen, t_reg in marks:
        # the first ack each client got from the new broker (nothing is acknowledged between
        # the kill and the listen: acks stamped there were in the old broker's last sends)
        firsts = [min((r[3] for r in o["records"] if r[3] is not None and r[4] is True
                       and r[3] > t_listen), default=None) for o in outs]
        blocked = max((r[2] - r[1] for o in outs for r in o["records"]
                       if r[1] < t_reg + settle and r[2] > t_kill - 1), default=None)
        per_round.append({
            "listen_s": round(t_listen - t_kill, 3), "registered_s": round(t_reg - t_kill, 3),
            "first_ack_s": None if None in firsts else round(max(firsts) - t_reg, 3),
            "blocked_s": None if blocked is None else round(blocked, 3)})
    firsts = [r["first_ack_s"] for r in per_round if r["first_ack_s"] is not None]
    return {"bench": "broker_restart", "hogs": hogs, "rounds": rounds, "pause_s": pause,
            "liveness": liveness, **ledger_counts(outs, ledgers),
            "first_ack_s_max": max(firsts) if firsts else None,
            "blocked_s_max": max((r["blocked_s"] for r in per_round
                                  if r["blocked_s"] is not None), default=None),
            "rounds_detail": per_round}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.5)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of pushing between "
                    "restarts")
    ap.add_argument("--liveness", type=int, default=None, help="broker and shard --liveness "
                    "(default: theirs, 4 heartbeats)")
    a = ap.parse_args()
    for hogs in a.hogs:
        print(json.dumps(run(hogs, a.rounds, a.pause, a.settle, a.liveness)), flush=True)


if __name__ == "__main__":
    main()
