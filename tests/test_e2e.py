"""End to end through real broker and shard processes on ephemeral ports."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gradbus
from gradbus import admin

from .rigs import wait_for

# every test twice: tensor bytes through shared memory (the default), then as frames
BOTH_DATA_PATHS = True

LR = 0.25     # powers of two: every intermediate result is exact in float32 and float64
G = 0.5


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_known_answer_sgd(make_cluster, shards):
    cluster = make_cluster(shards)
    shapes = {"a": ((3,), "float32"), "b": ((40, 30), "float64"), "c": ((700_000,), "float32"),
              "d": ((2, 3, 4), "float64")}
    w0 = {n: (np.arange(np.prod(s)) % 97).astype(dt).reshape(s) for n, (s, dt) in shapes.items()}
    n_push = 12
    with gradbus.connect(cluster.url, block_bytes=256 << 10) as c:
        got = c.init(w0, optimizer=gradbus.SGD(lr=LR))
        for n in w0:
            assert np.array_equal(got[n], w0[n])
        grads = {n: np.full(s, G, dt) for n, (s, dt) in shapes.items()}
        futs = [c.push(grads, acks=1) for _ in range(n_push)]
        for f in futs:
            f.result(timeout=30)
        w = c.pull(min_version=n_push, timeout=30)
    for n in w0:
        expect = w0[n] - n_push * LR * G
        assert w[n].dtype == w0[n].dtype and w[n].shape == w0[n].shape
        assert np.array_equal(w[n], expect), n
    st = admin.status(cluster.url)
    assert st["counters"]["pushes_applied"] == n_push
    # the 700k-element tensor spans several blocks; with >1 shard its partitions spread out
    if shards > 1:
        assert sum(1 for s in st["shards"] if s["partitions"] > 0) > 1


def test_two_clients_every_push_applied_once(make_cluster):
    cluster = make_cluster(2)
    w0 = np.zeros(1000, np.float32)
    per_client = 60
    with gradbus.connect(cluster.url) as a, gradbus.connect(cluster.url) as b:
        a.init({"w": w0}, optimizer=gradbus.SGD(lr=1.0))
        b.init({"w": np.ones(1000, np.float32)}, optimizer=gradbus.SGD(lr=1.0))  # no-op: exists
        errors = []

        def run(client, value):
            try:
                g = np.full(1000, value, np.float32)
                futs = [client.push({"w": g}) for _ in range(per_client)]
                for f in futs:
                    f.result(timeout=30)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=run, args=(a, 1.0)), threading.Thread(target=run,
                                                                           args=(b, 2.0))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors
        w = a.pull(["w"], min_version=2 * per_client, timeout=30)["w"]
        # each client's pushes counted once: -(60*1 + 60*2)
        assert np.array_equal(w, np.full(1000, -180.0, np.float32))
        st = a.status()
    assert st["counters"]["pushes_applied"] == 2 * per_client
    assert st["counters"].get("duplicates", 0) == 0
    assert {w["pushes"] for w in st["workers"]} >= {per_client}


def test_an_acks_version_reads_the_push(make_cluster):
    """Read your writes: a push's ACK names the version its tensor had once it was applied, and
    ``pull(min_version=...)`` with it returns weights that include the push, while another
    client pushes to the same tensor (every gradient is 1 and lr 1: each block's weights are
    minus its version, so every element shows how many gradients its block holds)."""
    cluster = make_cluster(2)
    n = 300_000            # several blocks, over both shards
    stop = threading.Event()
    with gradbus.connect(cluster.url, block_bytes=256 << 10) as a, \
            gradbus.connect(cluster.url, block_bytes=256 << 10) as b:
        a.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        b.pull(["w"])

        def other():
            while not stop.is_set():
                b.push({"w": np.ones(n, np.float32)}).result(30)

        t = threading.Thread(target=other)
        t.start()
        try:
            seen = []
            for k in range(1, 21):
                ack = a.push({"w": np.ones(n, np.float32)}).result(30)
                assert set(ack) == {"kind", "msg", "ver"} and ack["ver"] >= k
                w = a.pull(["w"], min_version=ack["ver"], timeout=30)["w"]
                assert (-w >= ack["ver"]).all(), (ack, np.unique(w))
                seen.append(ack["ver"])
        finally:
            stop.set()
            t.join(60)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert seen[-1] > 20, "the other client's pushes were never in between"


def test_worker_that_never_pulls_gets_fresh_weights(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as reader, gradbus.connect(cluster.url) as writer:
        writer.init({"w": np.zeros(8, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        reader.pull(["w"])  # follow it once
        for _ in range(5):
            writer.push({"w": np.ones(8, np.float32)}).result(10)
        # the subscription delivers updates to the reader's cache without any round trip
        wait_for(lambda: reader.version("w") == 5, 10, "reader cache at version 5")
        assert np.array_equal(reader.pull(["w"])["w"], np.full(8, -5.0, np.float32))


def test_optimizers_and_initializers_through_cluster(make_cluster):
    cluster = make_cluster(2)
    with gradbus.connect(cluster.url) as c:
        w = c.init({"z": gradbus.Zeros((5,)), "k": gradbus.Constant((4,), value=2.5),
                    "n": gradbus.Normal((1000,), std=0.1, seed=3),
                    "u": gradbus.Uniform((1000,), low=-1, high=1, seed=4)},
                   optimizer=gradbus.Adam(lr=0.01))
        assert np.array_equal(w["z"], np.zeros(5, np.float32))
        assert np.array_equal(w["k"], np.full(4, 2.5, np.float32))
        assert 0.08 < w["n"].std() < 0.12 and -1 <= w["u"].min() and w["u"].max() <= 1
        again = c.init({"n": gradbus.Normal((1000,), std=0.1, seed=3)})
        assert np.array_equal(again["n"], w["n"])  # idempotent, returns current weights
        c.push({"z": np.ones(5, np.float32)}).result(10)
        z = c.pull(["z"], min_version=1)["z"]
        # Adam's first step moves every coordinate by lr against the gradient's sign
        assert np.allclose(z, -0.01, rtol=1e-5)


def test_bf16_push(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(1 << 16, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({"w": np.full(1 << 16, 0.5, np.float32)}, codec="bf16|zstd").result(10)
        w = c.pull(["w"], min_version=1)["w"]
        assert np.array_equal(w, np.full(1 << 16, -0.5, np.float32))
        assert c.stats["push_bytes"] < (1 << 16) * 2  # zstd kept: constant data compresses


def test_user_errors_are_clear(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(4, np.float32)})
        with pytest.raises(gradbus.UnknownKeyError):
            c.push({"nope": np.zeros(4, np.float32)})
        with pytest.raises(ValueError, match="shape"):
            c.push({"w": np.zeros(5, np.float32)})
        with pytest.raises(gradbus.GradbusError, match="SHAPE_MISMATCH"):
            c.init({"w": np.zeros(6, np.float32)})
        with pytest.raises(gradbus.GradbusError, match="NOT_FINITE"):
            c.push({"w": np.array([1, np.nan, 0, 0], np.float32)}).result(10)
        c.push({"w": np.ones(4, np.float32)}).result(10)
        assert np.allclose(c.pull(["w"], min_version=1)["w"], -0.01)
        me = [w for w in c.status()["workers"] if w["id"] == c.client_id.hex()]
        assert me[0]["errors"] == {"NOT_FINITE": 1}      # refusals are counted per client


def test_shard_killed_is_noticed_and_errors_are_clear(make_cluster):
    cluster = make_cluster(2)
    with gradbus.connect(cluster.url, timeout=20) as c:
        c.init({f"t{i}": np.zeros(16, np.float32) for i in range(16)},
               optimizer=gradbus.SGD(lr=1.0))
        st = admin.status(cluster.url)
        victim = "shard-1"
        assert any(s["id"] == victim and s["partitions"] > 0 for s in st["shards"])
        cluster.kill_shard(victim)
        st = wait_for(lambda: (lambda s: s if any(x["id"] == victim and not x["alive"]
                                                  for x in s["shards"]) else None)(
            admin.status(cluster.url)), 5.0, "broker to declare the shard dead")
        assert st["partitions_down"]
        # keys on the dead shard: a clear error, not a hang; keys elsewhere still work
        from gradbus.codecs.partition import partition_of
        down = set(st["partitions_down"])
        dead_keys = [f"t{i}" for i in range(16) if partition_of(f"t{i}/0", st["partitions"]) in down]
        live_keys = [f"t{i}" for i in range(16) if f"t{i}" not in dead_keys]
        assert dead_keys and live_keys
        with pytest.raises(gradbus.ShardUnavailableError):
            c.push({dead_keys[0]: np.ones(16, np.float32)}).result(10)
        wait_for(lambda: c.cache.down, 5, "client to learn the table")
        with pytest.raises(gradbus.ShardUnavailableError):
            c.pull([dead_keys[0]], min_version=5, timeout=10)
        c.push({live_keys[0]: np.ones(16, np.float32)}).result(10)
        assert c.pull([live_keys[0]], min_version=1)[live_keys[0]][0] == -1.0


def test_push_does_not_alias_the_callers_array(make_cluster):
    cluster = make_cluster(1)
    n = 300_000
    with gradbus.connect(cluster.url) as c:
        c.init({"w": np.zeros(n, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        G = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        g = G.copy()
        for codec in ("raw", "zstd", "raw|zstd"):
            c.push({"w": g}, codec=codec)
            g[:] = 1e6                                   # the caller reuses its buffer at once
            g[:] = G
        c.flush()
        w = c.pull(["w"], min_version=3)["w"]
    assert np.array_equal(w, -3 * G)    # every push sent G, none the overwritten values


def test_restarted_client_with_same_id_is_not_deduplicated(make_cluster):
    cluster = make_cluster(1)
    for round_ in range(2):
        with gradbus.connect(cluster.url, client_id="same-worker") as c:
            if round_ == 0:
                c.init({"w": np.zeros(4, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
            for f in [c.push({"w": np.ones(4, np.float32)}) for _ in range(3)]:
                f.result(10)
    with gradbus.connect(cluster.url) as c:
        assert np.array_equal(c.pull(["w"], min_version=6)["w"], np.full(4, -6.0, np.float32))


def test_init_on_a_dead_shards_partition_fails_fast(make_cluster):
    from gradbus.codecs.partition import partition_of
    cluster = make_cluster(2)
    with gradbus.connect(cluster.url, timeout=20) as c:
        c.init({f"t{i}": np.zeros(4, np.float32) for i in range(32)})
        st = admin.status(cluster.url)
        cluster.kill_shard("shard-0")
        wait_for(lambda: not next(s for s in admin.status(cluster.url)["shards"]
                                  if s["id"] == "shard-0")["alive"], 5, "shard-0 declared dead")
        down = set(admin.status(cluster.url)["partitions_down"])
        P = st["partitions"]
        name = next(f"x{i}" for i in range(10_000) if partition_of(f"x{i}/0", P) in down)
        with pytest.raises(gradbus.ShardUnavailableError):
            c.init({name: np.zeros(4, np.float32)}, timeout=5)


def test_broker_death_is_a_clear_error(make_cluster):
    import signal
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, timeout=30) as c:
        c.init({"w": np.zeros(4, np.float32)})
        cluster.broker_proc.send_signal(signal.SIGKILL)
        cluster.broker_proc.wait(10)
        with pytest.raises(gradbus.BrokerUnavailableError):
            c.pull(["w"], min_version=1)
        assert not c.broker_alive


@pytest.mark.parametrize("weights_codec", ["delta|raw|shuffle|zstd", "delta|bf16"])
def test_delta_weight_republish(make_cluster, weights_codec):
    cluster = make_cluster(2, shard_args=["--weights-codec", weights_codec])
    w0 = (np.arange(300_000) % 97).astype(np.float32)
    with gradbus.connect(cluster.url, block_bytes=256 << 10) as reader, \
            gradbus.connect(cluster.url) as writer:
        writer.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        reader.pull(["w"])
        for f in [writer.push({"w": np.full(300_000, G, np.float32)}) for _ in range(10)]:
            f.result(20)
        wait_for(lambda: reader.version("w") == 10, 20, "the reader to follow 10 deltas")
        w = reader.pull(["w"])["w"]
    exact = w0 - 10 * LR * G
    if weights_codec.endswith("bf16"):
        assert np.abs(w - exact).max() <= 2 ** -7 * np.abs(exact).max()
    else:
        assert np.array_equal(w, exact)
