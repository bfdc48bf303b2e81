"""Shared test rigs: cores wired in memory (no sockets) and the helpers that feed them.

:class:`Rig` wires a broker core to shard cores; :class:`RepRig` adds held-back messages, ticks
and joins. Both run every core's ``validate_state()`` after each event they feed (a client
message, a shard's reply, a tick), so a broken invariant fails the test at the event that broke
it. Fixtures live in ``conftest.py``; test modules import rigs and helpers from here only.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from unittest import mock

import msgpack
import numpy as np
import pytest
import zmq

import gradbus
from gradbus.broker.actions import Publish, ToClient, ToShard
from gradbus.broker.core import BrokerCore
from gradbus.codecs import jit, net, security, shm, specs, wire
from gradbus.codecs.partition import TensorLayout
from gradbus.shards import backend, checkpoint
from gradbus.shards.core import ShardCore
from gradbus.workers.actions import Send
from gradbus.workers.agent_state import AgentState
from gradbus.workers.cache import WeightCache
from gradbus.workers.commands import SendMessage
from gradbus.workers.credit import CreditWindow
from gradbus.workers.resend import ResendTimer
from gradbus.workers.versions import Versions

# The half-precision codecs' two paths: numba's loops where numba imports, numpy everywhere.
JIT_PATHS = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="numba is not installed"))]


@contextlib.contextmanager
def jit_path(path: str):
    """Run the codecs on ``path`` (one of :data:`JIT_PATHS`) inside the block."""
    if path == "numba":
        assert jit.loops() is not None
        yield
    else:
        with mock.patch.object(jit, "loops", lambda: None):
            yield


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    """Poll ``cond`` until truthy or fail after ``timeout`` seconds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def run_in_threads(target, count: int, timeout: float = 120.0) -> list[BaseException]:
    """Run ``target(i)`` for i in range(count), each in a thread of its own, and join them;
    what they raised (the test asserts there is nothing)."""
    errors: list[BaseException] = []

    def run(i):
        try:
            target(i)
        except BaseException as e:      # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


def gradbus_segments(directory: str) -> list[str]:
    """The gradbus shared-memory segments in ``directory``."""
    return sorted(n for n in os.listdir(directory) if shm.owned(n) is not None)


def zombie_or_gone(pid: int) -> bool:
    """The process ``pid`` has exited (reaped or not). Reaped between the open and the read,
    its stat file answers ESRCH."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


SGD = {"name": "sgd", "lr": 0.5}
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}


def unpack(frame) -> dict:
    return msgpack.unpackb(frame)


class CheckedShard(ShardCore):
    """A shard core that checks its invariants after every message it handles."""

    def handle(self, frames, header=None):
        out = super().handle(frames, header)
        self.validate_state()
        return out


class Rig:
    """A broker core wired to shard cores in memory: frames go straight across."""

    def __init__(self, shards=("s0",), partitions=16, **kw):
        self.now = 0.0
        self.broker = BrokerCore(partitions, now=0.0, **kw)
        self.shards = {sid: CheckedShard(sid) for sid in shards}
        self.to_clients: list = []
        self.published: list = []
        self.held: list = []     # batches captured instead of delivered (when hold=True)
        self.hold = False
        for sid in shards:
            self.deliver(self.broker.on_backend(sid.encode(),
                                                [wire.pack(wire.REGISTER, shard=sid)], self.now))
            self.check()

    def check(self) -> None:
        """Every core's invariants: the broker's and each shard's (also those put in by hand)."""
        self.broker.validate_state()
        for sc in self.shards.values():
            sc.validate_state()

    def deliver(self, actions):
        for a in actions:
            if isinstance(a, ToClient):
                self.to_clients.append((a.identity, [bytes(f) for f in a.frames]))
            elif isinstance(a, Publish):
                self.published.append([bytes(f) for f in a.frames])
            elif isinstance(a, ToShard):
                if self.hold and unpack(a.frames[0])["kind"] == "batch":
                    self.held.append(a)
                    continue
                self.to_shard(a.identity.decode(), a.frames)

    def to_shard(self, sid, frames):
        if unpack(frames[0])["kind"] in ("registered", "heartbeat"):
            return
        for out in self.shards[sid].handle([bytes(f) for f in frames]):
            actions = self.broker.on_backend(sid.encode(), [bytes(f) for f in out], self.now)
            self.check()
            self.deliver(actions)

    def client(self, ident, frames):
        self.deliver(self.broker.on_frontend(ident, frames, self.now))
        self.check()
        self.deliver(self.broker.flush(self.now))
        self.check()

    def replies(self, ident):
        """Replies to one client, an ACK for several pushes counted once per push."""
        out = []
        for i, f in self.to_clients:
            if i == ident:
                h = unpack(f[0])
                out += [{**h, "msg": m} for m in h["msgs"]] if "msgs" in h else [h]
        self.to_clients = [x for x in self.to_clients if x[0] != ident]
        return out


