"""The leak check's descriptor rule (tests/leaks.py), both ways: what the CUDA runtime keeps open
is not a leak; a socket, pipe or shared-memory segment the code opened is, beside it too."""
from __future__ import annotations

import os
import socket

from . import leaks

# what an H100 host's CUDA context added to a test process (issue 46's teardown failure)
CUDA_OPENED = {7: "/dev/nvidiactl", 8: "/dev/nvidia0", 9: "/dev/nvidia-uvm",
               10: "/dev/nvidia-caps/nvidia-cap2", 11: "anon_inode:[eventfd]",
               12: "pipe:[88231]", 13: "pipe:[88231]", 14: "/dev/nvidia-uvm-tools"}
BEFORE = {0: "/dev/null", 1: "pipe:[100]", 2: "pipe:[101]", 3: "/tmp/pytest.log"}


def test_the_cuda_runtimes_descriptors_are_not_a_leak():
    now = {**BEFORE, **CUDA_OPENED}
    runtime = leaks.cuda_runtime_fds(BEFORE, now)
    assert runtime == {(11, "anon_inode:[eventfd]"), (12, "pipe:[88231]"), (13, "pipe:[88231]")}
    assert leaks.fd_leaks(BEFORE, now, runtime) == []
    # a device node opened later (torch opening another cap) is the runtime's too
    assert leaks.fd_leaks(BEFORE, {**now, 20: "/dev/nvidia-caps/nvidia-cap1"}, runtime) == []


def test_an_eventfd_or_pipe_not_seen_at_cuda_start_is_a_leak():
    now = {**BEFORE, **CUDA_OPENED}
    runtime = leaks.cuda_runtime_fds(BEFORE, now)
    later = {**now, 15: "pipe:[90000]", 16: "anon_inode:[eventfd]", 17: "socket:[4242]",
             18: "/dev/shm/gradbus-1-ring-0", 13: "pipe:[91111]"}   # 13 closed, reused
    assert leaks.fd_leaks(BEFORE, later, runtime) == [
        "fd 13 -> pipe:[91111]", "fd 15 -> pipe:[90000]", "fd 16 -> anon_inode:[eventfd]",
        "fd 17 -> socket:[4242]", "fd 18 -> /dev/shm/gradbus-1-ring-0"]
    # without a CUDA context in the process, its eventfd and pipes are leaks like any other
    assert leaks.fd_leaks(BEFORE, now) == ["fd 11 -> anon_inode:[eventfd]",
                                           "fd 12 -> pipe:[88231]", "fd 13 -> pipe:[88231]"]


def test_real_descriptors_opened_by_code_are_caught(tmp_path):
    """A socket, a pipe and a file in a shared-memory directory, really opened here, are
    leaks while open (whatever CUDA set was found) and not once closed."""
    before = leaks.fds()
    sock = socket.socket()
    r, w = os.pipe()
    seg = os.open(tmp_path / "gradbus-test-seg", os.O_CREAT | os.O_RDWR)
    try:
        found = leaks.fd_leaks(before, leaks.fds(), leaks.cuda_fds())
        assert {int(f.split()[1]) for f in found} == {sock.fileno(), r, w, seg}
        assert any("socket:[" in f for f in found) and any("pipe:[" in f for f in found)
        assert any(f.endswith("gradbus-test-seg") for f in found)
    finally:
        sock.close()
        for fd in (r, w, seg):
            os.close(fd)
    assert leaks.fd_leaks(before, leaks.fds(), leaks.cuda_fds()) == []
