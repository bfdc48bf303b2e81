"""Running a test's workload in a child interpreter, for failures that would take the test run
down with them: a crash in native code, or a call that blocks for ever."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_child(module: str, workload: str, *args, timeout: float) -> str:
    """Run ``workload(*args)`` of ``module`` (e.g. ``"tests.test_threads"``) in a fresh
    interpreter and return its stdout; a non-zero exit, a crash or a run past ``timeout``
    seconds (the hang detector) fails the calling test with the child's output."""
    code = f"from {module} import {workload}; {workload}(*{args!r})"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{workload} hung past {timeout}s:\n{e.stdout or ''}\n"
                             f"{e.stderr or ''}") from None
    assert proc.returncode == 0, (f"{workload} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout
