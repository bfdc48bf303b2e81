"""Server processes keep freed memory (gradbus/memory.py): checked by counting page faults."""
import ctypes
import subprocess
import sys
import textwrap

import pytest

from gradbus import memory


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


needs_glibc = pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")

# Allocate and free 16 MiB in 1 MiB arrays, 20 times; print the page faults per MiB after a
# warm-up. With glibc's defaults the freed top of the heap goes back to the kernel each time.
CYCLE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    if sys.argv[1] == "keep":
        from gradbus import memory
        assert memory.keep_freed_memory()
    def cycle():
        arrs = [np.ones(1 << 18, np.float32) for _ in range(16)]
        del arrs
    for _ in range(3):
        cycle()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        cycle()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (20 * 16))
""")


def _faults_per_mib(mode: str, env=None) -> float:
    out = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip())


@needs_glibc
def test_freed_memory_is_reused_without_page_faults():
    default = _faults_per_mib("default")
    kept = _faults_per_mib("keep")
    assert default > 100, f"glibc returned nothing to the kernel ({default} faults/MiB)"
    assert kept < 5, f"{kept} page faults per MiB with freed memory kept"


def test_operator_tuning_wins():
    env = {"MALLOC_TRIM_THRESHOLD_": "131072"}
    assert memory.keep_freed_memory(environ=env) is False
    assert memory.keep_freed_memory(environ={"MALLOC_MMAP_THRESHOLD_": "65536"}) is False


def test_not_linux(monkeypatch):
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert memory.keep_freed_memory(environ={}) is False
