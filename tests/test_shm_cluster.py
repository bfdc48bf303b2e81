"""The shared-memory data path through real broker and shard processes: known answers with
pushes in clients' rings and weights in shards' boards, mixed with peers that use frames (a
client, a shard), replicas, the update log, processes SIGKILLed mid-run (no segment left
behind by any role), and a shared-memory directory that runs out of room.

Every test has a shared-memory directory of its own (``$GRADBUS_SHM_DIR``, inherited by the
processes it starts) and leaves it without a gradbus segment."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

import gradbus
from gradbus import admin, metrics
from gradbus.broker import log as ulog
from gradbus.cluster import LocalCluster, free_ports
from gradbus.codecs import shm
from gradbus.codecs.partition import partition_of

from .child import ROOT
from .rigs import end_code, gradbus_segments, replicas_agree, spawn_code, wait_for

pytestmark = pytest.mark.usefixtures("shm_dir")

LR = 0.25      # powers of two: every intermediate result is exact
G = 0.5
FAST_HB = ["--heartbeat-interval", "0.25", "--liveness", "8"]


def _w0(n: int, dtype="float32") -> np.ndarray:
    return (np.arange(n) % 97).astype(dtype)


def _counters(url: str) -> dict:
    return admin.status(url)["counters"]


def _roles(cluster_tag: str) -> dict[str, set[int]]:
    """Role -> owner pids of the cluster's segments now."""
    out: dict[str, set[int]] = {}
    for name in shm.segments(cluster_tag):
        _, role, pid, _ = shm.owned(name)
        out.setdefault(role, set()).add(pid)
    return out


def _push_n(client, grads: dict, n: int, acks=1) -> None:
    futs = [client.push(grads, acks=acks) for _ in range(n)]
    for f in futs:
        assert f.result(30)["kind"] == "ack"


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return metrics.parse(r.read().decode())


def _freed(url: str, n: int) -> None:
    """Wait until the broker freed the ring slots of exactly ``n`` pushes."""
    wait_for(lambda: _counters(url).get("shm_freed", 0) >= n, 20, f"{n} pushes freed")
    assert _counters(url)["shm_freed"] == n