class RepRig(Rig):
    """A Rig whose messages to chosen shards can be held back and delivered later."""

    def __init__(self, shards=("s0", "s1", "s2"), **kw):
        self.intercept = None     # (shard id, kind) -> True to hold the message
        self.dead: set = set()    # shards that send no heartbeat on tick()
        super().__init__(shards, **kw)

    def deliver(self, actions):
        for a in actions:
            if isinstance(a, ToShard) and self.intercept and self.intercept(
                    a.identity.decode(), unpack(a.frames[0])["kind"]):
                self.held.append(a)
                continue
            super().deliver([a])

    def release(self, sid=None):
        keep, go = [], []
        for a in self.held:
            (go if sid is None or a.identity.decode() == sid else keep).append(a)
        self.held = keep
        for a in go:
            self.to_shard(a.identity.decode(), a.frames)

    def register(self, sid):
        actions = self.broker.on_backend(sid.encode(), [wire.pack(
            wire.REGISTER, shard=sid, **self.shards[sid].register_fields())], self.now)
        self.check()
        self.deliver(actions)

    def tick(self, dt):
        self.now += dt
        for sid in self.shards:
            info = self.broker.shards.get(sid)
            if info and info.alive and sid not in self.dead:
                self.broker.on_backend(sid.encode(), [wire.pack(wire.HEARTBEAT)], self.now)
                self.check()
        self.deliver(self.broker.on_tick(self.now))
        self.check()
        self.deliver(self.broker.flush(self.now))
        self.check()

    def join(self, sid, rounds=60, dt=0.05):
        """A new shard registers; tick until the moves it started are done."""
        self.shards[sid] = CheckedShard(sid)
        self.register(sid)
        for _ in range(rounds):
            self.tick(dt)
            b = self.broker
            if not b.moves and not b.syncing and not b.rebalance_wanted:
                return

    def digests(self, p):
        return {sid: sc.partition_digest(p) for sid, sc in self.shards.items()
                if p in sc.store.partitions}


def init_one_block(sc, opt: dict, n: int) -> None:
    """``sc`` (a shard core, the primary "p0" of partition 0) creates block ``w/0`` of ``n``
    float32 values, uniform in [-1, 1) from seed 5, stepped by ``opt``."""
    layout = TensorLayout("w", "float32", (n,), n * 4)
    sc.handle([wire.pack(wire.BATCH, [], parts=[{
        "p": 0, "seq": 1, "epoch": 1, "o": "p0",
        "e": [{"op": "init", "key": "w/0", "layout": layout.to_wire(),
               "rule": {"name": "uniform", "low": -1.0, "high": 1.0, "seed": 5},
               "opt": opt}]}])])


def encode_blocks(layout, values):
    """``values`` cut into the layout's blocks: (descriptors, frames)."""
    descs, bufs = [], []
    flat = values.reshape(-1)
    for i, key in enumerate(layout.block_keys()):
        a, b = layout.block_range(i)
        d, buf = wire.encode_tensor(key, flat[a:b].copy())
        descs.append(d)
        bufs.append(bytes(buf))
    return descs, bufs


def init_msg(msg, name, values, opt=SGD):
    layout = TensorLayout(name, values.dtype.name, values.shape, 4)
    descs, bufs = encode_blocks(layout, values)
    return [wire.pack(wire.INIT, descs, msg=msg, opt=opt,
                      tensors=[{**layout.to_wire(), "init": {"name": "given"}}]), *bufs], layout


def push_msg(msg, layout, grad):
    descs, bufs = encode_blocks(layout, grad)
    return [wire.pack(wire.PUSH, descs, msg=msg, acks=1), *bufs]


