"""Fixtures: real clusters on ephemeral 127.0.0.1 ports, with deadlines and leak checks."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import traceback
import weakref

import numpy as np
import pytest
import zmq

from gradbus.cluster import LocalCluster, end_processes
from gradbus.codecs import security
from gradbus.shards import checkpoint

from . import leaks, rigs
from .rigs import (
    gradbus_segments,
    stop_and_check,
    wait_for,
)

try:   # CI runs the property tests on fixed examples (reproducible); locally they stay random
    from hypothesis import settings as _hyp_settings
    _hyp_settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:
    pass


def _gradbus_threads():
    return {t for t in threading.enumerate() if t.name.startswith("gradbus-")}


def _thread_stacks(threads) -> str:
    frames = sys._current_frames()
    out = []
    for t in sorted(threads, key=lambda t: t.name):
        stack = frames.get(t.ident)
        out.append(f"--- {t.name} ---\n" + ("".join(traceback.format_stack(stack)) if stack
                                            else "(no frame)\n"))
    return "".join(out)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = _gradbus_threads()
    yield
    try:
        wait_for(lambda: not (_gradbus_threads() - before), 5.0, "gradbus threads to end")
    except TimeoutError:
        leaked = _gradbus_threads() - before
        pytest.fail(f"leaked threads: {sorted(t.name for t in leaked)}\n"
                    f"{_thread_stacks(leaked)}")


# ---- ZeroMQ sockets and contexts, and file descriptors --------------------------------------
# Every context and socket made in the test process is recorded with where it was made; one
# still open when its test module ends (after a grace period for threads winding down) fails
# the module's last test and names it, and so does a file descriptor opened and not closed.
# Checked per module, not per test: a module-scoped cluster or client lives across its tests.
# Context.instance() is shared by design: it is made (with its I/O threads' descriptors) before
# the first snapshot and never counted.

_made: dict = {"contexts": weakref.WeakKeyDictionary(), "sockets": weakref.WeakKeyDictionary()}
_orig_ctx_init = zmq.Context.__init__
_orig_ctx_socket = zmq.Context.socket


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2]
              if "site-packages" not in f.filename and "conftest" not in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(frames[-4:]))


def _tracked_init(self, *a, **kw):
    _orig_ctx_init(self, *a, **kw)
    _made["contexts"][self] = _where()


def _tracked_socket(self, *a, **kw):
    sock = _orig_ctx_socket(self, *a, **kw)
    _made["sockets"][sock] = _where()
    return sock


zmq.Context.__init__ = _tracked_init
zmq.Context.socket = _tracked_socket


def _open_zmq(before_ctx, before_sock) -> list[str]:
    shared = zmq.Context._instance
    out = [f"socket {s.type} made at {w}" for s, w in list(_made["sockets"].items())
           if s not in before_sock and not s.closed]
    out += [f"context made at {w}" for c, w in list(_made["contexts"].items())
            if c not in before_ctx and not c.closed and c is not shared]
    return out


def _prime_shared_zmq_state() -> None:
    """Make pyzmq's process-wide state now: Context.instance() with its I/O threads, and the
    garbage-collector thread (its own context, PUSH and PULL) that a zero-copy send starts."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://gradbus-conftest-prime")
        b.connect("inproc://gradbus-conftest-prime")
        a.send(bytes(1 << 17), copy=False)
        b.recv()
    finally:
        a.close(linger=0)
        b.close(linger=0)


_prime_shared_zmq_state()


@pytest.fixture(autouse=True, scope="module")
def no_leaked_sockets_or_fds():
    """What a CUDA context keeps open for the life of the process is told apart by its
    targets (tests/leaks.py): where there is a CUDA device, the first module makes the
    context, here, between two snapshots of the descriptors (any in-process shard of
    ``GRADBUS_BACKEND=auto`` would make it later, in the middle of a module)."""
    before_ctx = set(_made["contexts"].keys())
    before_sock = set(_made["sockets"].keys())
    leaks.prime_cuda()
    fds = leaks.fds()
    yield

    def leaked():
        fd = leaks.fd_leaks(fds, leaks.fds(), leaks.cuda_fds())
        return _open_zmq(before_ctx, before_sock) + fd

    try:
        wait_for(lambda: not leaked(), 5.0, "sockets, contexts and descriptors to close")
    except TimeoutError:
        found = leaked()
        if found:
            pytest.fail("leaked: " + "; ".join(found))


