"""Clients follow a restarted broker at once, on a loaded machine: what was in flight when the
broker died is sent again when the client hears the new broker (its run id), not when a resend
timer or a back-off runs out. Real broker and shard processes, two busy-loop processes of the
test's own beside them; the assertions are on order and counts, never on wall time."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import zmq

import gradbus
from gradbus import admin
from gradbus.broker.server import BrokerServer
from gradbus.cluster import end_processes, free_ports
from gradbus.codecs import wire

from .rigs import cpu_hog, spawn_gradbus, unpack, wait_for

LR = 2.0 ** -6
WINDOW = 8


def _alive(url: str) -> int:
    try:
        return sum(1 for s in admin.status(url, timeout=1.0)["shards"] if s["alive"])
    except gradbus.GradbusError:
        return 0


class Pusher:
    """A client pushing ``acks="all"`` from its own thread without pause (its window of
    pushes in flight), until stopped."""

    def __init__(self, url: str, shm: bool):
        # a resend timer longer than the test: only the broker's return can bring back the
        # pushes that died with it
        self.c = gradbus.connect(url, window=WINDOW, resend_after=3600.0, timeout=120, shm=shm)
        self.futures: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-pusher", daemon=True)

    def _run(self):
        g = {"w": np.ones(1000, np.float32)}
        while not self.stop.is_set():
            self.futures.append(self.c.push(g, acks="all"))

    def waiting(self) -> int:
        """Pushes returned to the caller and not answered yet."""
        return sum(1 for f in list(self.futures) if not f.done())

    def acked(self) -> int:
        return sum(1 for f in self.futures if f.done() and f.exception() is None)


@pytest.mark.parametrize("linked", [False, True], ids=["tcp", "local-link"])
def test_pushes_lost_with_the_broker_go_again_when_it_returns_under_load(tmp_path, linked):
    """Both shards stopped, each client's window fills with pushes the broker holds; the broker
    is SIGKILLed (they die with it), the shards resume, the broker starts again with the same
    command line. Each client sends its window again when it hears the new broker, once (no
    resend round: the timer is longer than the test), every push is acknowledged, and the
    weights hold each push exactly once."""
    port, backend, events = free_ports(3)
    url = f"tcp://127.0.0.1:{port}"
    # the broker waits 10 s before it calls a stopped shard dead; the shards, 1 s for a broker
    broker_cmd = ["broker", "--port", str(port), "--backend-port", str(backend),
                  "--events-port", str(events), "--replicas", "2",
                  "--heartbeat-interval", "0.25", "--liveness", "40"]
    hogs = [cpu_hog() for _ in range(2)]
    procs = [spawn_gradbus(*broker_cmd)]
    pushers: list[Pusher] = []
    try:
        assert procs[0].stdout.readline().startswith("listening")
        shards = [spawn_gradbus("shard", "--broker", url, "--id", f"s{i}", "--data-dir",
                                tmp_path / f"s{i}") for i in range(2)]
        procs += shards
        wait_for(lambda: _alive(url) == 2, 60, "2 shards")
        w0 = np.zeros(1000, np.float32)
        pushers = [Pusher(url, shm=linked) for _ in range(2)]
        pushers[0].c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        wait_for(lambda: admin.status(url)["under_replicated"] == 0, 60, "both replicas")
        pushers[1].c.pull(["w"], timeout=60)
        for p in pushers:
            p.thread.start()
        wait_for(lambda: all(p.acked() >= 10 for p in pushers), 60, "pushes acknowledged")
        for s in shards:
            os.kill(s.pid, signal.SIGSTOP)
        try:
            # every client's window in flight, held by the broker (queued or sent to a
            # stopped shard), none answered
            # (each of those pushes returned to its caller: written, not only counted)
            wait_for(lambda: all(len(p.c.credit) == WINDOW and p.waiting() == WINDOW
                                 for p in pushers), 60, "full windows")
            before = [p.acked() for p in pushers]
            procs[0].kill()
            procs[0].wait(30)
            procs[0].stdout.close()
        finally:
            for s in shards:
                os.kill(s.pid, signal.SIGCONT)
        assert [len(p.c.credit) for p in pushers] == [WINDOW, WINDOW]
        procs[0] = spawn_gradbus(*broker_cmd)
        assert procs[0].stdout.readline().startswith("listening")
        wait_for(lambda: _alive(url) == 2, 60, "the shards to register again")
        # served again: more than the lost window acknowledged since, by every client
        wait_for(lambda: all(p.acked() >= b + 2 * WINDOW for p, b in zip(pushers, before)),
                 60, "pushes acknowledged after the restart")
        for p in pushers:
            p.stop.set()
            p.thread.join(60)
            p.c.flush(60)
        for p in pushers:
            st = p.c.stats
            if linked:
                # its link closed with the broker: the window went again at once on the
                # DEALER, to the new broker once it was up; what the new run id then found
                # unanswered went again too (or nothing, when it was answered first)
                assert st["link_resends"] == WINDOW, dict(st)
                assert st["broker_restarts"] <= 1, dict(st)
                assert st["restart_resends"] <= WINDOW * st["broker_restarts"], dict(st)
            else:
                assert st["broker_restarts"] == 1, dict(st)
                assert st["restart_resends"] == WINDOW, dict(st)   # its window, once, at once
            assert st["resends"] == 0, dict(st)                  # no timer round
            assert all(f.exception() is None for f in p.futures)
        total = sum(len(p.futures) for p in pushers)
        w = pushers[0].c.pull(["w"], min_version=total, timeout=60)["w"]
        assert np.array_equal(w, w0 - total * LR)                # each push applied once
        assert [t["version"] for t in admin.status(url)["tensors"]] == [total]
    finally:
        for p in pushers:
            p.stop.set()
            if p.thread.is_alive():
                p.thread.join(30)
            p.c.close()
        end_processes([*procs, *hogs], 10)


def test_each_new_heartbeat_subscriber_hears_the_run_id_at_once():
    """The broker's clock stands still, so no periodic heartbeat ever comes due: what each
    subscriber gets is the heartbeat its subscription brought, with the broker's run id."""
    srv = BrokerServer(port=0, clock=lambda: 100.0)
    thread = srv.start_thread()
    subs = []
    try:
        for _ in range(2):
            sub = srv.ctx.socket(zmq.SUB)
            sub.linger = 0
            subs.append(sub)
            sub.connect(f"tcp://127.0.0.1:{srv.events_port}")
            sub.subscribe(wire.TOPIC_HEARTBEAT)
            assert sub.poll(20_000), "no heartbeat"
            topic, header = sub.recv_multipart()
            assert topic == wire.TOPIC_HEARTBEAT and unpack(header)["run"] == srv.core.run
    finally:
        for sub in subs:
            sub.close()
        srv.stop()
        thread.join(20)