def shard_with_state():
    """A shard core holding one Adam tensor after ten pushes (for checkpoint tests)."""
    rig = RepRig(("s0",))
    frames, layout = init_msg(1, "w", np.arange(40, dtype=np.float32), opt=ADAM)
    rig.client(b"c", frames)
    rng = np.random.default_rng(0)
    for m in range(2, 12):
        rig.client(b"c", push_msg(m, layout, rng.standard_normal(40).astype(np.float32)))
    return rig.shards["s0"]


# ---- optimizer steps through a backend (the numpy backend, CuPy, the kernels as C++) --------
SPECS = {"sgd": specs.SGD(lr=0.1), "momentum": specs.SGD(lr=0.1, momentum=0.9),
         "adam": specs.Adam(lr=0.05, betas=(0.9, 0.99), eps=1e-6),
         "adagrad": specs.Adagrad(lr=0.1, eps=1e-6)}
STATE = {"sgd": (), "momentum": ("v",), "adam": ("m", "v"), "adagrad": ("h",)}
NUMPY = backend.NumpyBackend(jit=False)


def backend_steps(be, name, w, grads, k):
    """Step ``w`` (a backend array, in place) once per gradient sum through the backend's step
    functions, with the hyper-parameters of ``SPECS[name]``; returns the state arrays."""
    spec = SPECS[name]
    st = {s: be.xp.zeros(w.size, w.dtype) for s in STATE[name]}
    for t, g in enumerate(grads, start=1):
        if name == "sgd":
            be.sgd_step(w, g, spec.lr)
        elif name == "momentum":
            be.momentum_step(w, g, st["v"], k, spec.lr, spec.momentum)
        elif name == "adam":
            be.adam_step(w, g, st["m"], st["v"], k, t * k, spec.lr, *spec.betas, spec.eps)
        else:
            be.adagrad_step(w, g, st["h"], k, spec.lr, spec.eps)
    return st


def steps_beside_numpy(be, name, n, dtype, k) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The same steps of ``SPECS[name]`` on ``n`` values through backend ``be`` and through
    numpy: ``(what, be's result on the host, numpy's)`` for the weights and each state array."""
    w0, grads = data(n, dtype)
    w = be.asarray(w0)
    st = backend_steps(be, name, w, [be.asarray(g) for g in grads], k)
    ref_w = w0.copy()
    ref_st = backend_steps(NUMPY, name, ref_w, grads, k)
    return [("w", be.to_host(w), ref_w),
            *((key, be.to_host(a), ref_st[key]) for key, a in st.items())]


def data(n, dtype, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(dtype)
    return w, [rng.standard_normal(n).astype(dtype) for _ in range(steps)]


# ---- a backend connection of the test's own -------------------------------------------
@contextlib.contextmanager
def backend_peer(url: str, curve=None, routing_id: bytes = b"intruder"):
    """A DEALER of the test's own on the broker's backend under ``routing_id`` (found with a
    HELLO), open for the block."""
    ctx = zmq.Context()
    s = None
    try:
        welcome = net.hello(ctx, url, "shard", 10.0, curve=curve)
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        if curve is not None:
            security.client_setup(s, curve)
        s.setsockopt(zmq.ROUTING_ID, routing_id)
        s.connect(net.url(net.split_url(url)[0], welcome["backend"]))
        yield s
    finally:
        if s is not None:
            s.close(linger=0)
        ctx.term()


def register_as(url: str, shard_id: str, curve=None,
                routing_id: bytes = b"intruder") -> dict:
    """Connect a DEALER of our own to the broker's backend and send one REGISTER for
    ``shard_id`` (holding nothing); returns the broker's answer."""
    with backend_peer(url, curve, routing_id) as s:
        s.send(wire.pack(wire.REGISTER, shard=shard_id, holds=[]))
        assert s.poll(10_000), "no answer to the register"
        return unpack(s.recv())


# ---- a cluster's state at its end ---------------------------------------------------------
def cluster_cores(cluster) -> list:
    """The cores an in-process cluster runs (its broker's and shards'), to check after it
    stopped; none for a cluster of processes."""
    cores = [s.core for s in cluster.shard_servers.values()]
    return cores + ([cluster.broker.core] if cluster.broker is not None else [])


