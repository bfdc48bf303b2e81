"""A local cluster: a broker (or a broker pair) and N shards, as real processes (default) or
threads (tests).

Child processes get ``PR_SET_PDEATHSIG`` (Linux), so a killed launcher leaves no orphans; a clean
stop sends SIGTERM, waits, then SIGKILL. :meth:`LocalCluster.supervise` keeps the processes
running: one that dies is started again after a back-off (:class:`RestartPolicy`), the broker on
the ports it had, a shard from its newest checkpoint when the cluster has a data directory.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time

from gradbus import admin, stderr_tail
from gradbus.codecs import cores, net, security
from gradbus.codecs.errors import GradbusError

STOP_GRACE = 5.0
PORT_TRIES = 3             # starts of the broker (or pair) on freshly drawn ports
RESTART_WINDOW = 60.0      # seconds over which a process's restarts are counted
RESTARTS = 5               # restarts of one process within RESTART_WINDOW before giving up
BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0    # seconds before a restart: doubles with each recent one


class PortTaken(GradbusError):
    """A broker could not start: ``ports`` it was to bind are in use."""

    def __init__(self, ports: list[int], message: str):
        super().__init__(message)
        self.ports = ports


def end_processes(procs, grace: float = STOP_GRACE) -> list[int]:
    """SIGTERM every running process of ``procs`` (None entries are skipped), give them
    ``grace`` seconds together, SIGKILL the rest; every one is reaped and its stdout closed.
    Returns their exit statuses (negative: the signal that ended one), None entries left out."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()
    return [p.returncode for p in procs]