# ----------------------------------------------------------------------------- known answers
def test_known_answer_through_rings_and_boards(make_cluster, shm_dir):
    cluster = make_cluster(2)
    w0 = {"a": _w0(50_000), "b": _w0(3000, "float64").reshape(60, 50)}
    grads = {k: np.full(v.shape, G, v.dtype) for k, v in w0.items()}
    n = 12
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        assert c.shm is not None
        tag = c.shm.cluster
        # the broker's probe, a board per shard (made once it heard REGISTERED), this ring
        shards = {p.pid for p in cluster.shard_procs.values()}
        wait_for(lambda: _roles(tag).get("s") == shards, 10, "a board per shard")
        roles = _roles(tag)
        assert roles["b"] == {cluster.broker_proc.pid} and roles["w"] == {os.getpid()}
        c.init(w0, optimizer=gradbus.SGD(lr=LR))
        c.pull()                               # follow both from here on
        _push_n(c, grads, n)
        w = c.pull(min_version=n, timeout=30)
        for k in w0:
            assert w[k].dtype == w0[k].dtype and np.array_equal(w[k], w0[k] - n * LR * G), k
        # every push's bytes were in the ring: each one freed once, nothing inlined
        _freed(cluster.url, n)
        wait_for(lambda: not c.shm.ring.held, 10, "the client to hear every FREE")
        assert c.stats["shm_freed"] == n and all(a.idle() for a in c.shm.ring.arenas)
        assert c.stats["free_messages"] == 0       # each push's slots freed in its ACK
        cnt = _counters(cluster.url)
        assert cnt["pushes_applied"] == n and cnt.get("shm_inlined", 0) == 0
        # it read the weights from the shards' boards, the newest each time, and needed no
        # update for that
        assert c.cache.stats["live_reads"] > 0 and c.stats["updates_received"] == 0
        assert all(part.live for part in c.cache.parts.values())
        assert any(shm.owned(s)[1] == "s" for s in c.shm.mapper.segs)
    assert "w" not in _roles(tag)          # a closed client's ring is gone at once
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_client_without_shm_and_one_with_both_follow_exact_weights(make_cluster, shm_dir):
    """The client without shared memory pushes frames and reads the p topics, whose updates
    the broker copies out of the boards; the other pushes through its ring and reads the
    boards themselves, with no update."""
    cluster = make_cluster(2)
    w0 = _w0(20_000)
    g_frames, g_ring = np.full(w0.shape, G, np.float32), np.full(w0.shape, 2 * G, np.float32)
    n = 10
    with gradbus.connect(cluster.url, block_bytes=4096, shm=False) as a, \
            gradbus.connect(cluster.url, block_bytes=4096) as b:
        assert a.shm is None and b.shm is not None
        a.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        b.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))      # exists: a no-op
        a.pull(["w"])
        b.pull(["w"])
        for _ in range(n):
            fa, fb = a.push({"w": g_frames}), b.push({"w": g_ring})
            fa.result(30)
            fb.result(30)
        expect = w0 - n * LR * G - n * LR * 2 * G
        for c in (a, b):
            got = c.pull(["w"], min_version=2 * n, timeout=30)["w"]
            assert np.array_equal(got, expect)
        assert a.stats["updates_received"] > 0
        assert b.stats["updates_received"] == 0 and b.cache.stats["live_reads"] > 0
        _freed(cluster.url, n)                   # the ring client's pushes only
        assert a.stats["shm_freed"] == 0 and b.stats["shm_freed"] == n
        assert _counters(cluster.url)["pushes_applied"] == 2 * n
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_frames_from_a_client_without_shm_reach_the_shards_through_the_brokers_ring(
        make_cluster, shm_dir):
    """Pushes that came as frames (a client on another host, say) go on to shards that read
    shared memory as references into the broker's own ring: both replicas apply the same
    bytes, exactly, and the broker frees its slots once both did."""
    cluster = make_cluster(2, replicas=2)
    w0 = _w0(1 << 18)                       # 1 MiB: one batch is past the relay threshold
    g = np.full(w0.shape, G, np.float32)
    n = 12
    with gradbus.connect(cluster.url, shm=False) as c:
        assert c.shm is None
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        _push_n(c, {"w": g}, n, acks="all")
        assert np.array_equal(c.pull(["w"], min_version=n, timeout=30)["w"], w0 - n * LR * G)
        counters = _counters(cluster.url)
        assert counters["shm_relayed"] >= 1 and counters["pushes_applied"] == n
        assert counters.get("shm_freed", 0) == 0          # no client ring was involved
        wait_for(lambda: admin.status(cluster.url)["shm_relays_in_flight"] == 0, 20,
                 "the broker's relay slots freed")
        replicas_agree(cluster.url)
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_shard_without_shm_gets_ring_bytes_inlined(monkeypatch, shm_dir):
    cluster = LocalCluster(2, port=0)
    try:
        cluster.start_broker()
        cluster.add_shard("shard-0")
        monkeypatch.setenv("GRADBUS_SHM", "0")       # this shard process only
        cluster.add_shard("shard-1")
        monkeypatch.delenv("GRADBUS_SHM")
        cluster.wait_ready(2)
        w0 = _w0(40_000)
        n = 10
        with gradbus.connect(cluster.url, block_bytes=4096) as c:
            assert c.shm is not None
            # only the shard with shared memory makes a board
            wait_for(lambda: "s" in _roles(c.shm.cluster), 10, "shard-0's board")
            assert _roles(c.shm.cluster)["s"] == {cluster.shard_procs["shard-0"].pid}
            c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
            c.pull(["w"])
            st = admin.status(cluster.url)
            assert all(s["partitions"] > 0 for s in st["shards"])   # both hold some of it
            _push_n(c, {"w": np.full(w0.shape, G, np.float32)}, n)
            got = c.pull(["w"], min_version=n, timeout=30)["w"]
            assert np.array_equal(got, w0 - n * LR * G)
            _freed(cluster.url, n)
            cnt = _counters(cluster.url)
            assert cnt["shm_inlined"] >= 1 and cnt["pushes_applied"] == n
            assert not any(k.startswith("shm_BAD") for k in st.get("errors", {}))
    finally:
        cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_replicas_stay_bit_identical_and_the_standby_serves_exact_weights(make_cluster,
                                                                          shm_dir):
    cluster = make_cluster(3, replicas=2, broker_args=FAST_HB, shard_args=FAST_HB)
    w0 = _w0(3000)
    g = np.full(w0.shape, G, np.float32)
    n1, n2 = 30, 20
    with gradbus.connect(cluster.url, block_bytes=4096, resend_after=1.0) as c:
        assert c.shm is not None
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        _push_n(c, {"w": g}, n1, acks="all")
        _freed(cluster.url, n1)           # freed once both replicas applied
        replicas_agree(cluster.url)
        owners = admin.partitions(cluster.url)["owners"]
        victim = owners[partition_of("w/0", len(owners))]
        cluster.kill_shard(victim, signal.SIGKILL)
        wait_for(lambda: victim not in admin.partitions(cluster.url, timeout=1.0)["owners"],
                 15, "the standby to take over")
        with gradbus.connect(cluster.url, block_bytes=4096) as d:     # a fresh reader
            assert np.array_equal(d.pull(["w"], min_version=n1, timeout=30)["w"],
                                  w0 - n1 * LR * G)
        _push_n(c, {"w": g}, n2, acks="all")
        assert np.array_equal(c.pull(["w"], min_version=n1 + n2, timeout=30)["w"],
                              w0 - (n1 + n2) * LR * G)
        _freed(cluster.url, n1 + n2)
        replicas_agree(cluster.url)          # the third shard caught up: identical again
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_the_update_log_holds_the_bytes_and_rebuilds_a_killed_shard(make_cluster, tmp_path,
                                                                     shm_dir):
    """The broker logs what it sent as refs with the bytes in them: after the pushing client
    is gone (its ring with it) a shard killed and started empty is rebuilt from the log."""
    log = str(tmp_path / "log")
    fast = ["--heartbeat-interval", "0.1", "--liveness", "5"]
    cluster = make_cluster(1, broker_args=[*fast, "--log-dir", log, "--log-fsync", "always"],
                           shard_args=fast)
    w0 = _w0(3000)
    g = np.full(w0.shape, G, np.float32)
    n = 10
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        assert c.shm is not None
        tag = c.shm.cluster
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        _push_n(c, {"w": g}, n)
        _freed(cluster.url, n)
    assert "w" not in _roles(tag)                 # the ring is gone
    pushes = 0
    for h, frames in ulog.read(log):              # checksums checked as it reads
        assert not any("r" in d for d in h["t"])
        for e in h["e"]:
            if e.get("op") == "push":
                pushes += 1
                fr = frames[e["i"]]
                assert len(fr) > 0 and np.array_equal(np.frombuffer(fr, np.float32),
                                                       np.full(len(fr) // 4, G, np.float32))
    assert pushes == n * 3             # 3000 floats: three blocks of 1024 (4 KiB) each
    cluster.kill_shard("shard-0")
    wait_for(lambda: _counters(cluster.url).get("shards_lost"), 10, "the broker to notice")
    cluster.add_shard("shard-0")      # from nothing: the log replays every record
    wait_for(lambda: not admin.status(cluster.url)["partitions_down"]
             and admin.status(cluster.url)["shards"][0]["alive"], 20, "the shard back")
    with gradbus.connect(cluster.url, block_bytes=4096) as d:
        assert np.array_equal(d.pull(["w"], min_version=n, timeout=30)["w"], w0 - n * LR * G)
        _push_n(d, {"w": g}, 1)
        assert np.array_equal(d.pull(["w"], min_version=n + 1, timeout=30)["w"],
                              w0 - (n + 1) * LR * G)
    assert _counters(cluster.url)["replay_scheduled"] >= 1
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


# ----------------------------------------------------------------------------- no leaks
PUSHER = """
import sys
import numpy as np
import gradbus
c = gradbus.connect(sys.argv[1], block_bytes=4096)
assert c.shm is not None
g = np.ones(3000, np.float32)
i = 0
while True:
    c.push({"w": g}).result(30)
    i += 1
    if i == 3:
        print("pushing", flush=True)
"""


def test_a_sigkilled_worker_leaves_no_segment(make_cluster, shm_dir):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, block_bytes=4096) as c:
        tag = c.shm.cluster
        c.init({"w": _w0(3000)}, optimizer=gradbus.SGD(lr=LR))
        before = _counters(cluster.url).get("shm_freed", 0)
        worker = subprocess.Popen([sys.executable, "-c", PUSHER, cluster.url], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline().strip() == "pushing"
            assert worker.pid in _roles(tag)["w"]
            wait_for(lambda: _counters(cluster.url).get("shm_freed", 0) >= before + 3, 10,
                     "the worker's pushes through its ring")
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            worker.stdout.close()
        # the broker's sweep removes the dead worker's ring while the cluster runs
        wait_for(lambda: worker.pid not in _roles(tag).get("w", set()), 20,
                 "the dead worker's ring swept")
        assert _counters(cluster.url)["shm_swept"] >= 1
        before = c.pull(["w"], timeout=30)["w"].copy()
        version = c.cache.version("w")
        _push_n(c, {"w": np.ones(3000, np.float32)}, 2)     # the cluster still serves
        assert np.array_equal(c.pull(["w"], min_version=version + 2, timeout=30)["w"],
                              before - 2 * LR)
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


LOADER = """
import sys
import threading
import numpy as np
import gradbus
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with gradbus.connect(sys.argv[1], block_bytes=4096, timeout=120) as c:
    assert c.shm is not None
    g = {"w": np.ones(3000, np.float32)}
    n = 0
    while not stop.is_set():
        c.push(g)                  # never waited for: a window of pushes always in flight
        n += 1
        if n == 1:
            print("pushing", flush=True)
    c.flush(120)
print(n, flush=True)
"""

VICTIM = """
import sys
import threading
import numpy as np
import gradbus
c = gradbus.connect(sys.argv[1], block_bytes=4096, client_id=b"victim")
assert c.shm is not None
for _ in range(int(sys.argv[2])):
    c.push({"v": np.ones(3000, np.float32)})
print("sent", flush=True)
threading.Event().wait()
"""


def _pushes_of(url: str, client_id: bytes) -> int:
    for w in admin.status(url)["workers"]:
        if w["id"] == client_id.hex():
            return w["pushes"]
    return 0


def test_a_dead_workers_ring_goes_under_load_once_no_replica_still_needs_it(make_cluster,
                                                                           shm_dir):
    """Two workers push without pause the whole time. A third sends K pushes while both
    replicas are stopped (SIGSTOP), and is SIGKILLed before any is applied: a sweep finds its
    ring and keeps it (named by unapplied batches). Once the shards run again, the ring goes
    while the two others still push; every one of the K pushes was applied whole on both
    replicas (the known answer, nothing refused), and the replicas agree (the fixture)."""
    slow = ["--heartbeat-interval", "0.5", "--liveness", "60"]    # stopped 30 s: not dead
    cluster = make_cluster(2, replicas=2, broker_args=[*slow, "--expect-shards", "2"],
                           shard_args=slow)
    url, k = cluster.url, 8
    with gradbus.connect(url, block_bytes=4096) as c:
        tag = c.shm.cluster
        c.init({"w": _w0(3000), "v": _w0(3000)}, optimizer=gradbus.SGD(lr=LR))
        replicas_agree(url)
        loaders = [spawn_code(LOADER, url) for _ in range(2)]
        shards = [p.pid for p in cluster.shard_procs.values()]
        victim = None
        try:
            assert [p.stdout.readline().strip() for p in loaders] == ["pushing"] * 2
            for pid in shards:
                os.kill(pid, signal.SIGSTOP)
            try:
                victim = spawn_code(VICTIM, url, k)
                assert victim.stdout.readline().strip() == "sent"
                wait_for(lambda: _pushes_of(url, b"victim") == k, 30, "the victim's pushes")
                ring = {n for n in shm.segments(tag) if shm.owned(n)[2] == victim.pid}
                assert ring
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                # a sweep finds the dead worker's ring named by unapplied batches: kept
                wait_for(lambda: _counters(url).get("shm_sweep_kept", 0) >= len(ring), 30,
                         "a sweep keeping the dead ring")
                assert ring <= set(shm.segments(tag))
            finally:
                for pid in shards:
                    os.kill(pid, signal.SIGCONT)
            # applied on both replicas now: the ring goes while the others keep pushing
            wait_for(lambda: not ring & set(shm.segments(tag)), 60, "the dead ring removed")
            assert [p.poll() for p in loaders] == [None, None]
            before = _counters(url)["pushes_received"]
            wait_for(lambda: _counters(url)["pushes_received"] > before, 30, "more pushes")
        finally:
            counts = [end_code(p) for p in loaders]
            if victim is not None:
                victim.kill()
                victim.wait(10)
                victim.stdin.close()
                victim.stdout.close()
        assert counts == [0, 0]
        assert np.array_equal(c.pull(["v"], min_version=k, timeout=30)["v"], _w0(3000) - k * LR)
        st = admin.status(url)
        assert [t["version"] for t in st["tensors"] if t["name"] == "v"] == [k]
        assert [s["info"].get("pushes_refused", 0) for s in st["shards"]] == [0, 0]
        assert st["counters"]["shm_swept"] >= len(ring)
        replicas_agree(url)
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_sigkilled_shard_leaves_no_segment(make_cluster, shm_dir):
    cluster = make_cluster(2)
    with gradbus.connect(cluster.url, block_bytes=4096, resend_after=1.0) as c:
        tag = c.shm.cluster
        c.init({"w": _w0(20_000)}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        g = {"w": np.ones(20_000, np.float32)}
        _push_n(c, g, 3)
        victim = cluster.shard_procs["shard-0"].pid
        assert victim in _roles(tag)["s"]
        futs = [c.push(g) for _ in range(5)]       # in flight when it dies
        cluster.kill_shard("shard-0")
        cluster.add_shard("shard-0")
        cluster.wait_ready(2)
        for f in futs:                   # settled either way; what matters is what is left
            f.exception(30)
        # the restarted shard (or the broker's sweep) removes the dead one's board
        wait_for(lambda: victim not in _roles(tag).get("s", set()), 20, "the dead board swept")
        wait_for(lambda: len(_roles(tag).get("s", ())) == 2, 20, "the new shard's board")
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_sigkilled_broker_leaves_no_segment(make_cluster, shm_dir):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, block_bytes=4096, timeout=5) as c:
        tag = c.shm.cluster
        c.init({"w": _w0(3000)}, optimizer=gradbus.SGD(lr=LR))
        _push_n(c, {"w": np.ones(3000, np.float32)}, 3)
        assert set(_roles(tag)) == {"b", "s", "w"}
        c.push({"w": np.ones(3000, np.float32)})          # maybe in flight when it dies
        cluster.broker_proc.send_signal(signal.SIGKILL)
        cluster.broker_proc.wait(10)
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


# ----------------------------------------------------------------------------- no room
def test_a_full_shm_directory_falls_back_to_frames_with_exact_answers(make_cluster,
                                                                      small_tmpfs):
    """12 MiB: the broker's probe and one 8 MiB ring segment fit; the shards' boards (64 MiB)
    do not, so weights go as frames; a push too large for the ring's one segment goes as
    frames (the ring cannot grow), the small ones before and after it through the ring."""
    d = small_tmpfs("12m")
    cluster = make_cluster(2, metrics_port=0)
    small, large = _w0(1000), _w0(9 << 18)          # 4 KB, and 9 MiB
    with gradbus.connect(cluster.url) as c:
        assert c.shm is not None and set(_roles(c.shm.cluster)) == {"b", "w"}   # no board
        c.init({"a": small, "b": large}, optimizer=gradbus.SGD(lr=LR))
        c.pull()
        ga, gb = np.full(small.shape, G, np.float32), np.full(large.shape, G, np.float32)
        _push_n(c, {"a": ga}, 1)
        _push_n(c, {"b": gb}, 1)
        _push_n(c, {"a": ga}, 1)
        w = {"a": c.pull(["a"], min_version=2, timeout=30)["a"],
             "b": c.pull(["b"], min_version=1, timeout=30)["b"]}
        assert np.array_equal(w["a"], small - 2 * LR * G)
        assert np.array_equal(w["b"], large - LR * G)
        assert c.shm.ring.stats["shm_ring_full"] == 1 and c.shm.ring.failed is not None
        _freed(cluster.url, 2)
        # what the alerts read: the push that went as frames, /dev/shm refused segments
        cm = metrics.client_snapshot(c)
        assert cm["gradbus_client_shm_fallbacks"][2][()] == 1
        assert cm["gradbus_client_shm_exhausted"][2][()] == 1
        assert cm["gradbus_client_shm_freed"][2][()] == 2
    urls = wait_for(lambda: len(u := admin.status(cluster.url)["metrics_urls"]) == 3 and u, 15,
                    "every process's metrics URL")
    for sid in ("shard-0", "shard-1"):      # no room for a board: weights as frames
        m = wait_for(lambda sid=sid: (m := _scrape(urls[sid])).get(
            "gradbus_shard_shm_exhausted") == 1 and m, 15, f"{sid}'s board refused")
        assert m["gradbus_shard_shm"] == 0
    b = wait_for(lambda: (b := _scrape(urls["broker"])).get("gradbus_broker_shm_freed_total")
                 == 2 and b, 15, "the broker's freed pushes in its metrics")
    assert b["gradbus_broker_shm"] == 1
    cluster.stop()
    assert gradbus_segments(d) == []


def test_a_relay_ring_refused_by_a_full_shm_directory_sends_frames_and_says_so(make_cluster,
                                                                              small_tmpfs):
    """12 MiB: no room for a 13 MiB relay segment, so pushes from a client without shared
    memory reach the shard as frames, exactly, and the broker counts them as fallbacks."""
    small_tmpfs("12m")
    cluster = make_cluster(1, metrics_port=0)
    w0 = _w0(13 << 18)                                    # 13 MiB
    with gradbus.connect(cluster.url, shm=False) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        _push_n(c, {"w": np.full(w0.shape, G, np.float32)}, 1)
        assert np.array_equal(c.pull(["w"], min_version=1, timeout=30)["w"], w0 - LR * G)
    url = admin.status(cluster.url)["metrics_url"]
    b = wait_for(lambda: (b := _scrape(url)).get("gradbus_broker_shm_exhausted") == 1 and b,
                 15, "the broker's relay ring refused")
    assert b["gradbus_broker_shm_fallbacks_total"] >= 1
    assert b["gradbus_broker_shm_relayed_total"] == 0


# ----------------------------------------------------------------------------- a restarted broker
def _dead_owners_segment(tag: str, role: str) -> str:
    """A segment of cluster ``tag`` whose owner (a child process) is gone, as a SIGKILLed
    process leaves it."""
    code = ("import os; from gradbus.codecs import shm; "
            f"r = shm.Ring({tag!r}, 1 << 20, first=1 << 20, role={role!r}); "
            "print(r.arenas[0].seg.name, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=True)
    return out.stdout.strip()


def test_a_new_broker_keeps_dead_processes_rings_until_every_shard_registered(shm_dir):
    """A dead broker's relay ring, and a dead client's ring, may be named by batches a shard
    still holds from before the broker's restart: the new broker removes them only once it
    recovered (here: both expected shards registered), a dead shard's board at once."""
    port = free_ports(1)[0]
    tag = shm.cluster_tag(f"127.0.0.1:{port}")
    relay, ring = _dead_owners_segment(tag, "b"), _dead_owners_segment(tag, "w")
    board = _dead_owners_segment(tag, "s")
    other = _dead_owners_segment("0badc0de", "b")      # a cluster nobody is left in
    cluster = LocalCluster(1, port=port, broker_args=[
        "--expect-shards", "2", "--heartbeat-interval", "1", "--liveness", "10"])
    try:
        cluster.start()
        present = set(os.listdir(shm_dir))
        assert {relay, ring, other} <= present and board not in present
        with gradbus.connect(cluster.url, block_bytes=4096) as c:   # the broker's loop runs
            c.init({"w": _w0(1000)}, optimizer=gradbus.SGD(lr=LR))
            _push_n(c, {"w": np.ones(1000, np.float32)}, 2)
            assert {relay, ring, other} <= set(os.listdir(shm_dir))
            cluster.add_shard("s1")
            cluster.wait_ready(2)
            wait_for(lambda: not {relay, ring, other} & set(os.listdir(shm_dir)), 30,
                     "the dead processes' rings removed")
            assert _counters(cluster.url)["shm_swept"] >= 3
    finally:
        cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_pull_waiting_on_a_live_partition_follows_it_only_while_it_waits(make_cluster,
                                                                          shm_dir):
    """A reader of the boards follows no updates; a pull that waits for a version another
    client's pushes bring follows the partition's updates meanwhile (woken by them), and not
    after."""
    cluster = make_cluster(1)
    w0 = _w0(4000)
    n = 40
    with gradbus.connect(cluster.url, block_bytes=4096) as a, \
            gradbus.connect(cluster.url, block_bytes=4096) as b:
        a.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        b.pull(["w"])
        assert all(p.live for p in b.cache.parts.values()) and not b.state.follows.followed
        got = {}
        t = threading.Thread(target=lambda: got.update(b.pull(["w"], min_version=n,
                                                              timeout=60)))
        t.start()
        _push_n(a, {"w": np.full(w0.shape, G, np.float32)}, n)
        t.join(60)
        assert np.array_equal(got["w"], w0 - n * LR * G)
        assert b.stats["live_wakeups"] > 0 and b.stats["updates_received"] == 0
        wait_for(lambda: not b.state.follows.followed and not b.state.follows.watched, 10,
                 "the reader to stop following")
    cluster.stop()
    assert gradbus_segments(shm_dir) == []
