"""What docker/monitoring_check.py and the tests share: the series names the dashboard and the
alert rules use and those a process exports, a small client of Prometheus's HTTP API, the test
variant of the local Prometheus configuration, and the processes' plumbing (free ports,
waiting on a condition, finding a shard's process under ``gradbus up``, stopping what was
started)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from gradbus.cluster import free_ports

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "dashboards" / "gradbus.json"
RULES = HERE / "alerts.yml"
LOCAL = HERE / "prometheus-local.yml"
NAME = re.compile(r"\bgradbus_[a-z0-9_]+")

# -- names: the dashboard's, the rules', the processes' -----------------------------------------

def dashboard_names(path: Path = DASHBOARD) -> set[str]:
    """Every gradbus series name the dashboard's queries use."""
    out: set[str] = set()

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.update(NAME.findall(t.get("expr", "")))
            walk(p.get("panels", []))
    walk(json.loads(path.read_text())["panels"])
    return out


def rules(path: Path = RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def rule_names(path: Path = RULES) -> set[str]:
    return {n for r in rules(path) for n in NAME.findall(r["expr"])}


def exported_names(text: str) -> set[str]:
    """The sample names an exposition declares (its TYPE lines), samples or not: counters with
    _total, histograms with _bucket, _sum and _count."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    out = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = m.groups()
        base = name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name
        out.update(base + s for s in suffixes.get(kind, ("",)))
    return out


# -- plumbing -----------------------------------------------------------------------------------

def free_port() -> int:
    return free_ports(1)[0]


def free_run(n: int) -> int:
    """A port P with P .. P+n-1 free now."""
    for _ in range(200):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            socks = []
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    return json.loads(body) if body[:1] in "{[" else body


def wait(cond, timeout: float, what: str, every: float = 0.25):
    """Poll ``cond`` until it returns something truthy; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            got = cond()
            if got:
                return got
        except OSError as e:       # not answering yet
            last = e
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:g}s" + (f" ({last})" if last else ""))


class Prom:
    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params):
        q = urllib.parse.urlencode(params)
        got = get(f"{self.url}/api/v1/{path}" + (f"?{q}" if q else ""))
        if got.get("status") != "success":
            raise RuntimeError(f"{path}: {got}")
        return got["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def total(self, expr: str) -> float | None:
        r = self.query(f"sum({expr})")
        return float(r[0]["value"][1]) if r else None

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def samples(self, expr: str, seconds: float) -> list[tuple[float, dict]]:
        """Raw samples of ``expr`` (a selector) over the last ``seconds``: (time, labels)."""
        out = []
        for s in self.query(f"{expr}[{int(seconds) + 1}s]"):
            out += [(float(t), s["metric"]) for t, _ in s["values"]]
        return sorted(out, key=lambda x: x[0])


def children(pid: int) -> dict[int, str]:
    """The child processes of ``pid``: pid -> command line."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    out[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    return out


def shard_pid(up_pid: int, shard: str) -> int:
    for pid, cmd in children(up_pid).items():
        args = cmd.split()
        if "shard" in args and "--id" in args and args[args.index("--id") + 1] == shard:
            return pid
    raise RuntimeError(f"no process of {shard} under gradbus up ({up_pid})")


# -- configuration of the test variant ------------------------------------------------------------

def write_config(work: Path, metrics_base: int, shards: int, worker_port: int, am_port: int,
                 scrape: float, for_s: float) -> dict:
    """prometheus-local.yml with its targets on the cluster's ports, and alerts.yml with every
    ``for:`` set to ``for_s``, in ``work``. Returns the config."""
    cfg = yaml.safe_load(LOCAL.read_text())
    g = cfg["global"]
    g["scrape_interval"] = g["scrape_timeout"] = g["evaluation_interval"] = f"{scrape:g}s"
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
        f"127.0.0.1:{am_port}"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["gradbus-broker"]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_base}"]
    jobs["gradbus-shard"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{metrics_base + 1 + i}"],
         "labels": {"role": "shard", "shard": f"shard-{i}"}} for i in range(shards)]
    jobs["gradbus-worker"]["static_configs"][0]["targets"] = [f"127.0.0.1:{worker_port}"]
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for r in group["rules"]:
            if "for" in r:
                r["for"] = f"{for_s:g}s"
    (work / "alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def start(args: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "wb")
    try:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)
    finally:
        f.close()


def end(proc: subprocess.Popen | None, timeout: float = 20.0) -> int | None:
    """SIGTERM, then SIGKILL of its process group if it did not exit in ``timeout``."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        return proc.wait(10)
