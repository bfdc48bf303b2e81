"""gradbus beside PyTorch RPC and a bare shared-memory pipeline, at the same staleness, in one run.

Workers push fp32 gradients of one tensor to one server (the 2-server configurations: the same
bytes in two halves, one per server) and take back the fresh weights, with the same number of
updates in flight per worker in every configuration (``--depth``: the staleness a worker
accepts; a worker D updates ahead trains on weights D updates old). Each worker keeps D updates
in flight, waits for the oldest, takes the weights that include it, and sends the next:

    rpc                   PyTorch RPC parameter server (bench/peers_rpc.py), TensorPipe defaults,
                          D ``rpc_async`` calls in flight; the Future resolves with the weights
                          tensor (as the PyTorch tutorial writes it)
    rpc_clone             the same, the Future resolving with a copy of the weights taken under
                          the lock (a new tensor per update: a handicap, shown for reference)
    rpc_tcp               ``rpc`` with TensorPipe restricted to TCP (uv transport, basic channel)
    rpc2, rpc4            ``rpc`` with the model split in two halves (four quarters) over 2 (4) parameter-server
                          processes, each owning one half (as PyTorch's parameter-server tutorial
                          spreads a model over servers); an update is one call per server, each
                          resolving with its half's weights tensor, and a worker keeps D updates
                          (D calls per server) in flight: the same bytes per update as ``rpc``
    gradbus_shm           ``gradbus up --shards 1`` (a broker and a shard) and SDK workers, every
                          process with GRADBUS_SHM=1; D pushes (acks=1) in flight, then the
                          oldest's ACK, then ``pull(["w"], min_version=ack["ver"])``: weights
                          that include the push
    gradbus_inproc        ``gradbus up --shards 1 --inproc``: the shard runs inside the broker's
                          process (one server process, as RPC's), the workers as ``gradbus_shm``
    gradbus_shm2          ``gradbus up --shards 2``, the workers as ``gradbus_shm`` with the model
                          split in two tensors (w0, w1, ...: the first names whose blocks fall in
                          partitions of their own), pushed in one call and pulled together; the
                          broker places a new partition on the shard holding the fewest bytes, so
                          the halves land on different shards, which the run checks in the
                          broker's partition table (``gradbus partitions``) and reports as
                          ``shard_bytes``: a run where one shard holds it all fails
    gradbus_inproc2       ``gradbus_shm2`` with ``--inproc``: both shards in the broker's process
    gradbus_tier2, gradbus_tier4  ``gradbus up --tier-brokers B --shards 1 --inproc`` (B = 2, 4):
                          a broker tier of B members on this host, each a broker process with
                          its shard inside; the model split in B tensors (the first names of
                          w0, w1, ... whose home partitions the tier's map gives to different
                          members), pushed in one call (one PUSH per member) and pulled
                          together, workers as ``gradbus_shm``; the run checks that every
                          member applied pushes and reports each member's ``member_applied``.
                          Beside ``rpc2``/``rpc4`` (``rpc`` over 2 or 4 parameter servers) and
                          ``gradbus_inproc`` (one broker): the broker loop is the serial step
                          a tier spreads over cores (not run by default)
    gradbus_inproc_spin   ``gradbus_inproc`` with GRADBUS_BROKER_SPIN_US=200: the broker's loop
                          polls without sleeping for 200 us after a turn with messages, whatever
                          the host (by default it does only where the host has cores to spare,
                          gradbus/codecs/cores.py; not run by default)
    gradbus_inproc_spin_all  ``gradbus_inproc_spin`` with workers connected with
                          ``spin_us=500``: a worker waiting in a push's ``result()`` polls its
                          local link without sleeping for 500 us before it blocks, whatever the
                          host (not run by default)

Every other gradbus configuration runs with the defaults: the broker's, the shards' and the
workers' spins and the shards' pass threads chosen from the host's cores (none on a host of
fewer than 4 cores).
    gradbus_worker_noshm  the same with GRADBUS_SHM=0 in the workers (workers on other hosts)
    gradbus_shm_copy      ``gradbus_shm`` with GRADBUS_BOARD_STEP=0: the shard steps its weights
                          in place, then copies them onto its board, where ``gradbus_shm`` steps
                          them straight into the board (not run by default)
    floor_shm             bench/floor.py's ``shm`` pipeline with D pushes in flight: headers
                          through a Python ZeroMQ broker, gradients through shared-memory rings,
                          weights back through a seqlock board; no protocol
    floor_link            the same pipeline over gradbus's local links (bench/floor_link.py):
                          Unix stream sockets written and read by the processes' own threads,
                          the transport gradbus's processes of one host use
    floor_onepass         ``floor_link`` with the shard's step in one pass (numba), as gradbus's
                          shard steps, then the copy onto the board (not run by default)
    floor_inplace         ``floor_link`` with the shard's weights on its board, each step written
                          there in one pass (not run by default): what a shard that steps onto
                          its board instead of copying its weights there would do

Every configuration counts its updates in shared counters and records each update's
``time.monotonic()`` when sent, acknowledged and made fresh (the worker holds weights including
it). After every worker counted one and ``--warmup`` seconds, this process reads the counters
and the CPU time (utime + stime in /proc/PID/stat) of every process under it at both ends of a
``--seconds`` window. One JSON line per configuration, size and depth:

    updates_per_s     updates made fresh per second, all workers
    ack_p50_ms, ack_p99_ms
                      push to acknowledgement (rpc: the Future done), updates fresh in the window
    fresh_p50_ms, fresh_p99_ms
                      push to the worker holding weights that include it
    cpu_s_per_update  CPU seconds of all the configuration's processes in the window, per update
    cores_busy        cpu_s_per_update x updates_per_s: the cores the configuration keeps busy
    servers           the server processes (or shards) of the configurations that split the
                      model: 2 for rpc2 and gradbus_*2, 4 for rpc4, B for gradbus_tierB
    shard_bytes       gradbus_*2: shard -> the model's bytes it holds, from the partition table
    member_applied    gradbus_tierB: the pushes each tier member applied, in the tier's order
    vs_rpc, vs_rpc_tcp, vs_rpc2, vs_rpc4, vs_gradbus_inproc, vs_floor_shm, vs_floor_link
                      updates_per_s over that configuration's, same size, depth and round (the
                      median of the rounds' ratios with ``--repeat``); null when it did not run

``--pause-us N`` (RPC and gradbus configurations only): each worker sleeps N microseconds after
each update, as a worker computing its next gradient on a device waits for it, so that the
server and the links go idle between updates as they do in training (a tight loop keeps every
process warm); the round trips are then those after an idle spell. Lines carry ``pause_us``.

With ``--repeat N`` the rounds are interleaved (every configuration, size and depth once per
round) and a line gives medians and each round's ``rates``. ``--hops`` takes ``--pause-us`` too:
the hops after an idle spell.

``--hops`` runs gradbus alone (one worker, depth 1, ``--sizes``' first size, shared memory on)
with ``$GRADBUS_HOPS`` set (gradbus/codecs/hops.py): every process stamps each push at every
hop of its round trip with the host's monotonic clock (and, at each receiver, the time its loop
woke for the message: a crossing is the sender's hop to that wake, then the wake to the
receiver's hop), and one JSON line per pair of consecutive hops gives the median and p90
microseconds between them, over the pushes of the window. Its last line also gives the CPU
microseconds per update of each kind of process (``cpu_us_per_update_by_role``: broker, shard,
worker, launcher), stamping included. ``--hops --configs gradbus_inproc`` stamps the cluster
whose shard runs in the broker's process (no shard wake: the broker's loop hands it the batch).

The 2-server configurations are for a host with cores to spare: a 16-core run should use
``--configs rpc,rpc2,gradbus_inproc,gradbus_inproc2`` (each side with one server, then two);
on 2 cores the second server competes for the same cores as the workers. None of them runs by
default.

Usage: python bench/peers.py [--sizes 64K,4M,16M] [--depth 1,4,32] [--seconds 4] [--warmup 1.5]
                             [--configs rpc,rpc_tcp,gradbus_shm,gradbus_inproc,gradbus_worker_noshm,
                                        floor_shm,floor_link; also rpc2,gradbus_inproc2,...]
                             [--workers 2] [--repeat N] [--pause-us N] [--hops]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from gradbus.cluster import _die_with_parent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floor  # noqa: E402  (the shm pipeline, the window, the samples, the process reaping)
import throughput  # noqa: E402  (the sizes and free ports)
from floor import Samples, count_window, stop_processes  # noqa: E402

CONFIGS = ("rpc", "rpc_clone", "rpc_tcp", "rpc2", "rpc4", "gradbus_shm", "gradbus_inproc",
           "gradbus_shm2", "gradbus_inproc2", "gradbus_tier2", "gradbus_tier4",
           "gradbus_inproc_spin", "gradbus_inproc_spin_all",
           "gradbus_worker_noshm", "gradbus_shm_copy", "floor_shm", "floor_link", "floor_onepass",
           "floor_inplace")
DEFAULT_CONFIGS = ("rpc", "rpc_tcp", "gradbus_shm", "gradbus_inproc", "gradbus_worker_noshm",
                   "floor_shm", "floor_link")
REFERENCES = ("rpc", "rpc_tcp", "rpc2", "rpc4", "gradbus_inproc", "floor_shm", "floor_link")
# the configurations with the model split over two server processes (RPC) or shards (gradbus)
SERVERS = {"rpc2": 2, "rpc4": 4, "gradbus_shm2": 2, "gradbus_inproc2": 2,
           "gradbus_tier2": 2, "gradbus_tier4": 4}
# the broker tiers: configuration -> its members (each a broker with one in-process shard)
TIERS = {"gradbus_tier2": 2, "gradbus_tier4": 4}
# the floors: configuration -> (transport, the shard's step) of bench/floor.py's shm pipeline
FLOORS = {"floor_shm": ("zmq", "numpy"), "floor_link": ("link", "numpy"),
          "floor_onepass": ("link", "onepass"), "floor_inplace": ("link", "inplace")}
READY_TIMEOUT = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- CPU accounting
def cpu_seconds() -> dict[int, float]:
    """utime + stime, in seconds, of every process under this one (children, their children)."""
    parent, ticks = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # from field 3 (state) on
        parent[int(d)], ticks[int(d)] = int(fields[1]), int(fields[11]) + int(fields[12])
    children = collections.defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    out, todo = {}, [os.getpid()]
    while todo:
        for pid in children[todo.pop()]:
            out[pid] = ticks[pid] / CLK_TCK
            todo.append(pid)
    return out


def cpu_between(first: dict, last: dict) -> float:
    """CPU seconds spent between two cpu_seconds() samples by the processes of the last one."""
    return sum(t - first.get(pid, 0.0) for pid, t in last.items())


def role_of(pid: int) -> str:
    """What process ``pid`` is, from its command line: broker, shard, worker (a spawned
    benchmark worker), launcher (``gradbus up``) or other."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "other"
    if b"gradbus" in argv:
        for arg, role in ((b"broker", "broker"), (b"shard", "shard"), (b"up", "launcher")):
            if arg in argv:
                return role
    return "worker" if any(b"spawn_main" in a for a in argv) else "other"


