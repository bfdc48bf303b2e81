"""A local cluster: a broker and N shards, as real processes (default) or threads (tests).

Child processes get ``PR_SET_PDEATHSIG`` (Linux), so a killed launcher leaves no orphans; a clean
stop sends SIGTERM, waits, then SIGKILL.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time

from gradbus import admin
from gradbus.codecs import security
from gradbus.codecs.errors import GradbusError

STOP_GRACE = 5.0


def end_processes(procs, grace: float = STOP_GRACE) -> None:
    """SIGTERM every running process of ``procs`` (None entries are skipped), give them
    ``grace`` seconds together, SIGKILL the rest; every one is reaped and its stdout closed."""
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
                 metrics_port: int | None = None):
        if shards < 1:
            raise ValueError("a cluster needs at least one shard")
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
        self.processes = processes
        self.ready_timeout = ready_timeout
        self.broker_args = broker_args or []
        self.shard_args = shard_args or []
        self.quiet = quiet
        # CURVE on: broker, shard and client keys made (or reused) in curve_dir
        # (security.ClusterKeys); self.curve is the client's, for the SDK and admin requests
        self.keys = security.ClusterKeys.ensure(curve_dir) if curve_dir else None
        self.curve = self.keys.client() if self.keys else None
        self.broker_proc: subprocess.Popen | None = None
        self.shard_procs: dict[str, subprocess.Popen] = {}
        self.broker = None
        self.shard_servers: dict = {}
        self.threads: list = []
        self.url: str | None = None

    # -- processes ---------------------------------------------------------------------
    def _spawn(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "gradbus", *args], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if self.quiet else None, text=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    def start(self) -> "LocalCluster":
        try:
            if self.processes:
                self.broker_proc = self._spawn(
                    ["broker", "--host", self.host, "--port", str(self.port),
                     "--partitions", str(self.partitions), "--replicas", str(self.replicas),
                     *self._curve_args("broker"), *self._metrics_args(0), *self.broker_args])
                line = self.broker_proc.stdout.readline().strip()
                if not line.startswith("listening: "):
                    raise GradbusError(f"broker failed to start (said {line!r})")
                self.url = line.split(" ", 1)[1]
                for sid in self.shard_ids:
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

    def add_shard(self, shard_id: str) -> None:
        if self.processes:
            self.shard_procs[shard_id] = self._spawn(
                ["shard", "--broker", self.url, "--id", shard_id, *self._curve_args("shard"),
                 *self._metrics_args(1 + len(self.shard_procs)), *self.shard_args,
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
                    raise GradbusError(f"{name} exited with {proc.returncode}")
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

    def stop(self) -> None:
        end_processes([*self.shard_procs.values(), self.broker_proc])
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
        self.broker_proc = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pids(self) -> list[int]:
        return [p.pid for p in self.shard_procs.values()] + (
            [self.broker_proc.pid] if self.broker_proc else [])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` ports free right now (bound then released: for pinning a broker's ports so that it
    can be restarted on them)."""
    import socket
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def in_process(shards: int = 2, **kw) -> LocalCluster:
    return LocalCluster(shards, processes=False, **kw)


__all__ = ["LocalCluster", "in_process", "free_ports"]