@pytest.fixture(autouse=True)
def data_path(request, monkeypatch):
    """Where tensor bytes travel between processes of a host: ``"shm"`` (the default) or
    ``"frames"`` (``GRADBUS_SHM=0`` for every process the test starts). A module that sets
    ``BOTH_DATA_PATHS = True`` runs each of its tests both ways; the frames twin of a test
    named in its ``FRAMES_SLOW`` runs with the slow tests (long tests whose frames path other
    tests of the default run cover)."""
    mode = getattr(request, "param", None)
    if mode is not None:
        monkeypatch.setenv("GRADBUS_SHM", "1" if mode == "shm" else "0")
    return mode


def pytest_generate_tests(metafunc):
    if getattr(metafunc.module, "BOTH_DATA_PATHS", False) and "data_path" in metafunc.fixturenames:
        slow = metafunc.function.__name__ in getattr(metafunc.module, "FRAMES_SLOW", ())
        metafunc.parametrize("data_path", ["shm", pytest.param(
            "frames", marks=[pytest.mark.slow] if slow else [])], indirect=True)


@pytest.fixture
def make_cluster():
    """Factory: ``make_cluster(shards=2, processes=True)`` -> a started LocalCluster.

    At teardown an in-process cluster's cores (broker and shards, reached through the cluster's
    servers) are checked with ``validate_state()`` once they stopped; a replicated cluster of
    processes has its replicas' digests compared. A problem found fails the test, named."""
    started = []

    def factory(shards: int = 2, **kw) -> LocalCluster:
        c = LocalCluster(shards, port=0, **kw)
        started.append(c)
        return c.start()

    yield factory
    problems = [p for c in started for p in stop_and_check(c)]
    if problems:
        pytest.fail("cluster state at teardown: " + "; ".join(problems))


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints at t=1 and t=2 of one shard, with pushes between them (so every partition
    is at another seq in the second)."""
    rig = rigs.RepRig(("s0",))
    frames, layout = rigs.init_msg(1, "w", np.arange(40, dtype=np.float32), opt=rigs.ADAM)
    rig.client(b"c", frames)
    rng = np.random.default_rng(0)
    root = str(tmp_path / "data")
    cks = []
    for t in (1.0, 2.0):
        for m in range(int(t) * 10, int(t) * 10 + 5):
            rig.client(b"c", rigs.push_msg(m, layout, rng.standard_normal(40).astype(np.float32)))
        cks.append(checkpoint.write(root, "s0", rig.shards["s0"].states(), keep=3, now=t))
    assert cks[0].partitions != cks[1].partitions
    return root, cks[0], cks[1]


@pytest.fixture
def refusing_broker(tmp_path):
    """A CURVE broker process whose allow directory is empty, and an outsider's key pair."""
    keys = tmp_path / "keys"
    security.generate(keys, "broker")
    _, outsider = security.generate(keys, "outsider")
    allow = tmp_path / "allow"
    allow.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "gradbus", "broker", "--port", "0",
                             "--curve-secret", str(keys / "broker.key_secret"),
                             "--curve-allow", str(allow)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening: "), line
        yield line.split(" ", 1)[1], outsider, str(keys / "broker.key")
    finally:
        end_processes([proc], 10)


# ---- shared memory ------------------------------------------------------------------------

@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A shared-memory directory of this test's own; nothing may be left in it."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("GRADBUS_SHM_DIR", str(d))
    monkeypatch.delenv("GRADBUS_SHM", raising=False)
    yield str(d)
    assert gradbus_segments(str(d)) == []


@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch, request):
    """``mount(size)``: a tmpfs of ``size`` as this test's shared-memory directory (skipped
    where mounting is not permitted), unmounted at teardown."""
    def mount(size: str) -> str:
        d = tmp_path / f"tmpfs-{size}"
        d.mkdir()
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                                str(d)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount a tmpfs: {e}")
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")

        def unmount():
            if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(d)], capture_output=True)
        request.addfinalizer(unmount)
        monkeypatch.setenv("GRADBUS_SHM_DIR", str(d))
        return str(d)
    return mount