def replica_mismatches(cluster, timeout: float = 2.0) -> list[str]:
    """Replicas of one partition at the same seq must hold the same bytes: the partitions
    where two live shards say otherwise (asked once, without waiting for catch-ups; nothing
    where the broker no longer answers or the cluster keeps one replica)."""
    from gradbus import admin
    from gradbus.codecs.errors import GradbusError
    if cluster.replicas < 2 or cluster.url is None:
        return []
    try:
        table = admin.partitions(cluster.url, timeout, curve=cluster.curve)
        digests = admin.digest(cluster.url, timeout=timeout, curve=cluster.curve)
    except (GradbusError, TimeoutError, OSError):
        return []
    syncing = {p for p, s in enumerate(table.get("syncing", [])) if s}
    by_p: dict[int, dict[int, set]] = {}
    for parts in digests.values():
        for p, (seq, d) in parts.items():
            if p not in syncing:
                by_p.setdefault(p, {}).setdefault(seq, set()).add(d)
    return [f"partition {p}: replicas at seq {seq} differ" for p, seqs in sorted(by_p.items())
            for seq, ds in seqs.items() if len(ds) > 1]


def state_problems(cores) -> list[str]:
    """What each core's ``validate_state()`` finds broken (broker cores raise RuntimeError,
    shard cores AssertionError)."""
    out = []
    for core in cores:
        try:
            core.validate_state()
        except (AssertionError, RuntimeError) as e:
            out.append(f"{type(core).__name__} {getattr(core, 'shard_id', '')}: {e}".strip())
    return out


# ---- restores and damaged checkpoints ------------------------------------------------------

CHECKPOINT_DAMAGES = ["manifest", "older_file", "missing_file", "header_byte"]


def damage_checkpoint(kind: str, old: checkpoint.Checkpoint, new: checkpoint.Checkpoint) -> str:
    """Damage ``new`` the ``kind`` way; the file damaged."""
    if kind == "manifest":
        path = os.path.join(new.path, checkpoint.MANIFEST)
        with open(path, "wb") as f:
            f.write(b"\x93garbage, not a manifest")
        return path
    p = new.partitions[0][0]
    path = os.path.join(new.path, f"p{p:05d}.gbs")
    if kind == "older_file":
        shutil.copyfile(os.path.join(old.path, f"p{p:05d}.gbs"), path)
    elif kind == "missing_file":
        os.remove(path)
    else:
        with open(path, "rb") as f:
            data = bytearray(f.read())
        at = data.index(wire.STATE.encode(), len(checkpoint.MAGIC) + 4)   # the kind's value
        data[at] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(data))
    return path


