"""Emulated hosts for bench/hosts.py: Linux network namespaces joined by shaped veth links.

One namespace is the server host (the broker and its shards, or the RPC server); one per worker
is a worker host. The server namespace also holds the switch, a bridge ``br0``; each host's
link to it is a veth pair shaped in both directions with tc:

    worker i:  eth0 (10.77.0.11+i)  <-- link -->  w<i>, a port of br0        (--link)
    server:    up0  (10.77.0.1)     <-- link -->  up1, a port of br0         (--server-link)

A packet from worker i to the server leaves eth0 through its shaper, crosses the bridge and
enters up1's shaper on its way to up0; the way back goes through up0's shaper and w<i>'s. Each
shaper is a token bucket (``tbf``) at the link's rate, with a ``netem`` delay under it when
one is asked for (a kernel without ``sch_netem`` refuses a delay, plainly). Nothing is made
in the namespace this process runs in: both ends of every veth are created in their
namespaces, so deleting the namespaces removes every veth, the bridge and every qdisc.

Names carry this bench's prefix and the pid of the process that made them (``gbh<pid>-s``,
``gbh<pid>-w<i>``): :func:`sweep` removes those whose maker is gone (a run killed with
SIGKILL), and leaves a live run's alone.

A process joins a namespace with setns(2), as ``ip netns exec`` does: :func:`enter` for a
multiprocessing child (before it starts any thread), :meth:`Hosts.exec_prefix` for a
subprocess. Byte counters come from ``/proc/PID/net/dev`` of a process inside the namespace.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading

from gradbus.cluster import _die_with_parent
from gradbus.codecs import shm

PREFIX = "gbh"
SUBNET = "10.77.0"
SERVER_ADDR = f"{SUBNET}.1"
SERVER_DEV, WORKER_DEV = "up0", "eth0"
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
QUEUE_SECONDS = 0.005       # a shaper queues up to 5 ms of its rate (a switch port's buffer)
MIN_BURST = 128 << 10       # a token bucket passes a 64 KiB GSO packet whole
MAX_SERVERS = 9             # server hosts at .1 to .9, workers from .11
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


class HostsError(RuntimeError):
    """The hosts cannot be made here (no root, no ip netns, a qdisc the kernel lacks)."""


def parse_rate(text: str) -> int:
    """A link rate as tc writes it, ``100mbit``, ``1gbit``, ``10gbit``, in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {text!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit "
                         f"(bits per second; tc's 'bps' means bytes and is not taken)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_delay(text: str) -> float:
    """A one-way delay, ``0``, ``0.1ms``, ``50us``, in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|ms|us)?", text.strip().lower())
    if not m:
        raise ValueError(f"delay {text!r}: write it as 0, 50us, 0.1ms or 1ms")
    secs = float(m.group(1)) * _TIMES[m.group(2) or "s"]
    if secs > 1.0:
        raise ValueError(f"delay {text!r}: more than a second")
    return secs


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """An ``ip`` or ``tc`` command; a failure raises HostsError with what it said."""
    proc = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise HostsError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def namespaces() -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner(name: str) -> int | None:
    m = re.match(rf"{PREFIX}(\d+)-", name)
    return int(m.group(1)) if m else None


def sweep() -> list[str]:
    """Removes the namespaces of this bench whose maker is gone; returns their names."""
    gone = [ns for ns in namespaces()
            if (pid := _owner(ns)) is not None and pid != os.getpid() and not shm._alive(pid)]
    for ns in gone:
        run("ip", "netns", "delete", ns, check=False)
    return gone


def permitted() -> str | None:
    """None where this process may make namespaces and veths and shape them; else why not."""
    if os.geteuid() != 0:
        return "it needs root (it makes network namespaces, veth links and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"it needs the {tool} command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "link", "add", "p0", "netns", probe, "type", "veth", "peer", "name", "p1",
            "netns", probe)
        run("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit",
            "burst", str(MIN_BURST), "limit", str(4 * MIN_BURST))
    except HostsError as e:
        return f"ip netns, veth or tc is not permitted here ({e})"
    finally:
        run("ip", "netns", "delete", probe, check=False)
    return None


def cut_permitted() -> str | None:
    """None where links between hosts can also be cut (iptables drops in a host's namespace,
    as the tests that cut a network do); else why not."""
    why = permitted()
    if why is None and shutil.which("iptables") is None:
        why = "iptables is not installed (Debian: apt-get install iptables)"
    return why


def enter(ns: str) -> None:
    """Moves the calling thread, and every thread it starts later, into namespace ``ns``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def run_in(ns: str, target, *args) -> None:
    """A multiprocessing child's entry: SIGTERM when its parent ends, into namespace ``ns``
    before any thread starts, then ``target(*args)``."""
    _die_with_parent()
    enter(ns)
    target(*args)


def dev_bytes(pid: int, dev: str) -> tuple[int, int]:
    """(received, sent) bytes of interface ``dev`` in the namespace of process ``pid``."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise HostsError(f"no interface {dev} in the namespace of process {pid}")


class Hosts:
    """The server host and ``workers`` worker hosts, their links shaped; :meth:`close` (or the
    ``with`` block's end) deletes every namespace made, which removes their links."""

    def __init__(self, workers: int, link: str, server_link: str, delay: str = "0",
                 server_delay: str = "0", servers: int = 1):
        """``servers``: server hosts; the first holds the switch, each other one is joined to
        it by a link of its own shaped as the first's (``server_link``, ``server_delay``)."""
        if workers < 1:
            raise ValueError("at least one worker host")
        if not 1 <= servers <= MAX_SERVERS:
            raise ValueError(f"1 to {MAX_SERVERS} server hosts")
        self.link_bps, self.server_bps = parse_rate(link), parse_rate(server_link)
        self.delay, self.server_delay = parse_delay(delay), parse_delay(server_delay)
        self.server = f"{PREFIX}{os.getpid()}-s"
        self.workers = [f"{PREFIX}{os.getpid()}-w{i}" for i in range(workers)]
        self.made: list[str] = []
        self.shaped: list[tuple] = []     # (namespace, interface) of every shaper
        self.server_addr = SERVER_ADDR
        # server host k: its namespace and address (the first: the switch's host)
        self.servers = [self.server] + [f"{PREFIX}{os.getpid()}-s{k}" for k in range(1, servers)]
        self.server_addrs = [f"{SUBNET}.{1 + k}" for k in range(servers)]
        self._ports = itertools.count(20000)

    def worker_addr(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    def exec_prefix(self, ns: str) -> list[str]:
        """A command's prefix that runs it in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def next_port(self) -> int:
        """A port in the server namespace no earlier configuration of this run listened on."""
        return next(self._ports)

    def in_worker(self, i: int, target, args: tuple) -> tuple:
        """A multiprocessing child's (target, args) that runs ``target(*args)`` in worker
        host i."""
        return run_in, (self.workers[i], target, *args)

    def rpc_places(self, workers: int) -> list[tuple]:
        """Where bench/peers_rpc.py's ranks run: the server host, then worker hosts 0.."""
        return [(self.server, SERVER_ADDR, SERVER_DEV)] + [
            (ns, SERVER_ADDR, WORKER_DEV) for ns in self.workers[:workers]]

    def build(self) -> "Hosts":
        try:
            self._add_ns(self.server)
            s = ("ip", "-n", self.server)
            # the switch carries no address of the host: only up0 answers ARP for 10.77.0.1,
            # or a worker's frames would reach the server through br0, around its link
            run(*self.exec_prefix(self.server), "sysctl", "-q", "-w",
                "net.ipv4.conf.all.arp_ignore=1")
            run(*s, "link", "add", "br0", "type", "bridge")
            run(*s, "link", "set", "br0", "up")
            run(*s, "link", "add", SERVER_DEV, "type", "veth", "peer", "name", "up1")
            run(*s, "link", "set", "up1", "master", "br0")
            self._up(self.server, SERVER_DEV, SERVER_ADDR)
            run(*s, "link", "set", "up1", "up")
            self._shape(self.server, SERVER_DEV, self.server_bps, self.server_delay)
            self._shape(self.server, "up1", self.server_bps, self.server_delay)
            hosts = [(ns, f"s{k}", SERVER_DEV, self.server_addrs[k], self.server_bps,
                      self.server_delay) for k, ns in enumerate(self.servers) if k]
            hosts += [(ns, f"w{i}", WORKER_DEV, self.worker_addr(i), self.link_bps, self.delay)
                      for i, ns in enumerate(self.workers)]
            for ns, port, dev, addr, bps, delay in hosts:
                self._add_ns(ns)
                run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer",
                    "name", port, "netns", self.server)
                run(*s, "link", "set", port, "master", "br0")
                run(*s, "link", "set", port, "up")
                self._up(ns, dev, addr)
                self._shape(ns, dev, bps, delay)
                self._shape(self.server, port, bps, delay)
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.made.append(ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")

    def _up(self, ns: str, dev: str, addr: str) -> None:
        run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        run("ip", "-n", ns, "link", "set", dev, "up")

    def _shape(self, ns: str, dev: str, bps: int, delay: float) -> None:
        """A token bucket at ``bps`` on ``dev``'s way out, a netem delay under it."""
        self.shaped.append((ns, dev))
        burst = max(MIN_BURST, bps // 8 // 1000)          # a millisecond of the rate
        limit = max(4 * burst, int(bps / 8 * QUEUE_SECONDS))
        run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
            "rate", f"{bps}bit", "burst", str(burst), "limit", str(limit))
        if delay > 0:
            proc = run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle",
                       "10:", "netem", "delay", f"{delay * 1e6:.0f}us", check=False)
            if proc.returncode != 0:
                raise HostsError(f"a delay needs the netem qdisc, which this kernel refused "
                                 f"({proc.stderr.strip()}): run with --delay 0 and "
                                 f"--server-delay 0, or load sch_netem")

    def qdisc_bytes(self, ns: str, dev: str) -> int:
        """Bytes the link's token bucket on ``dev`` passed (what went through the shaper)."""
        return self._tbf(ns, dev)[0]

    def drops(self) -> int:
        """Packets every shaper of these hosts dropped (a full queue) since they were made."""
        return sum(self._tbf(ns, dev)[1] for ns, dev in self.shaped)

    @staticmethod
    def _tbf(ns: str, dev: str) -> tuple[int, int]:
        out = run("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev).stdout
        m = re.search(r"qdisc tbf 1: .*?\n\s*Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
        if not m:
            raise HostsError(f"no token bucket on {dev} in {ns}: {out!r}")
        return int(m.group(1)), int(m.group(2))

    def close(self) -> None:
        """Deletes every namespace made (their veths, bridge and qdiscs go with them), with
        SIGINT held off so that a second Ctrl-C cannot leave half of them behind."""
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            while self.made:
                run("ip", "netns", "delete", self.made.pop(), check=False)
        finally:
            if main:
                signal.signal(signal.SIGINT, old)

    def left(self) -> list[str]:
        """This object's namespaces that still exist."""
        mine = {*self.servers, *self.workers}
        return [ns for ns in namespaces() if ns in mine]

    def __enter__(self) -> "Hosts":
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()
