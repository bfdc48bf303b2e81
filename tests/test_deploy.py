"""The deployment files: docker/Dockerfile, .dockerignore, docker/docker-compose.yml, docker/.env,
docker/prometheus.yml, docker/grafana/ and docker/k8s/ (the alert rules and the Alertmanager's
configuration are checked by Prometheus's own tools in tests/test_alerts.py).

No container runs here. Each file is parsed and checked against the code:

* every command line a container runs (its command or args, its healthcheck or probes) is a
  valid ``gradbus`` command line: the real click parser resolves it down to the leaf command,
  with the environment the container sets (``GRADBUS_*`` variables feed options), and the
  values it ends up with (ports, URLs, key paths) are what the other checks compare;
* every ``GRADBUS_*`` variable set is one gradbus reads;
* the ports line up: what the broker binds, what it publishes or its Service exposes, the URL
  shards and workers connect to, the metrics ports Prometheus scrapes;
* CURVE: every process has a whole key pair from a mounted secret, the broker's allow
  directory holds the public key of each of them, and each holds the broker's public key;
* the image: multi-stage, slim base, ``ENTRYPOINT ["gradbus"]`` (the console script),
  a non-root user, a healthcheck that is a gradbus command line, no compiler installed, and
  nothing only BuildKit understands (no ``# syntax=`` directive, no ``RUN --mount``), so the
  classic builder builds it too, with no registry;
* the compose file runs on Compose 1.29 (no top-level ``name``; the project name is in
  docker/.env) and v2;
* Prometheus, Alertmanager and Grafana are the optional profile ``monitoring``, with the
  same files: the rules mounted beside prometheus.yml, alerts sent to the alertmanager service;
* the Grafana dashboard queries only metrics the scraped processes export.

Paths in command lines. Parsing opens one file: ``--config`` (click checks that it exists,
then the option's callback loads and validates it into the command's defaults). Key files, the
allow directory and the data directory are only opened when a command runs. So each line is
parsed with its config mount mapped to what it mounts (compose's bind mount of
./gradbus.toml to docker/gradbus.toml, the ConfigMap to a temporary file holding its content),
which also makes the file's values take part in the checks, and every other path is left as
it is: it need not exist here.

Each check returns a list of problems; the tests assert it is empty for the real files, and
that it is not for a broken copy.
"""
from __future__ import annotations

import configparser
import copy
import dataclasses
import fnmatch
import importlib
import json
import os
import pathlib
import posixpath
import re
import shlex
import shutil
import subprocess
from unittest import mock

import click
import pytest

from gradbus import cli, config, metrics
from gradbus.broker.core import BrokerCore
from gradbus.codecs import net
from gradbus.shards.core import ShardCore
from gradbus.shards.meters import ShardMeters
from gradbus.shards.shm_io import ShardShm

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
COMPOSE = DOCKER / "docker-compose.yml"
DOCKERFILE = DOCKER / "Dockerfile"
PROMETHEUS = DOCKER / "prometheus.yml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "gradbus.json"
PROVISIONING = DOCKER / "grafana" / "provisioning"
#: words that name a compiler or build tool, not to be installed in the final image
COMPILERS = {"gcc", "g++", "cc", "c++", "clang", "make", "cmake", "build-essential",
             "gfortran", "libc6-dev", "python3-dev", "cython"}
LOCAL = {"127.0.0.1", "localhost"}


