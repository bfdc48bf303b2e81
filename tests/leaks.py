"""The leak check's rule for file descriptors, as pure functions of ``{fd: target}`` snapshots
(``os.readlink`` of ``/proc/self/fd/N``), and the one place that makes a CUDA context on purpose
so that what the CUDA runtime opens for the life of the process is known by its targets.

A descriptor open at the end of a test module that was not open (to the same target) at its
start is a leak, except the CUDA runtime's: every ``/dev/nvidia*`` (the device nodes, ``-uvm``,
``-caps/...``), always; and the eventfd and pipes that appeared while this process first made
a CUDA context (:func:`cuda_runtime_fds`), those descriptors only, by number and target. A pipe,
socket or shared-memory segment the code under test opens is still a leak, on a GPU host too.
"""
from __future__ import annotations

import os
import sys

CUDA_DEVICE_PREFIX = "/dev/nvidia"
EVENTFD = "anon_inode:[eventfd]"
PIPE_PREFIX = "pipe:"


def fd_leaks(before: dict[int, str], now: dict[int, str],
             cuda_runtime: frozenset = frozenset()) -> list[str]:
    """``"fd N -> target"`` for each descriptor of ``now`` not in ``before`` (or pointing
    elsewhere), but for the CUDA runtime's: ``/dev/nvidia*`` and the ``(fd, target)`` pairs
    of ``cuda_runtime``."""
    return [f"fd {fd} -> {target}" for fd, target in sorted(now.items())
            if before.get(fd) != target and not target.startswith(CUDA_DEVICE_PREFIX)
            and (fd, target) not in cuda_runtime]


def cuda_runtime_fds(before: dict[int, str], after: dict[int, str]) -> frozenset:
    """The ``(fd, target)`` pairs of the eventfd and pipes that appeared between ``before``
    and ``after``, snapshots taken just around the first CUDA context of the process."""
    return frozenset((fd, t) for fd, t in after.items()
                     if before.get(fd) != t and (t == EVENTFD or t.startswith(PIPE_PREFIX)))


def fds() -> dict[int, str]:
    """This process's descriptors and their targets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:      # the listing's own descriptor, closed already
            pass
    return out


_cuda: dict = {}


def cuda_fds() -> frozenset:
    """What :func:`prime_cuda` found the runtime opened (empty before it ran)."""
    return _cuda.get("fds", frozenset())


def prime_cuda() -> frozenset:
    """Make this process's CUDA context now (once; through CuPy and, where it is imported,
    torch), between two snapshots: returns what the runtime opened (:func:`cuda_runtime_fds`),
    empty where there is no CUDA device, or neither CuPy nor torch sees one (the test stand-in
    is no CUDA). Where there is none it only tries once: the answer is kept."""
    if "fds" in _cuda:
        return _cuda["fds"]
    before = fds()
    made = False
    try:
        import cupy
        if not getattr(cupy, "STATE", None) and cupy.cuda.runtime.getDeviceCount() > 0:
            cupy.empty(1)                    # the context, on the current device
            made = True
    except Exception:                        # no cupy, no driver, no device: no context
        pass
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            torch.empty(1, device="cuda")
            made = True
    except Exception:
        pass
    _cuda["fds"] = cuda_runtime_fds(before, fds()) if made else frozenset()
    return _cuda["fds"]
