"""The shard backend's numba loops are compiled once, even when several threads (the shards of
an in-process cluster) ask for them first together.

The workload runs in a child interpreter, where nothing has asked for the loops yet. A stand-in
compile holds the first caller until every other thread has either entered the compile too (a
cache that does not serialise first calls) or is waiting for the first one to finish; then the
compiles are counted.
"""
from __future__ import annotations

import sys
import threading
import time

from .child import in_child

THREADS = 4
HANG = 120


def racing_first_calls_workload() -> None:
    from gradbus.codecs import jit
    from gradbus.shards import backend
    calls: list = []
    release = threading.Event()
    workers: list[threading.Thread] = []

    def where(t: threading.Thread) -> set[str]:
        """The names of the functions on ``t``'s stack."""
        frame, names = sys._current_frames().get(t.ident), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        return names

    def compile_(_compile_loops):    # "get": jit.once's wrapper, where the others queue
        calls.append(threading.current_thread().name)
        if len(calls) == 1:    # the first: wait until the others are in a compile or queued
            others = [t for t in workers if t is not threading.current_thread()]
            deadline = time.monotonic() + 60
            while not all({"compile_", "get"} & where(t) for t in others):
                assert time.monotonic() < deadline, "the other threads never asked"
                time.sleep(0.005)
            release.set()
        assert release.wait(60)
        return {"stand-in": True}

    jit.build = compile_
    got: list = []
    start = threading.Barrier(THREADS)

    def ask():
        start.wait(60)
        got.append(backend._numba_loops())

    workers.extend(threading.Thread(target=ask, name=f"test-ask-{i}") for i in range(THREADS))
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert not any(t.is_alive() for t in workers), "a thread is still waiting"
    assert got == [{"stand-in": True}] * THREADS, got
    assert len(calls) == 1, f"compiled {len(calls)} times: {calls}"
    assert backend._numba_loops() == {"stand-in": True} and len(calls) == 1
    print("OK")


def test_racing_first_calls_compile_the_loops_once():
    assert "OK" in in_child("tests.test_backend_jit_once", "racing_first_calls_workload",
                            timeout=HANG)