def load_yaml(path: pathlib.Path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_yaml_all(path: pathlib.Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


# -- the CLI ---------------------------------------------------------------------------------

def _leftover(ctx: click.Context) -> list[str]:
    # What a group left for its subcommand (click 8.2 renamed protected_args; the old public
    # name now warns).
    protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
    return [*protected, *ctx.args]


def parse_cli(args: list[str], environ: dict | None = None) -> click.Context:
    """The leaf command's context of ``gradbus ARGS`` with ``environ`` as the only GRADBUS_*
    variables; raises a :class:`click.ClickException` for a line gradbus would refuse."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADBUS_")}
    env.update(environ or {})
    with mock.patch.dict(os.environ, env, clear=True):
        ctx = cli.main.make_context("gradbus", list(args))
        while isinstance(ctx.command, click.Group):
            rest = _leftover(ctx)
            if not rest:
                if ctx.command.invoke_without_command:
                    break
                raise click.UsageError("missing command", ctx)
            name, cmd, rest = ctx.command.resolve_command(ctx, rest)
            ctx = cmd.make_context(name, rest, parent=ctx)
    return ctx


def console_script() -> tuple[str, str]:
    """``(name, target)`` of the console script setup.cfg declares."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [ln for ln in cfg["options.entry_points"]["console_scripts"].splitlines() if ln]
    assert len(lines) == 1, lines
    name, target = (s.strip() for s in lines[0].split("=", 1))
    return name, target


def known_env() -> set[str]:
    """The GRADBUS_* variables gradbus reads: every setting's variables and GRADBUS_CONFIG,
    and the names quoted in the sources that read the environment."""
    names = {config.CONFIG_ENVVAR} | {v for s in config.SETTINGS for v in s.envvars}
    for pkg in ("gradbus", "broker", "shards", "workers", "codecs"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "environ" in text:
                names |= set(re.findall(r"[\"'](GRADBUS_[A-Z0-9_]+)[\"']", text))
    return names


@dataclasses.dataclass
class Proc:
    """One command line a container runs, parsed."""

    where: str                    # for messages: "compose broker command"
    service: str                  # compose service or k8s workload
    args: list
    env: dict
    files: dict                   # container path -> key file name, from mounted secrets
    ctx: click.Context | None = None
    error: str | None = None

    @property
    def command(self) -> str | None:
        return self.ctx.command.name if self.ctx else None

    @property
    def params(self) -> dict:
        return self.ctx.params if self.ctx else {}

    def curve(self) -> tuple:
        """``(secret, server_key, allow)``: from the options, else from the variables the SDK
        reads (``gradbus worker`` has no CURVE options)."""
        p = self.params
        if "curve_secret" in p:
            return p["curve_secret"], p.get("curve_server_key"), p.get("curve_allow")
        return (self.env.get("GRADBUS_SECURITY_CURVE_SECRET"),
                self.env.get("GRADBUS_SECURITY_CURVE_SERVER_KEY"), None)


def _mapped(value: str, mounts: dict) -> str:
    for target, source in mounts.items():
        if value == target or value.startswith(target.rstrip("/") + "/"):
            return str(source) + value[len(target):]
    return value


def make_proc(where: str, service: str, args, env: dict, mounts: dict, files: dict) -> Proc:
    """Parse ``args`` (after the ``gradbus`` entrypoint) with the container's ``env``; config
    paths under ``mounts`` (container path -> host path) are read from the host path."""
    proc = Proc(where, service, args, env, files)
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        proc.error = f"not a list of strings: {args!r}"
        return proc
    host_args = []
    for a in args:
        opt, eq, val = a.partition("=")
        host_args.append(opt + eq + _mapped(val, mounts) if a.startswith("--") and eq
                         else _mapped(a, mounts))
    host_env = {k: _mapped(v, mounts) for k, v in env.items()}
    try:
        proc.ctx = parse_cli(host_args, host_env)
    except click.ClickException as e:
        proc.error = f"gradbus {' '.join(args)}: {e.format_message()}"
    return proc


def check_parsed(procs: list[Proc]) -> list[str]:
    return [f"{p.where}: {p.error}" for p in procs if p.error]


def check_env(envs: list[tuple[str, dict]]) -> list[str]:
    known = known_env()
    return [f"{where}: {name} is not a variable gradbus reads"
            for where, env in envs for name in env
            if name.startswith("GRADBUS_") and name not in known]


def check_curve(procs: list[Proc]) -> list[str]:
    """Every process has a whole key pair from a mounted secret; the broker's allow directory
    holds each one's public key; each holds the broker's public key. The brokers of a pair
    hold one key pair, and each admits every process."""
    out = []
    brokers = [p for p in procs if p.command == "broker"]
    if len(brokers) not in (1, 2):
        return [f"expected one broker command, or a pair's two, got {len(brokers)}"]
    keys = set()
    for b in brokers:
        secret, _, allow = b.curve()
        if not (secret and allow):
            return [f"{b.where}: CURVE is not on (--curve-secret and --curve-allow)"]
        b_secret = b.files.get(secret, "")
        if not b_secret.endswith(".key_secret"):
            return [f"{b.where}: {secret} is not a mounted NAME.key_secret"]
        keys.add(b_secret)
        out += _check_admitted(procs, b, allow, b_secret[:-len("_secret")])
    if len(keys) != 1:
        out.append(f"the brokers of the pair hold different key pairs: {sorted(keys)}")
    return out


def _check_admitted(procs: list[Proc], b: Proc, allow: str, b_public: str) -> list[str]:
    out = []
    allowed = {name for path, name in b.files.items() if posixpath.dirname(path) == allow}
    for p in procs:
        if p.command == "broker" or p.ctx is None:
            continue
        secret, server, _ = p.curve()
        if not (secret and server):
            out.append(f"{p.where}: no whole CURVE key pair (secret {secret}, server {server})")
            continue
        mine = p.files.get(secret, "")
        if not mine.endswith(".key_secret"):
            out.append(f"{p.where}: {secret} is not a mounted NAME.key_secret")
        elif mine[:-len("_secret")] not in allowed:
            out.append(f"{p.where}: the public key of {mine} is not in {b.service}'s allow "
                       f"directory {allow} ({sorted(allowed)})")
        if p.files.get(server) != b_public:
            out.append(f"{p.where}: server key {server} is {p.files.get(server)}, not the "
                       f"broker's {b_public}")
    return out


def check_broker_urls(procs: list[Proc], brokers: dict) -> list[str]:
    """Every process that connects (shards, workers, healthchecks) reaches the broker, or
    names both brokers of a pair; ``brokers``: each broker's service -> (host, client port).
    A broker's own healthcheck may ask it alone, on its loopback."""
    out = []
    want = set(brokers.values())
    for p in procs:
        url = p.params.get("broker_url")
        if p.ctx is None or p.command == "broker" or url is None:
            continue
        got = {net.split_url(u) for u in net.broker_urls(url)}
        own = brokers.get(p.service)
        if own is not None and len(got) == 1 and next(iter(got)) in {
                (h, own[1]) for h in LOCAL | {own[0]}}:
            continue
        if got != want:
            out.append(f"{p.where}: connects to {url}, the brokers are "
                       + ",".join(f"tcp://{h}:{port}" for h, port in sorted(want)))
    return out


def check_metrics_bind(procs: list[Proc]) -> list[str]:
    return [f"{p.where}: metrics on {p.params['metrics_host']}:{p.params['metrics_port']} "
            "(needs host 0.0.0.0 and a fixed port to be scraped)"
            for p in procs if p.params.get("metrics_port") is not None
            and (p.params["metrics_host"] != "0.0.0.0" or not p.params["metrics_port"])]


def check_broker_binds(b: Proc) -> list[str]:
    p = b.params
    out = [] if p["host"] == "0.0.0.0" else [f"{b.where}: binds {p['host']}, not 0.0.0.0"]
    out += [f"{b.where}: {k} is not pinned (0: a free port)"
            for k in ("port", "backend_port", "events_port") if not p[k]]
    return out


def main_lines(procs: list[Proc], suffix: str, pair: bool = False
               ) -> tuple[list[str], list[Proc], list[Proc]]:
    """Problems every cluster shares (lines that do not parse, metrics endpoints, the brokers'
    binds), the parsed main command lines (``where`` ends with ``suffix``) and the brokers'
    (one; with ``pair``, two that name each other as peers); no brokers when those are not
    there."""
    out = check_parsed(procs) + check_metrics_bind(procs)
    mains = [p for p in procs if p.where.endswith(suffix) and p.ctx]
    brokers = [p for p in mains if p.command == "broker"]
    if len(brokers) != (2 if pair else 1):
        return out + [f"expected {'two brokers' if pair else 'one broker'}, got "
                      f"{[p.service for p in brokers]}"], mains, []
    for b in brokers:
        out += check_broker_binds(b)
    if pair:
        for b, other in (brokers, brokers[::-1]):
            want = f"tcp://{other.service}:{other.params['peer_port']}"
            if b.params["peer"] != want or not other.params["peer_port"]:
                out.append(f"{b.where}: --peer {b.params['peer']}, the other broker's pair "
                           f"address is {want}")
        if len({b.params["replicas"] for b in brokers}) != 1:
            out.append("the brokers of the pair run with different --replicas")
    return out, mains, brokers


def check_shard_count(shards: int, b: Proc) -> list[str]:
    r = b.params["replicas"]
    return [] if r >= 2 and shards >= r + 1 else [
        f"{shards} shards for --replicas {r}: want replicas >= 2 and a shard more than that"]


def check_workers(workers: list[Proc]) -> list[str]:
    if not workers or any(p.ctx is None for p in workers):
        return ["no parsed worker"]
    n = {p.params["workers"] for p in workers}
    idx = sorted(p.params["index"] for p in workers)
    return [] if len(n) == 1 and idx == list(range(n.pop())) else [
        f"worker indexes {idx} do not cover --workers {[p.params['workers'] for p in workers]}"]


# -- Dockerfile --------------------------------------------------------------------------------

def parse_dockerfile(text: str) -> list[dict]:
    """Stages ``{"from", "name", "instr": [(KEYWORD, rest)]}``; continuation lines joined,
    comments dropped, ARGs declared before the first FROM substituted in FROM lines."""
    lines, buf = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        lines.append(buf + s)
        buf = ""
    if buf:
        lines.append(buf)
    args, stages = {}, []
    for line in lines:
        kw, _, rest = line.partition(" ")
        kw, rest = kw.upper(), rest.strip()
        if kw == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif kw == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), rest).split()
            stages.append({"from": words[0], "instr": [],
                           "name": words[2] if len(words) > 2 and words[1].upper() == "AS"
                           else None})
        elif not stages:
            raise ValueError(f"{kw} before FROM")
        else:
            stages[-1]["instr"].append((kw, rest))
    return stages


def _instr(stage: dict, kw: str) -> list[str]:
    return [rest for k, rest in stage["instr"] if k == kw]


def healthcheck_args(stage: dict) -> list[str] | None:
    """The final HEALTHCHECK's exec-form command, or None."""
    hc = _instr(stage, "HEALTHCHECK")
    if not hc:
        return None
    m = re.search(r"(?:^|\s)CMD\s+(\[.*\])\s*$", hc[-1])
    return json.loads(m.group(1)) if m else None


def check_dockerfile(text: str) -> list[str]:
    try:
        stages = parse_dockerfile(text)
    except ValueError as e:
        return [str(e)]
    out = []
    if len(stages) < 2:
        out.append(f"{len(stages)} stage(s): want a builder stage and a final stage")
    for st in stages:
        if not re.fullmatch(r"python:[\w.-]*slim[\w.-]*", st["from"]):
            out.append(f"FROM {st['from']}: want a python slim image")
    final = stages[-1]
    builders = {st["name"] for st in stages[:-1]}
    if not any("pip wheel" in r and ".[demo]" in r for st in stages[:-1]
               for r in _instr(st, "RUN")):
        out.append("no builder stage builds wheels of the project with the demo extra")
    # a builder installs gradbus[demo] from its wheels only into a virtual environment, which
    # the final stage copies whole to the same path and puts first on PATH
    envs = {v for st in stages[:-1] if st["name"] in builders for r in _instr(st, "RUN")
            for v in re.findall(r"-m venv (\S+)", r)
            if any(f"{v}/bin/pip install" in r and "--no-index" in r
                   and "--only-binary=:all:" in r and "gradbus[demo]" in r
                   for r in _instr(st, "RUN"))}
    copied = {v for c in _instr(final, "COPY") for b in builders for v in envs
              if c.split() == [f"--from={b}", v, v]}
    path = " ".join(_instr(final, "ENV"))
    if not any(re.search(rf"PATH={re.escape(v)}/bin[:\s]", path) for v in copied):
        out.append("the final stage does not copy a builder's environment holding gradbus[demo] "
                   "from the builder's wheels only (--no-index --only-binary=:all:) onto PATH")
    if any("pip install" in r for r in _instr(final, "RUN")):
        out.append("the final stage runs pip install: it copies the builder's environment")
    out += check_classic_builder(text, stages)
    for r in _instr(final, "RUN"):
        found = set(re.findall(r"[\w+.-]+", r)) & COMPILERS
        if found:
            out.append(f"the final stage installs or runs {sorted(found)}")
    users = _instr(final, "USER")
    user = users[-1].split(":")[0] if users else "root"
    if user in ("root", "0"):
        out.append(f"the final stage runs as {user}")
    entry = _instr(final, "ENTRYPOINT")
    name, target = console_script()
    try:
        entry_args = json.loads(entry[-1]) if entry else None
    except ValueError:
        entry_args = None
    if entry_args != [name]:
        out.append(f"ENTRYPOINT {entry[-1] if entry else None}: want [\"{name}\"] (exec form)")
    module, _, attr = target.partition(":")
    if getattr(importlib.import_module(module), attr) is not cli.main:
        out.append(f"console script {name} = {target} is not gradbus.cli.main")
    hc = healthcheck_args(final)
    if not hc or hc[0] != name:
        out.append(f"HEALTHCHECK {hc}: want an exec-form gradbus command")
    else:
        try:
            parse_cli(hc[1:])
        except click.ClickException as e:
            out.append(f"HEALTHCHECK {hc}: {e.format_message()}")
    if not _instr(final, "VOLUME"):
        out.append("no VOLUME for checkpoints")
    return out


#: the flags the classic builder knows, per instruction (every other one needs BuildKit)
CLASSIC_FLAGS = {"RUN": (), "COPY": ("--from=", "--chown="), "ADD": ("--chown=",),
                 "FROM": ("--platform=",)}


def check_classic_builder(text: str, stages: list[dict]) -> list[str]:
    """Nothing that only BuildKit understands: no ``# syntax=`` directive (BuildKit pulls that
    frontend image from a registry for every build), no ``RUN --mount`` or other RUN flags, no
    COPY/ADD flags but ``--from``/``--chown``, no heredocs."""
    out = []
    for line in text.splitlines():
        if not line.strip().startswith("#"):
            break                  # parser directives come before anything else
        if re.fullmatch(r"#\s*syntax\s*=.*", line.strip(), re.IGNORECASE):
            out.append(f"{line.strip()!r}: a frontend image to pull (BuildKit only)")
    for st in stages:
        for kw, rest in st["instr"]:
            if kw not in CLASSIC_FLAGS:
                continue
            flags = []
            for word in rest.split():
                if not word.startswith("--"):
                    break
                flags.append(word)
            bad = [f for f in flags if not f.startswith(CLASSIC_FLAGS[kw])]
            if bad:
                out.append(f"{kw} {' '.join(bad)}: not understood by the classic builder")
            if re.search(r"<<-?[\"']?\w+", rest) and kw != "FROM":
                out.append(f"{kw} with a heredoc: not understood by the classic builder")
    return out


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            out.append((neg, line.lstrip("!").strip("/")))
    return out


def dockerignored(rel: str, patterns) -> bool:
    """Whether the build context leaves out ``rel``: the last pattern matching it or one of
    its parent folders decides (``!`` keeps)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    out = False
    for neg, pat in patterns:
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            out = not neg
    return out


# -- compose -----------------------------------------------------------------------------------

def compose_env(svc: dict) -> dict:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def is_gradbus_service(svc: dict) -> bool:
    return "build" in svc or str(svc.get("image", "")).startswith("gradbus")


def compose_procs(doc: dict, image_health: list[str] | None) -> list[Proc]:
    """The command and the healthcheck (its own, else the image's ``image_health``) of every
    gradbus service."""
    procs = []
    secrets = doc.get("secrets") or {}
    for name, svc in doc["services"].items():
        if not is_gradbus_service(svc):
            continue
        mounts = {}
        for v in svc.get("volumes") or []:
            src, dst = v.split(":")[:2]
            if src.startswith((".", "/")):
                mounts[dst] = (DOCKER / src).resolve()
        files = {}
        for s in svc.get("secrets") or []:
            s = {"source": s} if isinstance(s, str) else s
            target = s.get("target", s["source"])
            target = target if target.startswith("/") else f"/run/secrets/{target}"
            files[target] = posixpath.basename(secrets.get(s["source"], {}).get("file", ""))
        env = compose_env(svc)
        if svc.get("entrypoint") not in (None, ["gradbus"]):
            procs.append(Proc(f"compose {name}", name, [], env, files,
                              error=f"entrypoint {svc['entrypoint']} is not gradbus"))
            continue
        procs.append(make_proc(f"compose {name} command", name, svc.get("command"), env,
                               mounts, files))
        hc = svc.get("healthcheck") or {}
        if hc.get("disable"):
            continue
        test = hc.get("test")
        if test is None:   # the image's HEALTHCHECK
            args = image_health[1:] if image_health and image_health[0] == "gradbus" \
                else f"not a gradbus command: {image_health!r}"
        elif isinstance(test, list) and test[:2] == ["CMD", "gradbus"]:
            args = test[2:]
        else:
            args = f"not a gradbus command: {test!r}"
        procs.append(make_proc(f"compose {name} healthcheck", name, args, env, mounts, files))
    return procs


def _published(spec) -> tuple[int, int]:
    if isinstance(spec, dict):
        return int(spec.get("published", spec["target"])), int(spec["target"])
    parts = str(spec).split("/")[0].split(":")
    return int(parts[-2] if len(parts) > 1 else parts[-1]), int(parts[-1])


def check_compose(doc: dict, procs: list[Proc], prom: dict) -> list[str]:
    """Ports, URLs, data volumes, replicas, workers and Prometheus targets of the compose
    cluster."""
    out, cmds, brokers = main_lines(procs, " command")
    if not brokers:
        return out
    b = brokers[0]
    bp = b.params
    out += check_broker_urls(procs, {b.service: (b.service, bp["port"])})
    # published ports keep their numbers: the broker tells clients its backend/events ports
    bound = {bp["port"], bp["backend_port"], bp["events_port"]}
    for spec in doc["services"][b.service].get("ports") or []:
        host, target = _published(spec)
        if target not in bound | {bp["metrics_port"]}:
            out.append(f"compose {b.service}: publishes {target}, which it does not bind")
        elif target in bound and host != target:
            out.append(f"compose {b.service}: publishes {target} as {host}; clients are "
                       "told the container's port numbers")
    # shards: distinct ids, each data dir on its own named volume
    shards = [p for p in cmds if p.command == "shard"]
    out += check_shard_count(len(shards), b)
    ids = [p.params["shard_id"] for p in shards]
    if None in ids or len(set(ids)) != len(ids):
        out.append(f"shard ids {ids}: want distinct fixed ids")
    named = set(doc.get("volumes") or {})
    seen = set()
    for p in shards:
        ddir = p.params["data_dir"]
        vols = [v.split(":")[0] for v in doc["services"][p.service].get("volumes") or []
                if v.split(":")[1:2] == [ddir]]
        if not ddir or len(vols) != 1 or vols[0] not in named or vols[0] in seen:
            out.append(f"compose {p.service}: data dir {ddir} is not on a named volume of "
                       "its own")
        seen.update(vols)
    out += check_workers([p for p in cmds if p.command == "worker"])
    # depends_on names services
    for name, svc in doc["services"].items():
        for dep in svc.get("depends_on") or []:
            if dep not in doc["services"]:
                out.append(f"compose {name}: depends on unknown service {dep}")
    # Prometheus scrapes every process with a metrics port, on that port
    scraped = {}
    for job in prom.get("scrape_configs") or []:
        for sc in job.get("static_configs") or []:
            for t in sc.get("targets") or []:
                host, _, port = t.rpartition(":")
                scraped[host] = int(port)
    for p in cmds:
        port = p.params.get("metrics_port")
        if port is not None and scraped.get(p.service) != port:
            out.append(f"prometheus.yml: {p.service} serves metrics on {port}, scraped on "
                       f"{scraped.get(p.service)}")
    services = {p.service: p for p in cmds}
    for host, port in scraped.items():
        p = services.get(host)
        if p is None or p.params.get("metrics_port") != port:
            out.append(f"prometheus.yml: target {host}:{port} is no gradbus service's "
                       "metrics port")
    return out


#: the top-level keys Compose 1.29 (Debian's docker-compose) accepts; Compose v2 accepts these
#: too (and ``name``, which 1.29 rejects)
COMPOSE_V1_TOP = {"version", "services", "networks", "volumes", "secrets", "configs"}
ENV_FILE = DOCKER / ".env"


def check_compose_versions(doc: dict, env_text: str) -> list[str]:
    """The compose file runs on Compose 1.29 and v2 alike, under the project name gradbus."""
    out = [f"top-level {k!r}: Compose 1.29 rejects it" for k in doc
           if k not in COMPOSE_V1_TOP and not k.startswith("x-")]
    if "name" in doc:
        out.append("the project name belongs in docker/.env (COMPOSE_PROJECT_NAME), which "
                   "both versions read")
    env = dict(line.split("=", 1) for line in env_text.splitlines()
               if line.strip() and not line.lstrip().startswith("#"))
    if env.get("COMPOSE_PROJECT_NAME") != "gradbus":
        out.append(f"docker/.env: COMPOSE_PROJECT_NAME is {env.get('COMPOSE_PROJECT_NAME')}, "
                   "not gradbus")
    return out


# -- the monitoring profile ------------------------------------------------------------------

MONITORING = {"prometheus", "alertmanager", "grafana"}


def _mounts(svc: dict) -> dict[str, str]:
    """A service's bind mounts of files in docker/: source -> path in the container."""
    return {v.split(":")[0]: v.split(":")[1] for v in svc.get("volumes") or []
            if v.startswith("./")}


def check_monitoring(doc: dict, prom: dict) -> list[str]:
    """Prometheus, Alertmanager and Grafana are the optional profile ``monitoring`` (the
    cluster runs without it), mount files that exist, and Prometheus finds its rules beside its
    configuration and sends alerts to the alertmanager service."""
    out = []
    svcs = doc["services"]
    for name, svc in svcs.items():
        prof = svc.get("profiles")
        if name in MONITORING and prof != ["monitoring"]:
            out.append(f"compose {name}: profiles {prof}, not [monitoring]")
        if name not in MONITORING and prof:
            out.append(f"compose {name}: in profiles {prof}; the cluster runs without one")
        for dep in svc.get("depends_on") or []:
            if (svcs.get(dep) or {}).get("profiles") and not prof:
                out.append(f"compose {name}: depends on {dep}, which runs only in a profile")
        for src in _mounts(svc):
            if not (DOCKER / src).exists():
                out.append(f"compose {name}: mounts {src}, which is not in docker/")
    if not MONITORING <= set(svcs):
        return out + [f"compose: no {sorted(MONITORING - set(svcs))} service"]
    mounts = _mounts(svcs["prometheus"])
    conf = mounts.get("./prometheus.yml")
    if conf is None:
        return out + ["compose prometheus: does not mount ./prometheus.yml"]
    for rf in prom.get("rule_files") or []:
        want = posixpath.join(posixpath.dirname(conf), rf)
        if mounts.get("./" + posixpath.basename(rf)) != want:
            out.append(f"prometheus.yml: rule file {rf} is not mounted at {want}")
    if not prom.get("rule_files"):
        out.append("prometheus.yml: no rule_files")
    targets = [t for am in (prom.get("alerting") or {}).get("alertmanagers", [])
               for sc in am.get("static_configs", []) for t in sc.get("targets", [])]
    if targets != ["alertmanager:9093"]:      # the alertmanager image's default port
        out.append(f"prometheus.yml: alerts go to {targets}, not alertmanager:9093")
    am = svcs["alertmanager"]
    flags = dict(a.split("=", 1) for a in am.get("command") or [] if "=" in a)
    if _mounts(am).get("./alertmanager.yml") != flags.get("--config.file"):
        out.append("compose alertmanager: --config.file is not the mounted alertmanager.yml")
    return out


# -- Grafana -----------------------------------------------------------------------------------

def exported_metrics() -> dict[str, str]:
    """Every sample name the processes export -> the command that serves it (broker, shard,
    worker: a client's metrics): counters with _total, histograms as _bucket, _sum and
    _count."""
    client = type("Client", (), {"stats": {}, "broker_alive": True})()
    snaps = {"broker": BrokerCore(8).metrics(0),
             "shard": {**ShardCore("s").metrics(), **ShardMeters().snapshot(ShardShm(False))},
             "worker": metrics.client_snapshot(client)}
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {name + s: role for role, snap in snaps.items() for name, m in snap.items()
            for s in suffixes[m[0]]}


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    out = []
    def walk(panels):
        for p in panels:
            out.extend((p.get("title", "?"), t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))
    walk(dash.get("panels", []))
    return out


def check_dashboard(dash: dict, roles: set[str], ds_uid: str) -> list[str]:
    """Every gradbus metric a query names is exported by a process Prometheus scrapes
    (``roles``), counters and histogram buckets only under rate/irate/increase."""
    out = []
    exported = exported_metrics()
    exprs = dashboard_exprs(dash)
    if not exprs:
        out.append("the dashboard has no queries")
    for title, expr in exprs:
        for m in re.finditer(r"\bgradbus_[a-z0-9_]+", expr):
            name = m.group(0)
            if name not in exported:
                out.append(f"panel {title!r}: {name} is not an exported metric")
            elif exported[name] not in roles:
                out.append(f"panel {title!r}: {name} comes from {exported[name]}s, which "
                           "Prometheus does not scrape")
            elif name.endswith(("_total", "_bucket")) and not re.search(
                    r"(?:rate|irate|increase)\(\s*$", expr[:m.start()]):
                out.append(f"panel {title!r}: {name} outside rate/irate/increase")
    ids = [p.get("id") for p in dash.get("panels", [])]
    if len(set(ids)) != len(ids):
        out.append(f"panel ids repeat: {ids}")
    for p in dash.get("panels", []):
        for t in [p, *p.get("targets", [])]:
            if (t.get("datasource") or {}).get("uid") != ds_uid:
                out.append(f"panel {p.get('title')!r}: datasource {t.get('datasource')} is "
                           f"not the provisioned {ds_uid}")
    return out


# -- Kubernetes --------------------------------------------------------------------------------

#: what the downward API fields the manifests use give, for parsing
FIELD_SAMPLES = {"metadata.name": "{name}-0",
                 "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0"}


def k8s_objects() -> dict[tuple[str, str], dict]:
    kust = load_yaml(K8S / "kustomization.yaml")
    objs = {}
    for res in kust["resources"]:
        for d in load_yaml_all(K8S / res):
            objs[(d["kind"], d["metadata"]["name"])] = d
    return objs


def _pod(obj: dict) -> dict:
    return obj["spec"]["template"]


def _expand(value: str, env: dict) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)


def k8s_procs(objs: dict, tmp: pathlib.Path) -> tuple[list[Proc], list[tuple[str, dict]],
                                                     list[str]]:
    """The args and exec probes of every gradbus container; the environments; problems
    found on the way (a $(VAR) not defined, a command that is not the entrypoint)."""
    procs, envs, out = [], [], []
    secrets = {name for kind, name in objs if kind == "Secret"}
    for (kind, name), obj in objs.items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = _pod(obj)["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            if not str(c.get("image", "")).startswith("gradbus"):
                continue
            where = f"k8s {kind}/{name} {c['name']}"
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = str(e["value"])
                else:
                    field = e["valueFrom"]["fieldRef"]["fieldPath"]
                    env[e["name"]] = FIELD_SAMPLES[field].format(name=name)
            envs.append((where, env))
            mounts, files = {}, {}
            for m in c.get("volumeMounts", []):
                vol = volumes.get(m["name"], {})   # else a volumeClaimTemplate
                if "configMap" in vol:
                    cm = objs[("ConfigMap", vol["configMap"]["name"])]["data"]
                    folder = tmp / f"{name}-{m['name']}"
                    folder.mkdir(exist_ok=True)
                    for key, text in cm.items():
                        (folder / key).write_text(text)
                    mounts[m["mountPath"]] = folder / m["subPath"] if "subPath" in m else folder
                elif "secret" in vol:
                    if vol["secret"]["secretName"] not in secrets:
                        out.append(f"{where}: secret {vol['secret']['secretName']} not listed")
                    for item in vol["secret"].get("items", []):
                        files[posixpath.join(m["mountPath"], item["path"])] = item["key"]
            if c.get("command") not in (None, ["gradbus"]):
                out.append(f"{where}: command {c['command']} replaces the gradbus entrypoint")
            args = c.get("args", [])
            for a in args:
                for var in re.findall(r"\$\((\w+)\)", str(a)):
                    if var not in env:
                        out.append(f"{where}: $({var}) is not defined in env")
            args = [_expand(a, env) if isinstance(a, str) else a for a in args]
            procs.append(make_proc(f"{where} args", name, args, env, mounts, files))
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                cmd = (c.get(probe) or {}).get("exec", {}).get("command")
                if cmd is None:
                    continue
                if cmd[:1] != ["gradbus"]:
                    out.append(f"{where} {probe}: {cmd} is not a gradbus command")
                    continue
                procs.append(make_proc(f"{where} {probe}", name, cmd[1:], env, mounts, files))
    return procs, envs, out


def _check_broker_service(objs: dict, b: Proc) -> tuple[list[str], tuple | None]:
    """A broker's Service: its selector picks the broker's pod; each port has the number of
    the container port it targets, which the broker binds. The problems, and the (Service
    name, client port) the broker is reached at (None: no one Service)."""
    out, bp = [], b.params
    deploy = objs[("Deployment", b.service)]
    labels = _pod(deploy)["metadata"]["labels"]
    container = next(c for c in _pod(deploy)["spec"]["containers"]
                     if c["image"].startswith("gradbus"))
    cports = {p.get("name", p["containerPort"]): p["containerPort"]
              for p in container.get("ports", [])}
    binds = {"client": bp["port"], "backend": bp["backend_port"], "events": bp["events_port"],
             "metrics": bp["metrics_port"]}
    if bp.get("peer_port"):
        binds["pair"] = bp["peer_port"]
    services = [o for (k, _), o in objs.items() if k == "Service"
                and o["spec"].get("selector", {}).items() <= labels.items()]
    if len(services) != 1:
        return [f"{len(services)} Services select the pod of {b.service}"], None
    svc = services[0]
    sports = {}
    for sp in svc["spec"]["ports"]:
        target = cports.get(sp.get("targetPort", sp["port"]), sp.get("targetPort"))
        sports[sp.get("name")] = sp["port"]
        if target not in binds.values() or sp["port"] != target:
            out.append(f"Service {svc['metadata']['name']} port {sp.get('name')} {sp['port']} "
                       f"-> {sp.get('targetPort')} ({target}): the broker binds {binds}")
    if set(sports) != set(binds) or set(cports.values()) != set(binds.values()):
        out.append(f"Service ports {sports} / container ports {cports}: want {binds}")
    return out, (svc["metadata"]["name"], sports.get("client"))


def check_k8s(objs: dict, procs: list[Proc]) -> list[str]:
    out, args, brokers = main_lines(procs, " args", pair=True)
    if not brokers:
        return out
    b = brokers[0]
    reach = {}
    for broker in brokers:
        problems, reached = _check_broker_service(objs, broker)
        out += problems
        if reached is None:
            return out
        reach[broker.service] = reached
    out += check_broker_urls(procs, reach)
    # Prometheus annotations on each pod that serves metrics
    for p in args:
        port = p.params.get("metrics_port")
        if port is None:
            continue
        kind = next(k for k, n in objs if n == p.service and k in
                    ("Deployment", "StatefulSet", "Job"))
        ann = _pod(objs[(kind, p.service)])["metadata"].get("annotations", {})
        want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics"}
        if {k: ann.get(k) for k in want} != want:
            out.append(f"{kind}/{p.service}: annotations {ann}, want {want}")
    # shards: a StatefulSet, id from the pod name, data dir on the claim template's volume
    shards = [p for p in args if p.command == "shard"]
    if len(shards) != 1:
        return out + [f"expected one shard workload, got {[p.service for p in shards]}"]
    s = shards[0]
    sts = objs.get(("StatefulSet", s.service))
    if sts is None:
        return out + [f"shards ({s.service}) are not a StatefulSet"]
    out += check_shard_count(sts["spec"]["replicas"], b)
    if s.params["shard_id"] != FIELD_SAMPLES["metadata.name"].format(name=s.service):
        out.append(f"StatefulSet/{s.service}: --id is {s.params['shard_id']}, not the pod name")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    mounts = {m["mountPath"]: m["name"] for c in _pod(sts)["spec"]["containers"]
              for m in c.get("volumeMounts", [])}
    if mounts.get(s.params["data_dir"]) not in claims:
        out.append(f"StatefulSet/{s.service}: data dir {s.params['data_dir']} is not on a "
                   f"volumeClaimTemplate ({claims})")
    # workers: an Indexed Job, one completion per worker
    workers = [p for p in args if p.command == "worker"]
    jobs = [o for (k, n), o in objs.items() if k == "Job" and n in {p.service for p in workers}]
    if len(workers) != 1 or len(jobs) != 1:
        return out + ["want one worker Job"]
    job, w = jobs[0], workers[0]
    if (job["spec"].get("completionMode"), job["spec"].get("completions")) != (
            "Indexed", w.params["workers"]):
        out.append(f"Job: completions {job['spec'].get('completions')} "
                   f"({job['spec'].get('completionMode')}) for --workers {w.params['workers']}")
    # every pod runs as a user other than root
    for (kind, name), obj in objs.items():
        if kind in ("Deployment", "StatefulSet", "Job"):
            sc = _pod(obj)["spec"].get("securityContext", {})
            if not sc.get("runAsNonRoot") or sc.get("runAsUser", 0) == 0:
                out.append(f"{kind}/{name}: not run as a non-root user")
    # every secret key a volume mounts exists in the Secret
    for (kind, name), obj in objs.items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        for v in _pod(obj)["spec"].get("volumes", []):
            sec = v.get("secret")
            if sec:
                data = objs.get(("Secret", sec["secretName"]), {})
                keys = set(data.get("stringData", {})) | set(data.get("data", {}))
                for item in sec.get("items", []):
                    if item["key"] not in keys:
                        out.append(f"{kind}/{name}: secret key {item['key']} not in "
                                   f"Secret {sec['secretName']}")
    return out


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def final_stage():
    return parse_dockerfile(DOCKERFILE.read_text())[-1]


@pytest.fixture(scope="module")
def compose_doc():
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def prom_doc():
    return load_yaml(PROMETHEUS)


@pytest.fixture(scope="module")
def procs(compose_doc, final_stage):
    return compose_procs(compose_doc, healthcheck_args(final_stage))


@pytest.fixture(scope="module")
def k8s(tmp_path_factory):
    objs = k8s_objects()
    procs, envs, problems = k8s_procs(objs, tmp_path_factory.mktemp("k8s"))
    return objs, procs, envs, problems


def _ds_uid() -> str:
    (ds,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    return ds["uid"]


# -- the parser itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["broker", "--prot", "5555"],                       # no such option
    ["broker", "--port", "70000"],                      # out of range
    ["shard", "--metrics-port", "ninety"],              # not an integer
    ["brokr"],                                          # no such command
    ["worker", "--index"],                              # option without its value
    ["status", "extra"],                                # unexpected argument
    ["shard", "drain"],                                 # missing argument
    ["broker", "--config", "/nonexistent/gradbus.toml"],
])
def test_the_parser_rejects_broken_command_lines(args):
    with pytest.raises(click.ClickException):
        parse_cli(args)


def test_the_parser_resolves_to_the_leaf_and_reads_the_environment(tmp_path):
    ctx = parse_cli(["shard", "drain", "shard-0", "--no-wait"])
    assert (ctx.command.name, ctx.params["shard_id"], ctx.params["wait"]) == (
        "drain", "shard-0", False)
    ctx = parse_cli(["shard", "--id", "a"], {"GRADBUS_CLIENT_BROKER": "tcp://b:7000"})
    assert (ctx.command.name, ctx.params["broker_url"]) == ("shard", "tcp://b:7000")
    with pytest.raises(click.ClickException):          # a bad value in a variable
        parse_cli(["broker"], {"GRADBUS_BROKER_PORT": "many"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker]\nprot = 1\n")
    with pytest.raises(config.ConfigError):             # the config file is validated
        parse_cli(["broker", "--config", str(bad)])


# -- compose ---------------------------------------------------------------------------------

def test_compose_runs_valid_gradbus_command_lines(procs):
    assert check_parsed(procs) == []
    kinds = sorted(p.command for p in procs if p.where.endswith(" command"))
    assert kinds == ["broker", "shard", "shard", "shard", "worker", "worker"], kinds
    health = [p for p in procs if p.where.endswith(" healthcheck")]
    assert health and {p.command for p in health} == {"status"}
    broken = copy.deepcopy(load_yaml(COMPOSE))
    broken["services"]["shard-0"]["command"].append("--no-such-flag")
    assert check_parsed(compose_procs(broken, ["gradbus", "status"])) != []


def test_compose_sets_only_variables_gradbus_reads(compose_doc):
    envs = [(f"compose {n}", compose_env(s)) for n, s in compose_doc["services"].items()
            if is_gradbus_service(s)]
    assert any("GRADBUS_SECURITY_CURVE_SECRET" in e for _, e in envs)
    assert check_env(envs) == []
    assert check_env([("x", {"GRADBUS_BROKER_PROT": "1", "OTHER": "2"})]) == [
        "x: GRADBUS_BROKER_PROT is not a variable gradbus reads"]


def test_known_variables_include_those_read_outside_the_settings():
    known = known_env()
    assert {"GRADBUS_BACKEND", "GRADBUS_BROKER", "GRADBUS_CONFIG",
            "GRADBUS_SECURITY_CURVE_SECRET", "GRADBUS_METRICS_SHARD_PORT"} <= known
    assert "GRADBUS_" not in known and not any(n.endswith("_") for n in known)


def test_compose_ports_urls_volumes_and_scrape_targets(compose_doc, procs, prom_doc):
    assert check_compose(compose_doc, procs, prom_doc) == []


@pytest.mark.parametrize("breakage", [
    "shard metrics port", "worker broker port", "published port", "unpinned events port",
    "shared data volume", "worker index", "scrape target"])
def test_compose_checks_catch_mismatches(compose_doc, final_stage, prom_doc, breakage):
    doc, prom = copy.deepcopy(compose_doc), copy.deepcopy(prom_doc)
    s = doc["services"]
    if breakage == "shard metrics port":
        cmd = s["shard-1"]["command"]
        cmd[cmd.index("--metrics-port") + 1] = "9200"
    elif breakage == "worker broker port":
        s["worker-0"]["command"] += ["--broker", "tcp://broker:5559"]
    elif breakage == "published port":
        s["broker"]["ports"][1] = "127.0.0.1:6556:5556"
    elif breakage == "unpinned events port":
        cmd = s["broker"]["command"]
        cmd[cmd.index("--events-port") + 1] = "0"
    elif breakage == "shared data volume":
        s["shard-2"]["volumes"][1] = "shard-0-data:/var/lib/gradbus"
    elif breakage == "worker index":
        cmd = s["worker-1"]["command"]
        cmd[cmd.index("--index") + 1] = "0"
    else:
        prom["scrape_configs"][1]["static_configs"][0]["targets"] = ["shard-0:9100"]
    assert check_compose(doc, compose_procs(doc, healthcheck_args(final_stage)), prom) != []


def test_compose_curve_keys_come_from_secrets(compose_doc, procs):
    assert check_curve(procs) == []
    for svc, key in [("worker-0", "GRADBUS_SECURITY_CURVE_SERVER_KEY"),
                     ("shard-0", "GRADBUS_SECURITY_CURVE_SECRET")]:
        doc = copy.deepcopy(compose_doc)
        doc["services"][svc]["environment"][key] = "/run/secrets/elsewhere"
        assert check_curve(compose_procs(doc, ["gradbus", "status"])) != [], (svc, key)
    doc = copy.deepcopy(compose_doc)
    doc["services"]["broker"]["secrets"] = [
        s for s in doc["services"]["broker"]["secrets"] if s["source"] != "worker_key"]
    assert any("worker.key_secret" in p for p in check_curve(compose_procs(doc, ["gradbus", "status"])))
    # every secret file lives under docker/keys, the folder the key commands write to
    for s in compose_doc["secrets"].values():
        assert s["file"].startswith("./keys/") and s["file"].endswith((".key", ".key_secret"))


def test_compose_uses_the_config_file_and_the_image(compose_doc, procs):
    for name, svc in compose_doc["services"].items():
        if is_gradbus_service(svc):
            assert "./gradbus.toml:/etc/gradbus/gradbus.toml:ro" in svc["volumes"], name
            assert svc["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}, name
    for p in procs:
        if p.where.endswith(" command"):
            assert config.loaded(p.ctx).path == str((DOCKER / "gradbus.toml").resolve()), p.where
    prom = compose_doc["services"]["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


def test_compose_runs_on_compose_1_29_and_v2(compose_doc):
    assert check_compose_versions(compose_doc, ENV_FILE.read_text()) == []
    named = dict(compose_doc, name="gradbus")
    assert check_compose_versions(named, ENV_FILE.read_text()) != []
    assert check_compose_versions(compose_doc, "COMPOSE_PROJECT_NAME=docker\n") != []


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here")
def test_docker_compose_1_validates_the_file():
    r = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# -- the image -------------------------------------------------------------------------------

def test_dockerfile():
    assert check_dockerfile(DOCKERFILE.read_text()) == []


def test_dockerfile_checks_catch_problems():
    good = DOCKERFILE.read_text()
    broken = {
        "root user": good.replace("USER 10001:10001", "USER root"),
        "no user": good.replace("USER 10001:10001", ""),
        "shell entrypoint": good.replace('ENTRYPOINT ["gradbus"]', "ENTRYPOINT gradbus"),
        "other entrypoint": good.replace('ENTRYPOINT ["gradbus"]', 'ENTRYPOINT ["python"]'),
        "compiler": good.replace("USER 10001:10001",
                                 "RUN apt-get install -y gcc\nUSER 10001:10001"),
        "bad healthcheck": good.replace('"status", "--timeout", "2"', '"status", "--tmeout"'),
        "one stage": "FROM python:3.12-slim\nUSER 1\nENTRYPOINT [\"gradbus\"]\n",
        "fat base": good.replace("python:3.12-slim-bookworm", "python:3.12"),
        "syntax directive": "# syntax=docker/dockerfile:1\n" + good,
        "RUN --mount": good.replace("RUN groupadd", "RUN --mount=type=cache,target=/x groupadd"),
        "COPY --link": good.replace("COPY --from=builder", "COPY --link --from=builder"),
        "heredoc": good.replace("USER 10001:10001", "RUN <<EOF\ntrue\nEOF\nUSER 10001:10001"),
        "env not copied": good.replace("COPY --from=builder /opt/gradbus /opt/gradbus", ""),
        "env not on PATH": good.replace("PATH=/opt/gradbus/bin:$PATH", "PATH=$PATH"),
        "env from the index": good.replace("--no-index ", ""),
        "pip in the final stage": good.replace("USER 10001:10001",
                                               "RUN pip install gradbus\nUSER 10001:10001"),
    }
    for what, text in broken.items():
        assert text != good, what
    for what, text in broken.items():
        assert check_dockerfile(text) != [], what


def test_image_exposes_the_ports_and_volume_compose_uses(final_stage, procs):
    exposed = {int(p) for e in _instr(final_stage, "EXPOSE") for p in e.split()}
    used = set()
    for p in procs:
        for k in ("port", "backend_port", "events_port", "metrics_port"):
            if p.where.endswith(" command") and p.params.get(k):
                used.add(p.params[k])
    assert exposed == used, (exposed, used)
    volumes = {v for e in _instr(final_stage, "VOLUME") for v in json.loads(e)}
    data_dirs = {p.params["data_dir"] for p in procs if p.command == "shard"}
    assert data_dirs and data_dirs <= volumes, (data_dirs, volumes)


def test_dockerignore_keeps_what_the_image_copies():
    patterns = dockerignore_patterns()
    stages = parse_dockerfile(DOCKERFILE.read_text())
    sources = [w for st in stages for c in _instr(st, "COPY") if "--from" not in c
               for w in c.split()[:-1]]
    assert sources
    for src in sources:
        path = ROOT / src
        files = [path] if path.is_file() else [f for f in path.rglob("*.py")]
        assert files, src
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            assert not dockerignored(rel, patterns), rel
    for rel in (".git/HEAD", ".venv/bin/python", "tests/test_deploy.py", "docker/keys/x.key",
                "gradbus/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(rel, patterns), rel


# -- Prometheus and Grafana ------------------------------------------------------------------

def test_prometheus_scrapes_every_gradbus_process(prom_doc, procs):
    jobs = {j["job_name"] for j in prom_doc["scrape_configs"]}
    assert jobs == {"gradbus-broker", "gradbus-shard", "gradbus-worker"}
    served = {p.service for p in procs if p.where.endswith(" command")
              and p.params.get("metrics_port") is not None}
    targets = {t.rpartition(":")[0] for j in prom_doc["scrape_configs"]
               for sc in j["static_configs"] for t in sc["targets"]}
    assert served == targets == {"broker", "shard-0", "shard-1", "shard-2", "worker-0",
                                 "worker-1"}


def test_grafana_dashboard_uses_exported_metrics(procs, prom_doc, compose_doc):
    dash = json.loads(DASHBOARD.read_text())
    scraped = {p.service for p in procs if p.params.get("metrics_port") is not None}
    roles = {p.command for p in procs if p.service in scraped and p.where.endswith(" command")}
    assert roles == {"broker", "shard", "worker"}
    assert check_dashboard(dash, roles, _ds_uid()) == []
    # the panels the dashboard is for
    text = " ".join(e for _, e in dashboard_exprs(dash))
    for name in ["gradbus_broker_pushes_received_total", "gradbus_broker_pushes_applied_total",
                 "gradbus_broker_push_wire_bytes_total", "gradbus_broker_compression_ratio",
                 "gradbus_broker_push_to_visible_seconds_bucket",
                 "gradbus_shard_apply_seconds_bucket", "gradbus_broker_pending_bytes",
                 "gradbus_broker_shard_up", "gradbus_broker_failovers_total",
                 "gradbus_broker_errors_total"]:
        assert name in text, name
    assert "histogram_quantile(0.99" in text and "sum by (code)" in text


def test_the_monitoring_is_an_optional_profile_with_the_same_files(compose_doc, prom_doc):
    assert check_monitoring(compose_doc, prom_doc) == []


@pytest.mark.parametrize("breakage", ["no profile", "cluster in a profile", "rules unmounted",
                                      "alertmanager target", "missing file", "dependency"])
def test_the_monitoring_check_catches_problems(compose_doc, prom_doc, breakage):
    doc, prom = copy.deepcopy(compose_doc), copy.deepcopy(prom_doc)
    svcs = doc["services"]
    if breakage == "no profile":
        del svcs["grafana"]["profiles"]
    elif breakage == "cluster in a profile":
        svcs["shard-0"]["profiles"] = ["monitoring"]
    elif breakage == "rules unmounted":
        svcs["prometheus"]["volumes"] = [v for v in svcs["prometheus"]["volumes"]
                                         if "alerts" not in v]
    elif breakage == "alertmanager target":
        prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = ["am:9093"]
    elif breakage == "missing file":
        svcs["alertmanager"]["volumes"][0] = "./alertmanager.yaml:/etc/alertmanager/a.yml:ro"
    else:
        svcs["broker"]["depends_on"] = {"prometheus": {"condition": "service_started"}}
    assert check_monitoring(doc, prom) != []


def test_grafana_dashboard_check_catches_problems():
    exported = exported_metrics()
    assert "gradbus_broker_pushes_applied_total" in exported
    assert "gradbus_broker_pushes_applied" not in exported          # counters end in _total
    assert "gradbus_shard_apply_seconds_bucket" in exported
    assert exported["gradbus_client_pushes_total"] == "worker"
    assert exported["gradbus_shard_last_checkpoint_timestamp_seconds"] == "shard"
    ds = {"type": "prometheus", "uid": "u"}

    def dash(expr):
        return {"panels": [{"id": 1, "title": "t", "datasource": ds,
                            "targets": [{"expr": expr, "datasource": ds}]}]}
    assert check_dashboard(dash("rate(gradbus_broker_pushes_applied_total[1m])"),
                           {"broker"}, "u") == []
    for expr in ["rate(gradbus_broker_pushes_aplied_total[1m])",     # misspelt
                 "gradbus_broker_pushes_applied_total",              # a counter without rate
                 "rate(gradbus_client_pushes_total[1m])",            # nobody scrapes clients
                 "gradbus_shard_apply_seconds"]:                     # a histogram's bare name
        assert check_dashboard(dash(expr), {"broker", "shard"}, "u") != [], expr
    assert check_dashboard(dash("gradbus_broker_workers"), {"broker"}, "other") != []


def test_grafana_provisioning_matches_compose(compose_doc):
    (ds,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "gradbus.yml")["providers"]
    grafana = compose_doc["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == posixpath.join(provider["options"]["path"], DASHBOARD.name)


# -- Kubernetes ------------------------------------------------------------------------------

def test_kustomization_lists_every_manifest():
    kust = load_yaml(K8S / "kustomization.yaml")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    kinds = {k for k, _ in k8s_objects()}
    assert {"Deployment", "Service", "StatefulSet", "Job", "ConfigMap", "Secret"} <= kinds


def test_k8s_runs_valid_gradbus_command_lines(k8s):
    objs, procs, envs, problems = k8s
    assert problems == []
    assert check_parsed(procs) == []
    assert sorted(p.command for p in procs if p.where.endswith(" args")) == [
        "broker", "broker", "shard", "worker"]
    assert {p.command for p in procs if "Probe" in p.where} == {"status"}
    assert check_env(envs) == []


def test_k8s_ports_services_annotations_and_storage(k8s):
    objs, procs, _, _ = k8s
    assert check_k8s(objs, procs) == []


@pytest.mark.parametrize("breakage", ["service port", "target port", "annotation", "claim",
                                      "job completions", "root", "secret key", "shard url",
                                      "undefined variable", "peer", "one broker named"])
def test_k8s_checks_catch_mismatches(k8s, tmp_path, breakage):
    objs = copy.deepcopy(k8s[0])
    broker = _pod(objs[("Deployment", "broker")])
    shard = objs[("StatefulSet", "shard")]
    if breakage == "service port":
        objs[("Service", "broker")]["spec"]["ports"][1]["port"] = 6556
    elif breakage == "target port":
        broker["spec"]["containers"][0]["ports"][2]["containerPort"] = 5558
    elif breakage == "annotation":
        _pod(shard)["metadata"]["annotations"]["prometheus.io/port"] = "9100"
    elif breakage == "claim":
        shard["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] = "other"
    elif breakage == "job completions":
        objs[("Job", "demo-workers")]["spec"]["completions"] = 3
    elif breakage == "root":
        broker["spec"]["securityContext"]["runAsUser"] = 0
    elif breakage == "secret key":
        del objs[("Secret", "gradbus-curve")]["stringData"]["shard.key"]
    elif breakage == "shard url":
        env = _pod(shard)["spec"]["containers"][0]["env"]
        next(e for e in env if e["name"] == "GRADBUS_CLIENT_BROKER")["value"] = "tcp://x:5555"
    elif breakage == "peer":
        args = broker["spec"]["containers"][0]["args"]
        args[args.index("--peer") + 1] = "tcp://broker-b:5559"
    elif breakage == "one broker named":
        env = _pod(shard)["spec"]["containers"][0]["env"]
        next(e for e in env if e["name"] == "GRADBUS_CLIENT_BROKER")["value"] = \
            "tcp://broker:5555"
    else:
        env = _pod(shard)["spec"]["containers"][0]["env"]
        next(e for e in env if e["name"] == "POD_NAME")["name"] = "NAME"
    procs, _, problems = k8s_procs(objs, tmp_path)
    assert problems + check_k8s(objs, procs) != []


def test_k8s_curve_keys_come_from_the_secret(k8s, tmp_path):
    objs, procs, _, _ = k8s
    assert check_curve(procs) == []
    objs = copy.deepcopy(objs)
    allowed = next(v for v in _pod(objs[("Deployment", "broker")])["spec"]["volumes"]
                   if v["name"] == "allowed")
    allowed["secret"]["items"] = [i for i in allowed["secret"]["items"] if i["key"] != "shard.key"]
    procs, _, _ = k8s_procs(objs, tmp_path)
    assert any("shard.key_secret" in p for p in check_curve(procs))


def test_k8s_config_map_is_the_docker_config(k8s, tmp_path):
    text = k8s[0][("ConfigMap", "gradbus-config")]["data"]["gradbus.toml"]
    (tmp_path / "gradbus.toml").write_text(text)
    assert config.load(str(tmp_path / "gradbus.toml")).values == \
        config.load(str(DOCKER / "gradbus.toml")).values


# ---- CURVE key roles in the deployment examples -------------------------------------------------

_KEY_ROLES = {"broker": "operator", "shard": "shard", "worker": "client"}


def key_generation_problems(text: str, where: str) -> list[str]:
    """Every ``gradbus keys generate .../keys --name N`` for the deployment examples' three keys
    gives N its role (the broker's own key is an operator's there: ops commands and the
    healthcheck in its container connect with it)."""
    import re
    out = []
    for line in text.splitlines():
        m = re.search(r"keys generate \S*/keys --name (\w+)(.*)", line)
        if not m or m.group(1) not in _KEY_ROLES:
            continue
        roles = re.findall(r"--role (\w+)", m.group(2))
        if roles != [_KEY_ROLES[m.group(1)]]:
            out.append(f"{where}: {m.group(1)} key made with roles {roles}, "
                       f"want [{_KEY_ROLES[m.group(1)]!r}]")
    return out


def test_deployment_keys_are_made_with_their_roles():
    files = [DOCKER / "docker-compose.yml", DOCKER / "k8s" / "secret.yaml", DOCKER / "smoke.sh",
             ROOT / "README.md", ROOT / "docs" / "operations.md"]
    import re
    problems = []
    for f in files:
        text = f.read_text()
        # the three keys, once in each of the five places
        assert len(re.findall(r"keys generate \S*/keys --name (?:broker|shard|worker)\b",
                              text)) == 3, f.name
        problems += key_generation_problems(text, f.name)
    assert problems == []
    assert key_generation_problems("gradbus keys generate docker/keys --name worker", "x") == [
        "x: worker key made with roles [], want ['client']"]


# -- the broker pair's compose override ------------------------------------------------------

PAIR_COMPOSE = DOCKER / "docker-compose.pair.yml"


def _merged_pair(base: dict) -> dict:
    """docker-compose.pair.yml laid over ``base`` as compose does it: a service's keys replace
    the base's, its ``environment`` merged by name."""
    doc = copy.deepcopy(base)
    for name, svc in load_yaml(PAIR_COMPOSE)["services"].items():
        into = doc["services"].setdefault(name, {})
        env = {**(into.get("environment") or {}), **(svc.get("environment") or {})}
        into.update(svc)
        if env:
            into["environment"] = env
    return doc


def test_the_pair_override_runs_two_brokers_that_name_each_other(compose_doc, final_stage):
    doc = _merged_pair(compose_doc)
    procs = compose_procs(doc, healthcheck_args(final_stage))
    assert check_parsed(procs) == []
    assert sorted(p.command for p in procs if p.where.endswith(" command")) == [
        "broker", "broker", "shard", "shard", "shard", "worker", "worker"]
    a, b = (doc["services"][n]["command"] for n in ("broker", "broker-b"))

    def opt(cmd, flag):
        return cmd[cmd.index(flag) + 1]
    assert opt(a, "--peer") == f"tcp://broker-b:{opt(b, '--peer-port')}"
    assert opt(b, "--peer") == f"tcp://broker:{opt(a, '--peer-port')}"
    urls = f"tcp://broker:{opt(a, '--port')},tcp://broker-b:{opt(b, '--port')}"
    for name in ("shard-0", "shard-1", "shard-2", "worker-0", "worker-1"):
        assert doc["services"][name]["environment"]["GRADBUS_CLIENT_BROKER"] == urls, name
    ports = {p.split(":")[1] for p in doc["services"]["broker-b"]["ports"]}
    assert ports == {opt(b, f) for f in ("--port", "--backend-port", "--events-port")}
    assert check_env([(f"pair {n}", compose_env(s)) for n, s in doc["services"].items()
                      if is_gradbus_service(s)]) == []


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here")
def test_docker_compose_1_validates_the_pair_override():
    r = subprocess.run(["docker-compose", "-f", str(COMPOSE), "-f", str(PAIR_COMPOSE), "config",
                        "-q"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
