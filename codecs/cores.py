"""What a process may use of its host's cores, and the choices that follow from it.

Two choices are made here, once, for every process kind (broker, shard, client):

* **Whether a loop spins after work** (:class:`Spin`). After a turn that had messages, a loop
  may poll without sleeping for a while before it blocks (:func:`spin_then_block`): the next
  message, which often follows within a few hundred microseconds, then finds a loop that never
  slept (no wake-up, warm caches). That costs a core while traffic flows and nothing while the
  process is idle (a turn without messages blocks at once). An operator's number forces it
  either way (``--spin-us``, the SDK's ``spin_us``: 0 is off); left to the host (``None``,
  the default), a loop spins only where the host has cores to spare: at least
  :data:`MIN_CORES` usable by the process and, by the one-minute load average, at least
  ``max(2, cores / 4)`` of them idle. The load is looked at again every :data:`RECHECK_S`
  seconds, so a host that fills up stops the spins within about a minute (the load average's
  own lag). This follows the back-off idle strategies of Aeron and Agrona (spin, yield, then
  park, reset by work); here the park is the loop's blocking poll, woken by its sockets.
* **How many threads pass over a batch's bytes** (:func:`pass_threads`): the cores the process
  may use (``os.sched_getaffinity``), divided among the shard processes of its host
  (:data:`HOST_SHARDS_ENV`, which ``gradbus up`` sets), at most :data:`MAX_PASS_THREADS`; one
  (nothing split) on a host of fewer than :data:`MIN_CORES` cores.
"""
from __future__ import annotations

import os
import time

MIN_CORES = 4            # below this, nothing spins unless told to
RECHECK_S = 1.0          # how often a Spin looks at the host's load again
MAX_PASS_THREADS = 8     # beyond this a 4 MiB block's passes gain little (memory-bound)
HOST_SHARDS_ENV = "GRADBUS_HOST_SHARDS"    # shard processes sharing this host's cores
THREADS_ENV = "GRADBUS_SHARD_THREADS"      # a shard's pass threads (0 or unset: from the host)
# the spin each kind of loop takes where the host has cores to spare, in microseconds
# (docs/performance.md: 200 us at the broker took a 64 KiB round trip from 0.55 to 0.38 ms)
BROKER_SPIN_US = 200
SHARD_SPIN_US = 200
CALLER_SPIN_US = 500


CPU_MAX = "/sys/fs/cgroup/cpu.max"   # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def usable_cores(cpu_max: str = CPU_MAX) -> int:
    """The cores this process may run on: its affinity mask (the CPU count where the platform
    has none), and no more than its cgroup's CPU quota allows, rounded up (a container given
    ``--cpus 4`` or a Kubernetes CPU limit sees every core of the host in its mask)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_quota(cpu_max)
    return max(1, min(n, quota) if quota else n)


def cgroup_quota(path: str = CPU_MAX) -> int | None:
    """The cores a cgroup v2 CPU quota allows, rounded up; None where there is none (no
    cgroup v2, no limit, or a file that does not parse)."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def host_load() -> float:
    """The one-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def spare(cores: int, load: float) -> bool:
    """Whether a host of ``cores`` usable cores at ``load`` has cores to spare for spinning."""
    return cores >= MIN_CORES and cores - load >= max(2.0, cores / 4)


def env_count(name: str, environ=None) -> int | None:
    """A non-negative int from the environment variable ``name`` (None where unset or empty);
    ValueError naming the variable for anything else."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"${name} must be a whole number >= 0, not {raw!r}")
    return n