def test_a_client_new_to_a_restarted_broker_waits_for_its_shards_to_name_a_tensor(tmp_path):
    """The broker restarts while its shard is stopped, so it has not relearned the tensor; a
    client that starts now and pulls it is told RECOVERING and asks again (not UNKNOWN_KEY),
    and gets the weights once the shard is back and registered."""
    port, backend, events = free_ports(3)
    url = f"tcp://127.0.0.1:{port}"
    broker_cmd = ["broker", "--port", str(port), "--backend-port", str(backend),
                  "--events-port", str(events), "--heartbeat-interval", "0.25",
                  "--liveness", "40"]     # a recovery grace of 20 s and more
    procs = [spawn_gradbus(*broker_cmd)]
    try:
        assert procs[0].stdout.readline().startswith("listening")
        shard = spawn_gradbus("shard", "--broker", url, "--id", "s0", "--data-dir",
                              tmp_path / "s0")
        procs.append(shard)
        wait_for(lambda: _alive(url) == 1, 60, "the shard")
        with gradbus.connect(url) as c:
            c.init({"w": np.zeros(100, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            c.push({"w": np.ones(100, np.float32)}).result(30)
        os.kill(shard.pid, signal.SIGSTOP)
        try:
            procs[0].kill()
            procs[0].wait(30)
            procs[0].stdout.close()
            procs[0] = spawn_gradbus(*broker_cmd)
            assert procs[0].stdout.readline().startswith("listening")
            got: dict = {}
            with gradbus.connect(url, timeout=60) as c:
                t = threading.Thread(target=lambda: got.update(
                    w=c.pull(["w"], min_version=1, timeout=60)["w"]))
                t.start()
                wait_for(lambda: c.stats["recovering_retries"] >= 1, 30,
                         "the lookup refused RECOVERING")
                os.kill(shard.pid, signal.SIGCONT)
                t.join(90)
                assert not t.is_alive()
        finally:
            os.kill(shard.pid, signal.SIGCONT)
        assert np.array_equal(got["w"], np.full(100, -1.0, np.float32))
    finally:
        end_processes(procs, 10)
