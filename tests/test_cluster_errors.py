"""A quiet local cluster whose broker or shard fails says what the process last wrote,
not only its exit status; what it keeps of a process's stderr stays bounded."""
import os
import subprocess
import sys

import pytest

from gradbus import stderr_tail
from gradbus.cluster import LocalCluster
from gradbus.codecs.errors import GradbusError


@pytest.mark.parametrize("which, said", [
    ("broker_args", "broker failed to start (exit 2, said '')"),
    ("shard_args", "shard-0 exited with 2"),
])
def test_a_process_that_fails_to_start_says_why(which, said):
    c = LocalCluster(1, quiet=True, ready_timeout=30, **{which: ["--no-such-option"]})
    with pytest.raises(GradbusError) as e:
        c.start()
    msg = e.value.args[0]
    assert msg.startswith(said + ":\n"), msg
    assert msg.endswith("Error: No such option '--no-such-option'."), msg
    assert all(p.poll() is not None for p in [*c.broker_procs.values(),
                                              *c.shard_procs.values()])


def _child(code: str, tail: stderr_tail.StderrTail) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=tail.fd)
    proc.stderr_tail = tail.started("test")
    return proc


def test_a_tail_keeps_the_end_of_a_long_stderr_and_no_more():
    tail = stderr_tail.StderrTail(keep=1024)
    proc = _child("import sys\nfor i in range(20000): sys.stderr.write(f'line {i}\\n')\n"
                  "sys.stderr.write('the end\\n')", tail)
    assert proc.wait(60) == 0
    text = tail.text(wait=30)
    assert not tail._thread.is_alive()
    lines = text.splitlines()
    assert lines[-1] == "the end" and lines[-2] == "line 19999", lines
    assert len(lines) == stderr_tail.LINES
    assert len(tail._buf) <= 2 * 1024 + stderr_tail.READ


def test_a_quiet_process_says_nothing_and_bytes_that_are_not_text_are_kept_readable():
    quiet = stderr_tail.StderrTail()
    proc = _child("pass", quiet)
    assert proc.wait(60) == 0
    assert quiet.text(wait=30) == ""
    assert stderr_tail.why(proc) == ""

    raw = stderr_tail.StderrTail()
    proc = _child("import os; os.write(2, b'bad \\xff byte\\n')", raw)
    assert proc.wait(60) == 0
    assert stderr_tail.why(proc) == ":\nbad \ufffd byte"


def test_a_child_that_never_started_leaves_no_descriptor_open():
    tail = stderr_tail.StderrTail()
    fds = tail.fd, tail._r
    with pytest.raises(FileNotFoundError):
        subprocess.Popen(["/nonexistent/gradbus-no-such-program"], stderr=tail.fd)
    tail.abandon()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