def cpu_by_role(first: dict, last: dict, roles: dict) -> dict:
    """CPU seconds between two cpu_seconds() samples, summed per role (:func:`role_of`)."""
    out: dict = collections.defaultdict(float)
    for pid, t in last.items():
        out[roles.get(pid, "other")] += t - first.get(pid, 0.0)
    return dict(out)


@contextlib.contextmanager
def environment(**values):
    """os.environ with ``values`` set (spawned children inherit it), restored on leaving."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- configurations
@contextlib.contextmanager
def rpc_config(run: dict, counters, stop, lat, tcp_only: bool, clone: bool, hosts=None,
               pids: dict | None = None, servers: int = 1):
    """The RPC peer's world running; yields ``alive()``. With ``hosts`` (bench/hosts_net.py's
    Hosts) the server runs in its server namespace and trainer i in its worker namespace i;
    ``pids``, where given, gets the server's and the workers' process ids. ``servers``: the
    parameter servers the model is split over (bench/peers_rpc.py)."""
    import peers_rpc  # torch is imported only here
    ctx = mp.get_context("spawn")
    places = hosts.rpc_places(run["workers"]) if hosts is not None else None
    port = hosts.next_port() if hosts is not None else throughput.free_port()
    procs = peers_rpc.processes(ctx, run["workers"], run["bytes"], port, tcp_only, clone,
                                run["depth"], counters, stop, lat, places,
                                run.get("pause", 0.0), servers)
    try:
        for p in procs:
            p.start()
        if pids is not None:
            pids.update(server=procs[0].pid, workers=[p.pid for p in procs[servers:]])
        yield lambda: all(p.exitcode is None for p in procs)
    finally:
        end_workers(procs, stop, 30)


def end_workers(procs: list, stop, grace: float) -> None:
    """Sets the stop flag, gives each started process ``grace`` seconds to end by itself,
    then ends and reaps them all."""
    stop.value = 1
    for p in procs:
        if p.pid is not None:
            p.join(grace)
    stop_processes(procs)


def _gradbus_worker(url: str, index: int, nbytes: int, depth: int, counters, stop, lat,
                    codec: str = "raw", spin_us: int | None = None, pause: float = 0.0,
                    names: tuple = ("w",)) -> None:
    """A worker's loop; the model is one tensor per name of ``names``, the ``nbytes`` split
    between them (:func:`throughput.parts`), all pushed in one call."""
    import gradbus
    from gradbus.codecs import hops
    sizes = dict(zip(names, throughput.parts(nbytes // 4, len(names))))
    names = list(names)
    with gradbus.connect(url, timeout=60, spin_us=spin_us) as c:
        c.init({k: np.zeros(m, np.float32) for k, m in sizes.items()},
               optimizer=gradbus.SGD(lr=1e-6))
        c.pull(names)                       # follow the tensors
        rng = np.random.default_rng(index)
        g = {k: rng.standard_normal(m).astype(np.float32) for k, m in sizes.items()}
        waiting: collections.deque = collections.deque()
        k = 0
        while not stop.value:
            lat.sent(k)
            fut = c.push(g, acks=1, codec=codec)
            fut.add_done_callback(lambda _f, k=k: lat.acked(k))
            waiting.append((k, fut))
            k += 1
            if len(waiting) >= depth:
                j, fut = waiting.popleft()
                ack = fut.result()
                # a push over a tier's members answers one ACK per member: every tensor is at
                # the same version (each push carries them all)
                ver = ack["ver"] if "parts" not in ack else min(a["ver"] for a in ack["parts"])
                c.pull(names, min_version=ver)     # weights that include the push
                lat.fresh(j)
                if hops.ON:
                    hops.stamp("pull_returned", ack["msg"])
                counters[index] += 1
                if pause:
                    time.sleep(pause)       # the next gradient's computation, elsewhere
        c.flush(60)


def _wait_ready(up: subprocess.Popen, log: str, timeout: float, prefix: str = "ready: ") -> str:
    """The client URL ``gradbus up`` prints once its shards are alive (or another gradbus
    command on its line starting with ``prefix``: ``gradbus broker``'s ``listening: ``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split()[1]
        if up.poll() is not None:
            raise RuntimeError(f"gradbus up exited with {up.returncode}")
        time.sleep(0.1)
    raise TimeoutError(f"gradbus up not ready in {timeout:.0f}s")


def _end_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT to a process group led by ``proc`` (the way Ctrl-C stops ``gradbus up``), then
    SIGKILL to the group if its leader outlives ``grace``; the leader is reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _block_keys(name: str, elems: int) -> tuple:
    """The block keys of a float32 tensor of ``elems`` elements (the SDK's default blocks)."""
    from gradbus.codecs.partition import TensorLayout, block_elems_for
    return TensorLayout(name, "float32", (elems,), block_elems_for(4)).keys


def piece_names(pieces: int, nbytes: int, partitions: int) -> tuple:
    """Names of the ``pieces`` float32 tensors an ``nbytes`` model is split into
    (:func:`throughput.parts`): the first of w0, w1, ... whose blocks fall in partitions no
    block of an earlier one falls in. The broker places a new partition on the shard holding
    the fewest bytes (then the fewest partitions), so such pieces spread over the shards;
    :func:`shard_bytes` checks where they went."""
    from gradbus.codecs.partition import partition_of
    sizes = throughput.parts(nbytes // 4, pieces)
    names: list = []
    taken: set = set()
    for i in range(100 * pieces):
        if len(names) == pieces:
            break
        keys = _block_keys(f"w{i}", sizes[len(names)])
        ps = {partition_of(k, partitions) for k in keys}
        if len(ps) == len(keys) and not ps & taken:
            names.append(f"w{i}")
            taken |= ps
    if len(names) < pieces:
        raise ValueError(f"no {pieces} tensors of {nbytes} bytes in distinct partitions")
    return tuple(names)


def shard_bytes(url: str, names: tuple, nbytes: int) -> dict:
    """Shard -> the bytes of the model's tensors ``names`` (``nbytes`` in all) it holds, from
    the broker's partition table (as ``gradbus partitions`` shows it): each block's partition,
    that partition's owner and its bytes."""
    from gradbus import admin
    from gradbus.codecs.partition import partition_of
    table = admin.partitions(url, timeout=30)
    out: dict = collections.defaultdict(int)
    for name, elems in zip(names, throughput.parts(nbytes // 4, len(names))):
        for key in _block_keys(name, elems):
            p = partition_of(key, len(table["owners"]))
            out[table["owners"][p] or "unplaced"] += table["bytes"][p]
    return dict(sorted(out.items()))


def tier_names(members: int, url: str) -> tuple:
    """Names of ``members`` tensors, each held by another member of the broker tier at
    ``url``: the first of w0, w1, ... whose home partitions the tier's map gives to a member
    no earlier one went to."""
    import gradbus
    with gradbus.connect(url, timeout=60) as c:
        names: dict[int, str] = {}
        for i in range(100 * members):
            names.setdefault(c.tier.owner(f"w{i}"), f"w{i}")
            if len(names) == members:
                return tuple(names[m] for m in sorted(names))
    raise ValueError(f"no {members} names on {members} different members")


def member_applied(url: str) -> list[int]:
    """Pushes each member of the broker tier at ``url`` applied, in the tier's order."""
    from gradbus import admin
    return [admin.status(m, timeout=30)["counters"].get("pushes_applied", 0)
            for m in admin.tier_urls(url, timeout=30)]


@contextlib.contextmanager
def gradbus_config(run: dict, counters, stop, lat, worker_shm: str, hosts=None,
                   pids: dict | None = None, board_step: bool = True, inproc: bool = False,
                   spin_us: int = 0, worker_spin_us: int | None = None, pieces: int = 1,
                   info: dict | None = None, tier: int = 1):
    """``gradbus up`` and the workers running (``run`` may name ``shards``, 1 by default, the
    workers' ``codec`` and the shard's ``weights_codec``); yields ``alive()``. ``pieces``: the
    tensors the model is split into (:func:`piece_names`; one, ``w``, by default); ``info``,
    where given, gets ``shard_bytes`` (:func:`shard_bytes`) as the workers leave them. Without
    ``board_step`` the shard copies its weights onto its board after each step (so does
    ``GRADBUS_BOARD_STEP=0`` in the environment, e.g. for ``--hops``). With ``hosts``
    (bench/hosts_net.py's Hosts), ``up`` runs in its server namespace on the server's address
    and worker i in worker namespace i; ``pids`` as for :func:`rpc_config`; ``spin_us``: the
    broker's spin (``--spin-us``), ``worker_spin_us`` the workers' (``spin_us``). ``tier``:
    a broker tier of that many members, each with ``run``'s shards (:func:`tier_names`);
    ``info`` gets ``member_applied``."""
    ctx = mp.get_context("spawn")
    up, procs = None, []
    env = {**os.environ, "GRADBUS_SHM": "1"}
    if not board_step:
        env["GRADBUS_BOARD_STEP"] = "0"
    if spin_us:
        env["GRADBUS_BROKER_SPIN_US"] = str(spin_us)
    if run.get("weights_codec"):
        env["GRADBUS_SHARD_WEIGHTS_CODEC"] = run["weights_codec"]
    cmd = [sys.executable, "-m", "gradbus", "up", "--shards", str(run.get("shards", 1))]
    if inproc:
        cmd.append("--inproc")
    if tier > 1:
        cmd += ["--tier-brokers", str(tier)]
    if hosts is None:
        cmd += ["--port", str(throughput.free_port())]
    else:
        cmd = [*hosts.exec_prefix(hosts.server), *cmd, "--host", hosts.server_addr,
               "--port", str(hosts.next_port())]
    with tempfile.NamedTemporaryFile("w+", prefix="gradbus-peers-up-", suffix=".log") as log:
        try:
            up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  preexec_fn=_die_with_parent)
            url = _wait_ready(up, log.name, READY_TIMEOUT)
            names = ("w",)
            if tier > 1:
                names = tier_names(tier, url)
            elif pieces > 1:
                from gradbus import admin
                names = piece_names(pieces, run["bytes"],
                                    len(admin.partitions(url, timeout=30)["owners"]))
            with environment(GRADBUS_SHM=worker_shm):
                for i in range(run["workers"]):
                    args = (url, i, run["bytes"], run["depth"], counters, stop, lat[i],
                            run.get("codec", "raw"), worker_spin_us, run.get("pause", 0.0),
                            names)
                    target = _gradbus_worker
                    if hosts is not None:
                        target, args = hosts.in_worker(i, target, args)
                    procs.append(ctx.Process(target=target, args=args, daemon=True))
                for p in procs:
                    p.start()
            if pids is not None:
                pids.update(server=up.pid, workers=[p.pid for p in procs])
            yield lambda: up.poll() is None and all(p.exitcode is None for p in procs)
            if tier > 1:
                applied = member_applied(url)
                if not all(applied):
                    raise RuntimeError(f"a tier member applied no push: {applied}")
                if info is not None:
                    info["member_applied"] = applied
            elif pieces > 1:
                held = shard_bytes(url, names, run["bytes"])
                if sum(1 for b in held.values() if b) < min(pieces, run.get("shards", 1)):
                    raise RuntimeError(f"the model's pieces are not spread over the shards: "
                                       f"{held}")
                if info is not None:
                    info["shard_bytes"] = held
        except Exception:
            log.seek(0)
            print(f"peers: gradbus up said:\n{log.read()[-2000:]}", file=sys.stderr)
            raise
        finally:
            end_workers(procs, stop, 60)
            if up is not None:
                _end_group(up)


@contextlib.contextmanager
def _floor(run: dict, counters, stop, lat, transport: str, step: str = "numpy"):
    with floor.shm_pipeline(run["bytes"], counters, stop, run["workers"], run["depth"],
                            lat, transport, step) as procs:
        yield lambda: all(p.exitcode is None for p in procs)


def start(config: str, run: dict, counters, stop, lat, info: dict | None = None):
    """The configuration's processes as a context manager yielding ``alive()``; ``info``, where
    given, gets what the configuration reports of itself (:func:`gradbus_config`)."""
    servers = SERVERS.get(config, 1)
    if config in ("rpc", "rpc_tcp", "rpc_clone", "rpc2", "rpc4"):
        return rpc_config(run, counters, stop, lat, tcp_only=config == "rpc_tcp",
                          clone=config == "rpc_clone", servers=servers)
    if config in ("gradbus_shm", "gradbus_worker_noshm", "gradbus_shm_copy", "gradbus_inproc",
                  "gradbus_inproc_spin", "gradbus_inproc_spin_all", "gradbus_shm2",
                  "gradbus_inproc2"):
        spin = config.startswith("gradbus_inproc_spin")
        return gradbus_config({**run, "shards": servers} if servers > 1 else run, counters,
                              stop, lat, "0" if config == "gradbus_worker_noshm" else "1",
                              board_step=config != "gradbus_shm_copy",
                              inproc=config.startswith("gradbus_inproc"),
                              spin_us=200 if spin else 0,
                              worker_spin_us=500 if config == "gradbus_inproc_spin_all" else None,
                              pieces=servers, info=info)
    if config in TIERS:
        return gradbus_config(run, counters, stop, lat, "1", inproc=True, tier=TIERS[config],
                              info=info)
    if config in FLOORS:
        if run.get("pause"):
            raise ValueError(f"{config} takes no pause")
        return _floor(run, counters, stop, lat, *FLOORS[config])
    raise ValueError(f"unknown configuration {config!r}")


def _ms(values: list, q: float):
    return round(float(np.percentile(values, q)) * 1e3, 3) if values else None


def measure(config: str, run: dict) -> dict:
    """One configuration at one size and depth: its updates per second, round trips and CPU
    seconds per update."""
    ctx = mp.get_context("spawn")
    counters, stop = ctx.RawArray("q", run["workers"]), ctx.RawValue("b", 0)
    lat = [Samples(ctx) for _ in range(run["workers"])]
    marks: dict = {"roles": {}}
    info: dict = {}

    def sample():
        marks.setdefault("t0", time.monotonic())
        marks["t1"] = time.monotonic()
        now = cpu_seconds()
        for pid in now.keys() - marks["roles"].keys():
            marks["roles"][pid] = role_of(pid)
        return now

    with start(config, run, counters, stop, lat, info) as alive:
        win = count_window(counters, alive, run["warmup"], run["seconds"], sample=sample,
                           ready_timeout=READY_TIMEOUT)
    acks, fresh = [], []
    for s in lat:
        a, f = s.window(marks["t0"], marks["t1"])
        acks += a
        fresh += f
    updates = win["events"]
    return {"updates_per_s": updates / win["seconds"],
            "ack_p50_ms": _ms(acks, 50), "ack_p99_ms": _ms(acks, 99),
            "fresh_p50_ms": _ms(fresh, 50), "fresh_p99_ms": _ms(fresh, 99),
            "cpu_s_per_update": cpu_between(win["first"], win["last"]) / updates
            if updates else None,
            "cpu_us_per_update_by_role": {
                k: round(v / updates * 1e6, 1)
                for k, v in sorted(cpu_by_role(win["first"], win["last"], marks["roles"]).items())
            } if updates else None, **info}


# ----------------------------------------------------------------------------- output
def _sig(x, digits: int = 4):
    return None if x is None else float(f"{x:.{digits}g}")


def _median(runs: list, field: str):
    vals = [r[field] for r in runs if r.get(field) is not None]
    return statistics.median(vals) if vals else None


def lines(key: tuple, configs: list, rounds: list, workers: int, pause_us: int = 0) -> list[dict]:
    """One line per configuration at ``key`` = (size, depth) from the rounds' results."""
    size, depth = key
    out = []
    for config in configs:
        runs = [r.get(config) for r in rounds]
        ok = [r for r in runs if r and r.get("updates_per_s")]
        line = {"bench": "peers", "config": config, "size": size, "bytes": throughput.SIZES[size],
                "depth": depth, "workers": workers, **({"pause_us": pause_us} if pause_us else {}),
                "updates_per_s": round(_median(ok, "updates_per_s"), 1) if ok else None}
        for f in ("ack_p50_ms", "ack_p99_ms", "fresh_p50_ms", "fresh_p99_ms"):
            line[f] = _sig(_median(ok, f))
        line["cpu_s_per_update"] = _sig(_median(ok, "cpu_s_per_update"))
        # the cores the configuration keeps busy, all its processes
        line["cores_busy"] = (_sig(line["cpu_s_per_update"] * line["updates_per_s"], 3)
                              if line["cpu_s_per_update"] and line["updates_per_s"] else None)
        if config in SERVERS:
            line["servers"] = SERVERS[config]
        for f in ("shard_bytes", "member_applied"):
            if any(r.get(f) for r in ok):
                line[f] = next(r[f] for r in ok if r.get(f))
        for ref in REFERENCES:
            ratios = [r[config]["updates_per_s"] / r[ref]["updates_per_s"] for r in rounds
                      if r.get(config, {}).get("updates_per_s")
                      and r.get(ref, {}).get("updates_per_s")]
            line[f"vs_{ref}"] = round(statistics.median(ratios), 3) if ratios else None
        if len(rounds) > 1:
            line["repeats"] = len(rounds)
            line["rates"] = [round(r["updates_per_s"], 1) if r and r.get("updates_per_s")
                             else None for r in runs]
        errors = [r["error"] for r in runs if r and "error" in r]
        if errors:
            line["error"] = errors[0]
        line["cpus"] = os.cpu_count()
        out.append(line)
    return out


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # runs every finally: children reaped, segments removed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,4M,16M")
    ap.add_argument("--depth", default="1,4,32", help="updates in flight per worker, a list")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds; lines give medians")
    ap.add_argument("--pause-us", type=int, default=0,
                    help="microseconds each worker sleeps after each update (RPC and gradbus)")
    ap.add_argument("--hops", action="store_true",
                    help="gradbus alone, one worker, depth 1: the median time between hops")
    a = ap.parse_args(argv)
    configs, sizes = a.configs.split(","), a.sizes.split(",")
    try:
        depths = [int(d) for d in a.depth.split(",")]
    except ValueError:
        depths = []
    if a.pause_us < 0 or (a.pause_us and set(configs) & set(FLOORS)):
        ap.error("--pause-us must be at least 0, and is for RPC and gradbus configurations")
    if (a.repeat < 1 or a.workers < 1 or not depths or min(depths) < 1
            or not set(configs) <= set(CONFIGS) or not set(sizes) <= set(throughput.SIZES)):
        ap.error(f"--repeat and --workers must be at least 1, --depth a list of positive ints, "
                 f"--configs a list of {', '.join(CONFIGS)} and --sizes a list of "
                 f"{', '.join(throughput.SIZES)}")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return _hops(a, sizes[0]) if a.hops else _run(a, configs, sizes, depths)
    finally:        # multiprocessing's resource tracker, the one child no configuration reaps
        with contextlib.suppress(Exception):
            from multiprocessing import resource_tracker
            resource_tracker._resource_tracker._stop()


def _run(a, configs: list, sizes: list, depths: list) -> int:
    keys = [(s, d) for s in sizes for d in depths]
    results = {key: [] for key in keys}
    for _ in range(a.repeat):
        for key in keys:
            run = {"bytes": throughput.SIZES[key[0]], "depth": key[1], "workers": a.workers,
                   "warmup": a.warmup, "seconds": a.seconds, "pause": a.pause_us * 1e-6}
            round_ = {}
            for config in configs:
                try:
                    round_[config] = measure(config, run)
                except Exception as e:       # noqa: BLE001  (the other configurations still run)
                    round_[config] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"peers: {config} at {key[0]} depth {key[1]} failed: {e}",
                          file=sys.stderr, flush=True)
            results[key].append(round_)
    ran = [c for c in configs
           if any("error" not in r[c] for rs in results.values() for r in rs)]
    print(f"peers: configs run: {', '.join(ran) or 'none'}"
          + (f"; failed: {', '.join(c for c in configs if c not in ran)}"
             if len(ran) < len(configs) else ""), file=sys.stderr, flush=True)
    for key in keys:
        for line in lines(key, configs, results[key], a.workers, a.pause_us):
            print(json.dumps(line), flush=True)
    return 0 if ran else 1


def _hops(a, size: str) -> int:
    """gradbus alone, one worker at depth 1, every process stamping each push's hops."""
    from gradbus.codecs import hops
    directory = tempfile.mkdtemp(prefix="gradbus-hops-")
    run = {"bytes": throughput.SIZES[size], "depth": 1, "workers": 1, "warmup": a.warmup,
           "seconds": a.seconds, "pause": a.pause_us * 1e-6}
    named = {"pause_us": a.pause_us} if a.pause_us else {}
    config = "gradbus_inproc" if a.configs == "gradbus_inproc" else "gradbus_shm"
    try:
        with environment(GRADBUS_HOPS=directory):
            t0 = time.monotonic_ns()
            res = measure(config, run)
        stamps = hops.read(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    # the pushes of the window: the last ``seconds`` before the run ended, past the warmup
    done = [s for s in stamps.values() if "pull_returned" in s and s["push"] > t0]
    done.sort(key=lambda s: s["push"])
    done = done[len(done) // 4:]          # past the start-up
    gaps: dict = collections.defaultdict(list)
    # in one process, a wake is the broker's loop's: not a crossing to the shard and back
    skip = {"shard_wake", "broker_wake_applied"} if config == "gradbus_inproc" else set()
    for s in done:
        seen = [h for h in hops.HOPS if h in s and h not in skip]
        for x, y in zip(seen, seen[1:]):
            gaps[(x, y)].append((s[y] - s[x]) / 1e3)
        gaps[("push", "pull_returned")].append((s["pull_returned"] - s["push"]) / 1e3)
    for (x, y), us in gaps.items():
        print(json.dumps({"bench": "peers_hops", "config": config, "size": size, **named,
                          "from": x, "to": y,
                          "median_us": round(statistics.median(us), 1),
                          "p90_us": round(float(np.percentile(us, 90)), 1), "pushes": len(us),
                          "cpus": os.cpu_count()}), flush=True)
    print(json.dumps({"bench": "peers_hops", "config": config, "size": size, **named,
                      "updates_per_s": round(res["updates_per_s"], 1), "fresh_p50_ms": res["fresh_p50_ms"],
                      "cpu_s_per_update": _sig(res["cpu_s_per_update"]),
                      "cpu_us_per_update_by_role": res["cpu_us_per_update_by_role"]}),
          flush=True)
    return 0 if gaps else 1


if __name__ == "__main__":
    sys.exit(main())