class RestartPolicy:
    """Whether, and after how long, a process that died is started again: at most
    ``max_restarts`` restarts of one process within ``window`` seconds, each after a back-off
    that doubles with the restarts in the window (``backoff_min`` up to ``backoff_max``).
    Times come from the caller (monotonic seconds)."""

    def __init__(self, max_restarts: int = RESTARTS, window: float = RESTART_WINDOW,
                 backoff_min: float = BACKOFF_MIN, backoff_max: float = BACKOFF_MAX):
        self.max_restarts, self.window = max_restarts, window
        self.backoff_min, self.backoff_max = backoff_min, backoff_max
        self.restarts: dict[str, list[float]] = {}

    def delay(self, name: str, now: float) -> float | None:
        """``name`` died at ``now``: seconds to wait before starting it again, or None to give
        up (it was restarted ``max_restarts`` times within the window)."""
        recent = [t for t in self.restarts.get(name, []) if now - t < self.window]
        if len(recent) >= self.max_restarts:
            self.restarts[name] = recent
            return None
        self.restarts[name] = recent + [now]
        return min(self.backoff_max, self.backoff_min * 2 ** len(recent))


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalCluster:
    def __init__(self, shards: int = 2, *, port: int = 0, host: str = "127.0.0.1",
                 partitions: int = 256, processes: bool = True, ready_timeout: float = 60.0,
                 broker_args: list[str] | None = None, shard_args: list[str] | None = None,
                 quiet: bool = True, replicas: int = 1, shard_ids: list[str] | None = None,
                 shard_extra: dict[str, list[str]] | None = None, curve_dir: str | None = None,
                 metrics_port: int | None = None, backend_port: int = 0, events_port: int = 0,
                 data_dir: str | None = None, restore_from: dict[str, str] | None = None,
                 brokers: int = 1, inproc: bool = False):
        """``inproc``: the shards run inside the broker's process (``gradbus broker
        --inproc-shards``), started, stopped and restarted with it."""
        if shards < 1:
            raise ValueError("a cluster needs at least one shard")
        if inproc and (brokers != 1 or curve_dir or not processes or restore_from
                       or shard_extra):
            raise ValueError("shards inside the broker's process run with one broker process "
                             "and without CURVE")
        if brokers not in (1, 2):
            raise ValueError("a cluster has one broker, or a pair (brokers=2)")
        if brokers == 2 and (not processes or backend_port or events_port):
            raise ValueError("a broker pair runs as processes, its ports but the first "
                             "broker's client port free ones")
        # a broker pair (protocol section 23): "broker" and "broker-b", each on four ports
        # pinned at the start (client, backend, events, pair), so that either can be
        # restarted where the other, the shards and the clients look for it
        self.broker_names = ["broker", "broker-b"][:brokers]
        self.pair_ports: dict[str, list[int]] = {}
        self.broker_procs: dict[str, subprocess.Popen] = {}
        self.n_shards = shards
        # Prometheus endpoints: the broker on metrics_port, shard i on metrics_port + 1 + i
        # (0: every process a free port; None: off)
        self.metrics_port = metrics_port
        self.shard_ids = shard_ids or [f"shard-{i}" for i in range(shards)]
        if len(self.shard_ids) != shards:
            raise ValueError("shard_ids must name every shard")
        self.shard_extra = shard_extra or {}
        self.replicas = replicas
        self.host, self.port, self.partitions = host, port, partitions
        # the broker's shard and events ports; pinned, so that a restarted broker comes back
        # where shards and clients look for them: those asked as 0 are drawn now (free_ports)
        self.backend_port, self.events_port = backend_port, events_port
        self._asked = {p for p in (port, backend_port, events_port) if p}
        self.processes = processes
        if processes:
            self._draw_ports()
        # shards checkpoint under data_dir and start from their newest checkpoint there, or,
        # without one, from restore_from[shard id] (a checkpoint directory)
        self.data_dir = data_dir
        self.restore_from = restore_from or {}
        self._started: set[str] = set()
        self.inproc = inproc
        self.host_shards: int | None = None   # shard processes of this host (None: its own)
        self.ready_timeout = ready_timeout
        self.broker_args = broker_args or []
        self.shard_args = shard_args or []
        self.quiet = quiet
        # CURVE on: broker, shard and client keys made (or reused) in curve_dir
        # (security.ClusterKeys); self.curve is the client's, for the SDK and admin requests
        self.keys = security.ClusterKeys.ensure(curve_dir) if curve_dir else None
        self.curve = self.keys.client() if self.keys else None
        self.shard_procs: dict[str, subprocess.Popen] = {}
        self.broker = None
        self.shard_servers: dict = {}
        self.threads: list = []
        self.url: str | None = None

    @property
    def broker_proc(self) -> subprocess.Popen | None:
        """The (first) broker's process."""
        return self.broker_procs.get("broker")

    @broker_proc.setter
    def broker_proc(self, proc: subprocess.Popen | None) -> None:
        if proc is None:
            self.broker_procs.pop("broker", None)
        else:
            self.broker_procs["broker"] = proc

    def _draw_ports(self) -> None:
        """Draw the ports the broker (or the pair: four each) binds that were not asked for."""
        if len(self.broker_names) == 2:
            ports = free_ports(8, self.host)
            if self.port in self._asked:
                ports[0] = self.port
            self.pair_ports = {"broker": ports[:4], "broker-b": ports[4:]}
            return
        drawn = iter(free_ports(3, self.host))
        self.port, self.backend_port, self.events_port = (
            p if p in self._asked else next(drawn)
            for p in (self.port, self.backend_port, self.events_port))

    def broker_url(self, name: str) -> str:
        """A pair's broker ``name``'s client URL."""
        return net.url(self.host, self.pair_ports[name][0])

    # -- processes ---------------------------------------------------------------------
    def _env(self) -> dict:
        """The children's environment: this process's, and the shard processes sharing this
        host's cores (for their pass threads, :func:`gradbus.codecs.cores.pass_threads`;
        in-process shards share one pool; ``host_shards`` where a tier runs several clusters
        here), unless the caller set it."""
        env = dict(os.environ)
        env.setdefault(cores.HOST_SHARDS_ENV,
                       str(self.host_shards or (1 if self.inproc else self.n_shards)))
        return env

    def _spawn(self, args: list[str]) -> subprocess.Popen:
        """``gradbus <args>`` started; quiet, its stderr is kept for what it last said
        (``proc.stderr_tail``, :mod:`gradbus.stderr_tail`), for the error if it fails."""
        tail = stderr_tail.StderrTail() if self.quiet else None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gradbus", *args], stdout=subprocess.PIPE,
                stderr=tail.fd if tail else None, text=True, env=self._env(),
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        except BaseException:
            if tail:
                tail.abandon()
            raise
        proc.stderr_tail = tail.started(args[0]) if tail else None
        return proc

    def start(self) -> "LocalCluster":
        try:
            if self.processes:
                self._start_brokers()
                for sid in self.shard_ids if not self.inproc else ():
                    self.add_shard(sid)
            else:
                from gradbus.broker.server import BrokerServer
                self.broker = BrokerServer(self.host, self.port, partitions=self.partitions,
                                           replicas=self.replicas, curve=self._curve("broker"))
                self.threads.append(self.broker.start_thread())
                self.url = self.broker.url
                for sid in self.shard_ids:
                    self.add_shard(sid)
            self.wait_ready(self.n_shards)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_brokers(self) -> None:
        """Start the broker or the pair; where a port drawn for them was bound by something
        else in the meantime, they are started again on others (at most PORT_TRIES times)."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                for name in self.broker_names:
                    self.start_broker(name)
                return
            except PortTaken as e:
                if attempt == PORT_TRIES or set(e.ports) & self._asked:
                    raise
                end_processes(self.broker_procs.values())
                self.broker_procs.clear()
                self._draw_ports()

    def start_broker(self, name: str = "broker") -> None:
        """Start the broker process (of a pair: broker ``name``) on its pinned ports."""
        if self.pair_ports:
            mine = self.pair_ports[name]
            other = self.pair_ports["broker-b" if name == "broker" else "broker"]
            ports = ["--port", str(mine[0]), "--backend-port", str(mine[1]),
                     "--events-port", str(mine[2]), "--peer-port", str(mine[3]),
                     "--peer", net.url(self.host, other[3])]
        else:
            ports = ["--port", str(self.port), "--backend-port", str(self.backend_port),
                     "--events-port", str(self.events_port)]
        old = self.broker_procs.get(name)
        if old is not None and old.poll() is not None and old.stdout:
            old.stdout.close()            # a broker that ended, started again
        if self.inproc:      # the broker restores them from data_dir itself
            ports += ["--inproc-shards", str(self.n_shards)]
            if self.data_dir:
                ports += ["--data-dir", self.data_dir]
        proc = self.broker_procs[name] = self._spawn(
            ["broker", "--host", self.host, *ports, "--partitions", str(self.partitions),
             "--replicas", str(self.replicas), *self._curve_args("broker"),
             *self._metrics_args(self.broker_names.index(name) * (1 + self.n_shards)),
             *self.broker_args])
        line = proc.stdout.readline().strip()
        if not line.startswith("listening: "):
            proc.kill()
            code = proc.wait()
            asked = self.pair_ports[name] if self.pair_ports else [
                self.port, self.backend_port, self.events_port]
            taken = [p for p in asked if p and not _bindable(self.host, p)]
            if taken:
                raise PortTaken(taken, f"broker {name} could not bind: port(s) {taken} in use")
            raise GradbusError(f"broker failed to start (exit {code}, said {line!r})"
                               f"{stderr_tail.why(proc)}")
        if self.pair_ports:
            self.url = ",".join(self.broker_url(n) for n in self.broker_names)
            return
        self.url = line.split(" ", 1)[1]

    def _restore_args(self, shard_id: str) -> list[str]:
        """A shard's first start loads restore_from[shard id] where there is one; otherwise,
        and at every restart, its newest checkpoint under data_dir."""
        if self.data_dir is None:
            return []
        from gradbus.shards import checkpoint
        path = None if shard_id in self._started else self.restore_from.get(shard_id)
        if path is None:
            ck = checkpoint.newest(self.data_dir, shard_id)
            path = ck.path if ck is not None else self.restore_from.get(shard_id)
        self._started.add(shard_id)
        return ["--data-dir", self.data_dir] + (["--restore", path] if path else [])

    def add_shard(self, shard_id: str) -> None:
        if self.processes:
            self.shard_procs[shard_id] = self._spawn(
                ["shard", "--broker", self.url, "--id", shard_id, *self._curve_args("shard"),
                 *self._metrics_args(1 + self.shard_ids.index(shard_id)
                                     if shard_id in self.shard_ids else len(self.shard_procs)),
                 *self.shard_args, *self._restore_args(shard_id),
                 *self.shard_extra.get(shard_id, [])])
        else:
            from gradbus.shards.server import ShardServer
            s = ShardServer(self.url, shard_id, curve=self._curve("shard"))
            self.threads.append(s.start_thread())
            self.shard_servers[shard_id] = s

    def _metrics_args(self, offset: int) -> list[str]:
        if self.metrics_port is None:
            return []
        return ["--metrics-port", str(self.metrics_port + offset if self.metrics_port else 0)]

    def _curve_args(self, role: str) -> list[str]:
        if self.keys is None:
            return []
        if role == "broker":
            return ["--curve-secret", self.keys.path("broker", True),
                    "--curve-allow", self.keys.allow]
        return ["--curve-secret", self.keys.path(role, True),
                "--curve-server-key", self.keys.path("broker")]

    def _curve(self, role: str):
        if self.keys is None:
            return None
        if role == "broker":
            return security.Curve.from_files(self.keys.path("broker", True),
                                             allow=self.keys.allow)
        return security.Curve.from_files(self.keys.path(role, True), self.keys.path("broker"))

    def wait_ready(self, n: int, timeout: float | None = None) -> dict:
        """Wait until ``n`` shards are registered and alive; returns the status."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while True:
            for name, proc in self.shard_procs.items():
                if proc.poll() is not None and proc.returncode != 0 and n == self.n_shards:
                    raise GradbusError(f"{name} exited with {proc.returncode}"
                                       f"{stderr_tail.why(proc)}")
            try:
                st = admin.status(self.url, timeout=1.0, curve=self.curve)
                if sum(1 for s in st["shards"] if s["alive"]) >= n:
                    return st
            except security.SecurityError:
                raise   # refused keys do not get better by waiting
            except GradbusError:
                pass
            if time.monotonic() > deadline:
                raise GradbusError(f"cluster not ready: fewer than {n} shards alive")
            time.sleep(0.05)

    def kill_shard(self, shard_id: str, sig: int = signal.SIGKILL) -> None:
        proc = self.shard_procs[shard_id]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(10)
            if proc.stdout:
                proc.stdout.close()

    def supervise(self, stop, policy: RestartPolicy | None = None, say=print,
                  poll: float = 0.2) -> str | None:
        """Keep the processes running until ``stop`` (a threading.Event) is set: a process
        that dies is started again after ``policy``'s back-off (the broker on the ports it
        had; a shard from its newest checkpoint with a data directory), and said so with
        ``say(text)``. A shard that exits with status 0 stopped on purpose (drained) and is
        not restarted. Returns None once ``stop`` is set, or why it gave up: a process that
        died once more than ``policy`` allows, whose end this leaves to :meth:`stop`."""
        policy = policy or RestartPolicy()
        due: dict[str, float] = {}          # name -> when to start it again
        while not stop.wait(poll):
            now = time.monotonic()
            brokers = self.broker_names
            for name, proc in [*self.broker_procs.items(), *self.shard_procs.items()]:
                if name in due or proc is None or proc.poll() is None:
                    continue
                if proc.stdout:
                    proc.stdout.close()
                code = proc.returncode
                if name not in brokers:
                    del self.shard_procs[name]
                if name not in brokers and code == 0:
                    say(f"{name} exited with 0")
                    continue
                delay = policy.delay(name, now)
                if delay is None:
                    return (f"{name} exited with {code}, its restart number "
                            f"{policy.max_restarts + 1} within {policy.window:g}s: giving up")
                say(f"{name} exited with {code}; starting it again in {delay:.1f}s")
                due[name] = now + delay
            for name, when in list(due.items()):
                if now < when or stop.is_set():
                    continue
                del due[name]
                try:
                    if name in brokers:
                        self.start_broker(name)
                    else:
                        self.add_shard(name)
                except (GradbusError, OSError) as e:   # seen dead at the next poll
                    say(f"{name} did not start: {e}")
                    continue
                say(f"{name} started again" + (f" on {self.url}" if name in brokers else ""))
        return None

    def stop(self) -> dict[str, int]:
        """Stop everything; returns the exit status of each process that was still running
        (by name: "broker" or the shard id)."""
        running = {n: p for n, p in [*self.shard_procs.items(), *self.broker_procs.items()]
                   if p is not None and p.poll() is None}
        codes = dict(zip(running, end_processes(list(running.values()))))
        end_processes([p for p in [*self.shard_procs.values(), *self.broker_procs.values()]
                       if p is not None and p not in running.values()])
        for s in self.shard_servers.values():
            s.stop()
        if self.broker is not None:
            self.broker.stop()
        for t in self.threads:
            t.join(STOP_GRACE)
        self.threads.clear()
        self.shard_servers.clear()
        self.broker = None
        self.shard_procs.clear()
        self.broker_procs.clear()
        from gradbus.codecs import shm  # what a killed process of this cluster left there
        for port in [p[0] for p in self.pair_ports.values()] or [self.port]:
            if port:
                shm.sweep(shm.cluster_tag(f"{self.host}:{port}"))
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pids(self) -> list[int]:
        return [p.pid for p in self.shard_procs.values()] + [
            p.pid for p in self.broker_procs.values()]


