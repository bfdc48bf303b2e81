"""What a quiet child process last wrote to its stderr, kept to say why it failed.

A quiet :class:`~gradbus.cluster.LocalCluster` shows nothing of its brokers' and shards'
output; without this, one that fails to start is reported by its exit status alone (click's
"No such option", a traceback on import, "Address already in use" all read "exit 1"). The
child's stderr is a pipe that a daemon thread drains for the child's life, keeping only the
last :data:`KEEP` bytes: memory stays bounded whatever the child writes, and the child never
blocks on a full pipe.
"""
from __future__ import annotations

import os
import threading

KEEP = 4096         # bytes of the child's stderr kept (its end: the error comes last)
LINES = 8           # lines of them quoted in an error
READ = 65536


class StderrTail:
    """A pipe for a child's stderr and the thread that keeps its last bytes.

    Hand :attr:`fd` to the child (``Popen(stderr=tail.fd)``), then call :meth:`started`
    (or :meth:`abandon`, when the child did not start): the parent's write end is closed
    there, so the pipe ends when the child (and whatever inherited its stderr) exits."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._r, self.fd = os.pipe()
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def started(self, name: str) -> "StderrTail":
        """The child holds its copy of the write end: close ours and start draining."""
        os.close(self.fd)
        self._thread = threading.Thread(target=self._drain, name=f"gradbus-stderr-{name}",
                                        daemon=True)
        self._thread.start()
        return self

    def abandon(self) -> None:
        """No child took the pipe (its start failed): close both ends."""
        os.close(self.fd)
        os.close(self._r)

    def _drain(self) -> None:
        try:
            while chunk := os.read(self._r, READ):
                with self._lock:
                    self._buf += chunk
                    if len(self._buf) > 2 * self.keep:    # trimmed now and then, not per read
                        del self._buf[:-self.keep]
        except OSError:
            pass
        finally:
            os.close(self._r)

    def text(self, wait: float = 2.0) -> str:
        """The last :data:`LINES` lines the child wrote (decoded leniently, stripped), waiting
        up to ``wait`` seconds for the pipe to end first (call it once the child exited)."""
        if self._thread is not None:
            self._thread.join(wait)
        with self._lock:
            data = bytes(self._buf[-self.keep:])
        lines = data.decode("utf-8", "replace").strip().splitlines()
        return "\n".join(lines[-LINES:])


def why(proc) -> str:
    """``":\n"`` and what a process started with a tail (``proc.stderr_tail``) last wrote,
    to end an error message with; "" where it wrote nothing or has no tail."""
    tail = getattr(proc, "stderr_tail", None)
    said = tail.text() if tail is not None else ""
    return f":\n{said}" if said else ""
