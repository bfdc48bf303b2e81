"""Fixtures: real clusters on ephemeral 127.0.0.1 ports, with deadlines and leak checks."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
from unittest import mock

import pytest

from gradbus.cluster import LocalCluster
from gradbus.codecs import jit

try:   # CI runs the property tests on fixed examples (reproducible); locally they stay random
    from hypothesis import settings as _hyp_settings
    _hyp_settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:
    pass


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


def _gradbus_threads():
    return {t for t in threading.enumerate() if t.name.startswith("gradbus-")}


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = _gradbus_threads()
    yield
    try:
        wait_for(lambda: not (_gradbus_threads() - before), 5.0, "gradbus threads to end")
    except TimeoutError:
        pytest.fail(f"leaked threads: {sorted(t.name for t in _gradbus_threads() - before)}")


@pytest.fixture
def make_cluster():
    """Factory: ``make_cluster(shards=2, processes=True)`` -> a started LocalCluster."""
    started = []

    def factory(shards: int = 2, **kw) -> LocalCluster:
        c = LocalCluster(shards, port=0, **kw)
        started.append(c)
        return c.start()

    yield factory
    for c in started:
        pids = c.pids()
        c.stop()
        for pid in pids:  # every child is reaped: no orphans
            assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] in ("Z", "X")
    except FileNotFoundError:
        return True