PINNED_LOW = 10000          # the lowest port free_ports hands out


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (every ``connect`` and every ``bind`` to
    port 0 on this host takes its local port from there)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _socket(host: str) -> tuple[socket.socket, tuple]:
    """A TCP socket of ``host``'s address family, and the address to bind (its port 0)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    return socket.socket(family, kind, proto), addr


def _bindable(host: str, port: int) -> bool:
    s, addr = _socket(host)
    with s:
        try:
            s.bind((addr[0], port, *addr[2:]))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now, for pinning a broker's ports so that it can be
    restarted on them. They are drawn at random below the kernel's ephemeral range: a port
    released there may be taken by any outgoing connection on the host (a client's local port)
    before the broker binds it; below it only another explicit bind can."""
    low = _ephemeral_low()
    if low - PINNED_LOW < 1000:        # no room below the range: the kernel's choice
        socks = []
        try:
            for _ in range(n):
                s, addr = _socket(host)
                socks.append(s)
                s.bind(addr)
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
    draw = random.SystemRandom()
    ports: list[int] = []
    for _ in range(200 * n):
        port = draw.randrange(PINNED_LOW, low)
        if port not in ports and _bindable(host, port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise GradbusError(f"no {n} free ports between {PINNED_LOW} and {low} on {host}")


def in_process(shards: int = 2, **kw) -> LocalCluster:
    return LocalCluster(shards, processes=False, **kw)


__all__ = ["LocalCluster", "RestartPolicy", "end_processes", "free_ports", "in_process"]