def pass_threads(requested: int | None = None, *, cores: int | None = None,
                 host_shards: int | None = None, environ=None) -> int:
    """The threads a shard passes over a batch's bytes with: ``requested`` where it is given
    and not 0, else ``$GRADBUS_SHARD_THREADS`` where set and not 0, else the usable cores over
    the shards of the host (``$GRADBUS_HOST_SHARDS``, default 1), between 1 and
    :data:`MAX_PASS_THREADS`; 1 on a host of fewer than :data:`MIN_CORES` cores."""
    if requested is None or requested == 0:
        requested = env_count(THREADS_ENV, environ) or None
    if requested:
        return max(1, int(requested))
    cores = usable_cores() if cores is None else cores
    if cores < MIN_CORES:
        return 1       # a small host: its few cores are the other processes' as much
    if host_shards is None:
        host_shards = env_count(HOST_SHARDS_ENV, environ) or 1
    return max(1, min(MAX_PASS_THREADS, cores // max(1, host_shards)))


CLIENT_THREADS_ENV = "GRADBUS_CLIENT_THREADS"   # a client's copy threads (0 or unset: host)


def client_threads(requested: int | None = None, *, cores: int | None = None,
                   environ=None) -> int:
    """The threads a client copies big tensors with (into its push ring, out of weights
    boards): ``requested`` where given and not 0, else ``$GRADBUS_CLIENT_THREADS`` where set
    and not 0, else one per 8 usable cores, between 1 and 4 (a training host runs a worker
    per device, and the workers share its cores); 1 below :data:`MIN_CORES` cores."""
    if not requested:
        requested = env_count(CLIENT_THREADS_ENV, environ) or None
    if requested:
        return max(1, int(requested))
    cores = usable_cores() if cores is None else cores
    return 1 if cores < MIN_CORES else max(1, min(4, cores // 8))


def local_shards(cores: int | None = None) -> int:
    """Shard processes for a local cluster (``gradbus up``) on a host of ``cores`` usable
    cores: 2 up to 16 cores (one broker feeds them; each shard's big blocks are split over
    its pass threads), then one per 8 cores, at most 8 (one broker's loop is the ceiling)."""
    cores = usable_cores() if cores is None else cores
    return max(2, min(8, cores // 8))


class Spin:
    """How long a loop polls without sleeping after a turn with messages (see the module's
    docstring). ``forced_us``: an operator's number (0: never), or None to judge from the
    host, spinning ``auto_us`` where it has cores to spare."""

    __slots__ = ("forced", "auto", "clock", "cores", "load", "_on", "_next")

    def __init__(self, forced_us: int | None, auto_us: int, *, clock=time.monotonic,
                 cores: int | None = None, load=host_load):
        if forced_us is not None and (type(forced_us) is not int or forced_us < 0):
            raise ValueError(f"a spin is a whole number of microseconds >= 0, not {forced_us!r}")
        self.forced = None if forced_us is None else forced_us * 1e-6
        self.auto = auto_us * 1e-6
        self.clock = clock
        self.cores = usable_cores() if cores is None else cores
        self.load = load
        self._on = False
        self._next = float("-inf")

    @classmethod
    def from_seconds(cls, spin, auto_us: int) -> "Spin":
        """A loop's spin from its ``spin`` argument: a Spin as it is, seconds (forced), or
        None (from the host, ``auto_us`` where it has cores to spare)."""
        if isinstance(spin, cls):
            return spin
        if spin is not None and spin < 0:
            raise ValueError("spin must be >= 0 seconds")
        return cls(None if spin is None else round(spin * 1e6), auto_us)

    @property
    def chosen(self) -> str:
        """``"forced"`` or ``"host"``: who decides."""
        return "host" if self.forced is None else "forced"

    def seconds(self) -> float:
        """The spin to take now, in seconds."""
        if self.forced is not None:
            return self.forced
        now = self.clock()
        if now >= self._next:
            self._next = now + RECHECK_S
            self._on = spare(self.cores, self.load())
        return self.auto if self._on else 0.0

    def describe(self) -> str:
        """One line for a process's start-up log."""
        if self.forced is not None:
            return (f"spin {round(self.forced * 1e6)} us (set)" if self.forced
                    else "spin off (set)")
        load = self.load()
        return (f"spin {round(self.auto * 1e6)} us after work while the host has cores to "
                f"spare ({self.cores} usable, load {load:.1f}: "
                f"{'on' if spare(self.cores, load) else 'off'} now)")


def spin_then_block(poll, timeout: float, spin: float):
    """``poll(ms)`` (a socket's or poller's poll: truthy when something is ready) for up to
    ``timeout`` seconds; first, for up to ``spin`` seconds of that, ``poll(0)`` again and again,
    the core handed to any other runnable thread between two (``sched_yield``). Returns what the
    last poll returned."""
    if spin > 0 and timeout > 0:
        spin = min(spin, timeout)
        clock = time.perf_counter
        end = clock() + spin
        while True:
            got = poll(0)
            if got:
                return got
            if clock() >= end:
                break
            os.sched_yield()
        timeout -= spin
    return poll(timeout * 1000)