def restore_process(*args):
    return subprocess.Popen([sys.executable, "-m", "gradbus", "restore", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def restore_ready(proc, timeout=60.0) -> tuple[str, list[str]]:
    """The restored cluster's URL, and what it said before."""
    said, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited with {proc.wait()}: {said}")
        if line.startswith("ready: "):
            return line.split(" ", 1)[1].strip(), said
        said.append(line.rstrip("\n"))
    raise AssertionError("never ready")


def restore_stop(proc) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        proc.stdout.close()


def restored_serves(args, version: int, push: bool = False) -> tuple[np.ndarray, list[str]]:
    """``w`` as a cluster restored with ``args`` serves it at ``version``; with ``push``, one
    more push of ones is applied (and acknowledged) before the restored cluster stops."""
    proc = restore_process(*args)
    try:
        url, said = restore_ready(proc)
        with gradbus.connect(url) as c:
            w = c.pull(["w"], min_version=version, timeout=30)["w"].copy()
            assert c.version("w") == version
            if push:
                c.push({"w": np.ones_like(w)}).result(10)
                c.pull(["w"], min_version=version + 1, timeout=30)
    finally:
        assert restore_stop(proc) == 0
    return w, said


# ---- the client's agent state, driven without sockets ----------------------------------------

class AgentClock:
    """The injected monotonic clock: time moves only when a test says so."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_agent_state(welcome=None, resend: ResendTimer | None = None, window: int = 8):
    clock = AgentClock()
    cond = threading.Condition()
    state = AgentState(welcome if welcome is not None else {"partitions": 4},
                       cache=WeightCache(4, conflated=True), cond=cond, credit=CreditWindow(window, 1 << 20, cond),
                       versions=Versions(), stats=collections.Counter(),
                       next_id=itertools.count(1).__next__,
                       max_tensor_bytes=wire.MAX_TENSOR_BYTES, resend=resend, clock=clock)
    return state, clock


def agent_push(state: AgentState, msg: int, acks: int = 1) -> tuple[list, Future | None]:
    """Hand ``state`` a push as Client does: credit first, then the command."""
    state.credit.take(10, 1.0, lambda: msg, lambda: None, state.stats)
    frames = [wire.pack(wire.PUSH, [], msg=msg, acks=acks)]
    fut = Future() if acks else None
    state.command(SendMessage(msg, frames, fut))
    assert [a.frames for a in state.take()] == [frames]     # sent at once
    state.validate_state()
    return frames, fut


def agent_feed(state: AgentState, header: bytes) -> None:
    state.heard()
    state.reply([header])
    state.validate_state()


def agent_resent(actions: list, frames: list) -> int:
    return sum(1 for a in actions if isinstance(a, Send) and a.frames is frames)


# ---- connections whose handshake fails -------------------------------------------------------

def drop_pipe_after_connect() -> list:
    """Make every DEALER's ``connect`` return only once libzmq dropped the connection's pipe
    (its handshake failed) or after 5 s: the order in which a send right after connect used
    to block for ever. Returns a list that gets one entry per connect whose pipe was gone.

    Not every connect gets there: now and then, mostly under load, libzmq reports the failed
    handshake (HANDSHAKE_FAILED_AUTH, then DISCONNECTED) and keeps the socket's pipe, so a
    send is queued and the failure is seen on the monitor instead. :func:`until_dropped`
    repeats a call until one of its connects met a dropped pipe."""
    import zmq
    plain = zmq.Socket.connect
    dropped: list = []

    def connect(self, addr):
        out = plain(self, addr)
        if self.socket_type == zmq.DEALER:
            deadline = time.monotonic() + 5
            while self.poll(0, zmq.POLLOUT) and time.monotonic() < deadline:
                time.sleep(0.005)
            if not self.poll(0, zmq.POLLOUT):
                dropped.append(addr)
        return out
    zmq.Socket.connect = connect
    return dropped


def until_dropped(call, dropped: list, tries: int = 5) -> None:
    """Run ``call()`` (which must succeed each time) until one of its connects met a dropped
    pipe (``dropped``, from :func:`drop_pipe_after_connect`, grew), at most ``tries`` times;
    fails if none did."""
    for _ in range(tries):
        before = len(dropped)
        call()
        if len(dropped) > before:
            return
    raise AssertionError(f"no connect of {tries} calls met a dropped pipe")


class TcpListener:
    """A TCP listener on 127.0.0.1 that accepts every connection and either writes
    ``answer`` to it or says nothing; closes them all at exit."""

    def __init__(self, answer: bytes | None):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, name="test-listener", daemon=True)

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.answer:
                try:
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)
        for c in self.conns:
            c.close()


# ----------------------------------------------------------------------------- child processes
def _end_with_test() -> None:   # in the child, between fork and exec
    """The child gets SIGTERM when the test process ends, even killed by a timeout."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn_gradbus(*args) -> subprocess.Popen:
    """``python -m gradbus args...``, stdout piped (text), stderr dropped; it ends with the
    test process."""
    return subprocess.Popen([sys.executable, "-m", "gradbus", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=_end_with_test)


@contextlib.contextmanager
def gradbus_up(*args, ready_within: float = 90.0):
    """``gradbus up args...`` (:func:`spawn_gradbus`) until its ready line: yields the
    process and the URL it named; killed at the end if it still runs, its stdout closed."""
    proc = spawn_gradbus("up", *args)
    try:
        line = wait_for(lambda: proc.stdout.readline().strip(), ready_within, "the ready line")
        assert line.startswith("ready: tcp://"), line
        yield proc, line.split(" ", 1)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def cpu_hog() -> subprocess.Popen:
    """A busy-loop process (a loaded machine); it ends with the test process."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=_end_with_test)


def spawn_code(code: str, *args) -> subprocess.Popen:
    """``python -c code args...`` from the repository root, stdin and stdout piped (text)."""
    from .child import ROOT
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def end_code(proc: subprocess.Popen) -> int:
    """Close the child's stdin (its signal to stop), wait for it, close its stdout."""
    try:
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        return proc.wait(20)
    finally:
        proc.stdout.close()


def replicas_agree(url: str, timeout: float = 60.0) -> int:
    """Wait for full replication, then check every partition's replicas have one (seq,
    digest); returns the number of partitions."""
    from gradbus import admin
    wait_for(lambda: admin.status(url)["under_replicated"] == 0, timeout, "full replication")
    by_p: dict[int, set] = {}
    for parts in admin.digest(url).values():
        for p, seq_digest in parts.items():
            by_p.setdefault(p, set()).add(tuple(seq_digest))
    assert by_p and all(len(v) == 1 for v in by_p.values()), by_p
    return len(by_p)


# ---- the device paths (CuPy backend, device codec), on a GPU or the CUDA stand-in -------------
#: chains whose device encoding gives the host codec's bytes exactly
DETERMINISTIC = ["raw", "fp16", "bf16", "topk:0.01", "topk:0.05|bf16", "topk:0.1|fp16|zstd",
                 "bf16|shuffle|zstd", "fp16|zstd", "topk:1|raw"]


def device_gradient(n=5000, dtype=np.float32, seed=0):
    """A gradient for the device codec's tests: values over many magnitudes, NaN, +-inf and
    -0.0 among them."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(dtype)
    x[[3, 70]] = np.nan
    x[5], x[6], x[9] = np.inf, -np.inf, -0.0
    return x


def coded(chain, dtype, n, seed=3):
    """A frame's staged arrays for ``chain`` (NaN and inf included) and the host's decode."""
    from gradbus.codecs import tensor as tcodec
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 3, n)).astype(dtype)
    x[[5, n // 2]] = [np.nan, np.inf]
    applied, buf = tcodec.encode(x, chain)
    idx, arrays, coder, dt, k, _ = tcodec.decode_staged(buf, applied, np.dtype(dtype).name,
                                                        x.shape, 1 << 30)
    return arrays, coder, dt, k, tcodec.decode(buf, applied, np.dtype(dtype).name, x.shape,
                                                1 << 30)


def shard_after_coded_batch(be, n: int, opt: dict) -> np.ndarray:
    """A ShardCore on backend ``be`` fed one batch of raw, int8, sign, bf16 and sparse int8
    pushes (one staleness-scaled, one NaN and refused) of a zero-initialised block of ``n``
    float32 with optimizer ``opt``: its values after, on the host."""
    from gradbus.codecs import wire
    from gradbus.codecs.partition import TensorLayout
    from gradbus.shards.core import ShardCore
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
    grads[5][3] = np.nan
    chains = ["raw", "int8", "sign", "bf16", "topk:0.01|int8", "int8"]
    encs = [wire.encode_tensor("w/0", g, c, rng=np.random.default_rng(i))   # the same codes
            for i, (g, c) in enumerate(zip(grads, chains))]                    # each call
    entries = [{"op": "push", "i": i} for i in range(6)]
    entries[1]["w"] = 0.5
    layout = TensorLayout("w", "float32", (n,), n)
    sc = ShardCore("s", backend=be)
    sc.handle([wire.pack(wire.BATCH, [], parts=[{"p": 0, "seq": 1, "epoch": 1, "e": [
        {"op": "init", "key": "w/0", "layout": layout.to_wire(), "rule": {"name": "zeros"},
         "opt": opt}]}])])
    out = sc.handle([wire.pack(wire.BATCH, [e[0] for e in encs],
                               parts=[{"p": 0, "seq": 2, "epoch": 1, "e": entries}]),
                     *[bytes(e[1]) for e in encs]])
    res = wire.unpack_header(out[0][0], frozenset({wire.APPLIED}))["parts"][0]
    assert [e[:2] for e in res["errors"]] == [[5, "NOT_FINITE"]]
    blk = sc.store.blocks["w/0"]
    assert all(type(a) is type(blk.value) for a in blk.state.values() if hasattr(a, "dtype"))
    return be.to_host(blk.value)


def stop_and_check(c) -> list[str]:
    """Stop a cluster a test started; what is wrong with it: replicas that differ, a core's
    state, shared memory left. Every child must be reaped."""
    problems = []
    pids = c.pids()
    if c.broker_proc is not None and c.broker_proc.poll() is None:
        problems += replica_mismatches(c)
    cores = cluster_cores(c)
    url = c.url
    c.stop()
    problems += state_problems(cores)
    for one in net.broker_urls(url) if url else ():
        # shared memory: nothing of the cluster is left once it stopped
        left = shm.segments(shm.cluster_tag("%s:%d" % net.split_url(one)))
        problems += [f"shared-memory segments left: {left}"] if left else []
    for pid in pids:  # every child is reaped: no orphans
        assert not os.path.exists(f"/proc/{pid}") or zombie_or_gone(pid)
    return problems
