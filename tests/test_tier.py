"""A broker tier (protocol section 24): several brokers, each with shards of its own, each
sequencing the tensors whose names' home partitions the tier's map gives it. The map, a
member's refusal of what it does not hold, the client that routes by it, the known answer
with 1, 2 and 4 brokers and 2 clients, and a killed member (a broker pair) under pushing
clients. Real broker and shard processes on ephemeral ports."""
from __future__ import annotations

import subprocess
import sys
import threading
from concurrent import futures
from concurrent.futures import Future

import numpy as np
import pytest

import gradbus
from gradbus import admin
from gradbus.cli import render
from gradbus.codecs.errors import Code, MovedError
from gradbus.codecs.tier import TierMap, home_of, name_of, parse_member
from gradbus.tier_cluster import TierCluster
from gradbus.workers import tier_client
from gradbus.workers.tier_client import JoinedFuture, TierClient

from .rigs import gradbus_up, stop_and_check, wait_for

pytestmark = pytest.mark.timeout(240)
LR = 2.0 ** -5
N = 1 << 10
NAMES = [f"t{i}" for i in range(8)]


@pytest.fixture
def make_tier():
    started: list[TierCluster] = []

    def factory(brokers: int, shards: int = 1, **kw) -> TierCluster:
        t = TierCluster(brokers, shards, **kw)
        started.append(t)
        return t.start()

    yield factory
    problems = [p for t in started for m in t.members for p in stop_and_check(m)]
    if problems:
        pytest.fail("tier state at teardown: " + "; ".join(problems))


# -- the map -----------------------------------------------------------------------------------
def test_the_first_map_spreads_home_partitions_round_robin_and_round_trips():
    tm = TierMap.spread(["tcp://a:1", "tcp://b:1,tcp://b2:1", "tcp://c:1"], 256)
    assert tm.version == 1 and tm.partitions == 256
    assert [tm.share(i) for i in range(3)] == [86, 85, 85]
    assert tm.url(1) == "tcp://b:1,tcp://b2:1"
    for name in ("w", "emb", "layer.0.weight"):
        assert tm.owner(name) == home_of(name, 256) % 3
    back = TierMap.from_wire(tm.to_wire())
    assert back == tm


def test_names_of_wire_keys():
    assert name_of("w/3") == "w" and name_of("a/b/0") == "a/b"
    assert name_of("emb#17") == "emb"
    assert name_of("plain") == "plain"


@pytest.mark.parametrize("members, partitions, why", [
    ([], 256, "1 to 64 members"),
    (["tcp://a:1", "tcp://a:1"], 256, "each broker once"),
    (["tcp://a:1", "tcp://b:1", "tcp://c:1"], 2, "at least as many partitions"),
    (["a:1"], 256, "tcp://HOST:PORT"),
    (["tcp://a:1,tcp://b:1,tcp://c:1"], 256, "a pair's two"),
])
def test_a_tier_that_cannot_be_is_refused_with_why(members, partitions, why):
    with pytest.raises(ValueError, match=why):
        TierMap.spread(members, partitions)


@pytest.mark.parametrize("wire", [
    {}, {"v": 0, "members": [["tcp://a:1"]], "owners": [0]},
    {"v": 1, "members": [["tcp://a:1"]], "owners": [1]},
    {"v": 1, "members": [["nope"]], "owners": [0]},
    {"v": 1, "members": "tcp://a:1", "owners": [0]},
])
def test_a_map_off_the_wire_that_does_not_hold_together_is_refused(wire):
    with pytest.raises(ValueError, match="not a tier map|tier member"):
        TierMap.from_wire(wire)


def test_parse_member_takes_one_url_or_a_pairs_two():
    assert parse_member(" tcp://a:1 , tcp://b:2 ") == ("tcp://a:1", "tcp://b:2")
    with pytest.raises(ValueError):
        parse_member("")


# -- the joined Future --------------------------------------------------------------------------
def test_a_joined_future_resolves_once_every_part_has_and_fails_with_the_first_failure():
    a, b = Future(), Future()
    j = JoinedFuture([a, b])
    a.set_result({"kind": "ACK", "msg": 1})
    assert not j.done()
    b.set_result({"kind": "ACK", "msg": 2})
    assert j.result(1) == {"kind": "ACK", "parts": [{"kind": "ACK", "msg": 1},
                                                    {"kind": "ACK", "msg": 2}]}
    a, b = Future(), Future()
    j = JoinedFuture([a, b])
    b.set_exception(gradbus.StaleError("too old"))
    assert j.done()
    a.set_result({})                       # a later part changes nothing
    with pytest.raises(gradbus.StaleError):
        j.result(1)
    with pytest.raises(futures.TimeoutError):
        JoinedFuture([Future()]).result(0.05)


# -- the broker's command line ------------------------------------------------------------------
@pytest.mark.parametrize("args, why", [
    (["--tier", "tcp://127.0.0.1:1", "--tier", "tcp://127.0.0.1:2"], "--tier-index"),
    (["--tier", "tcp://127.0.0.1:1", "--tier-index", "1"], "--tier-index"),
    (["--tier-index", "0"], "--tier-index"),
    (["--tier", "127.0.0.1:1", "--tier-index", "0"], "--tier"),
])
def test_a_broker_given_a_tier_it_cannot_be_in_says_why(args, why):
    r = subprocess.run([sys.executable, "-m", "gradbus", "broker", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout
    assert why in r.stderr


# -- a tier at work ----------------------------------------------------------------------------
def _push_all(url: str, pushes: int, errors: list, seen: list) -> None:
    try:
        with gradbus.connect(url, timeout=60) as c:
            seen.append(type(c))
            g = {n: np.ones(N, np.float32) for n in NAMES}
            futs = [c.push(g, acks="all") for _ in range(pushes)]
            for f in futs:
                f.result(60)
    except BaseException as e:
        errors.append(e)


def _known_answer(url: str, total: int) -> dict:
    with gradbus.connect(url, timeout=60) as c:
        got = c.pull(NAMES, min_version=total, timeout=60)
        assert {n: c.version(n) for n in NAMES} == dict.fromkeys(NAMES, total)
    for n in NAMES:
        assert np.array_equal(got[n], np.full(N, -LR * total, np.float32)), n
    return got


def _two_clients(tier: TierCluster, pushes: int, urls: list[str]) -> list:
    errors: list = []
    seen: list = []
    threads = [threading.Thread(target=_push_all, args=(u, pushes, errors, seen))
               for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return seen


@pytest.mark.parametrize("brokers", [1, 2, 4])
def test_the_known_answer_is_exact_with_1_2_and_4_brokers_and_2_clients(make_tier, brokers):
    tier = make_tier(brokers, 1, inproc=brokers == 4)
    with gradbus.connect(tier.url, timeout=60) as c:
        assert isinstance(c, TierClient) == (brokers > 1)
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
    # each client enters through another member; both reach every member
    seen = _two_clients(tier, 25, [tier.urls[0], tier.urls[-1]])
    assert set(seen) == {TierClient if brokers > 1 else gradbus.Client}
    _known_answer(tier.urls[-1], 50)
    held = []
    for i, url in enumerate(tier.urls):
        st = admin.status(url)
        names = {t["name"] for t in st["tensors"]}
        held.append(names)
        assert st["tier"]["member"] == i
        assert [m["urls"] for m in st["tier"]["members"]] == [[u] for u in tier.urls]
        assert names == {n for n in NAMES if TierMap.spread(tier.urls, 256).owner(n) == i}
        # the member's batches carried its tensors only: 25 x 2 pushes of each
        assert st["counters"]["pushes_applied"] == (50 if names else 0)
    assert set().union(*held) == set(NAMES)
    assert sum(len(h) for h in held) == len(NAMES)          # each held exactly once
    if brokers > 1:
        assert all(held), "the 8 names spread over every member"


def test_a_write_sent_to_a_member_that_does_not_hold_it_is_refused_moved(make_tier):
    tier = make_tier(2, 1)
    tm = TierMap.spread(tier.urls, 256)
    mine = [n for n in NAMES if tm.owner(n) == 0]
    theirs = [n for n in NAMES if tm.owner(n) == 1]
    with gradbus.Client(tier.urls[0], timeout=30) as c:      # one member, not the tier
        assert c.tier_map == tm and c.tier_at == 0
        with pytest.raises(MovedError, match=f"held by tier member 1 \\({tier.urls[1]}\\)") \
                as err:
            c.init({theirs[0]: np.zeros(N, np.float32)})
        assert err.value.code is Code.MOVED
        c.init({mine[0]: np.zeros(N, np.float32)}, optimizer=gradbus.SGD(lr=LR))
        with pytest.raises(MovedError):            # mixed: nothing of it kept
            c.init({mine[1]: np.zeros(N, np.float32), theirs[0]: np.zeros(N, np.float32)})
        with pytest.raises(MovedError):
            c.pull([theirs[0]], timeout=10)
        c.push({mine[0]: np.ones(N, np.float32)}, acks="all").result(30)
    st = admin.status(tier.urls[0])
    assert [t["name"] for t in st["tensors"]] == [mine[0]]
    assert st["counters"]["tier_moved"] == 3
    assert st["counters"]["pushes_applied"] == 1
    assert admin.status(tier.urls[1])["tensors"] == []
    text = render.status_text(st, tier.urls[0])
    assert f"tier     member 0 of 2, map v1; home partitions: 0* 128 ({tier.urls[0]})" in text


def test_members_started_with_different_tiers_are_refused_by_the_client(make_tier):
    tier = make_tier(2, 1)
    other = make_tier(2, 1)
    # member 1 of `tier` is told a tier whose second member is `other`'s: the maps differ
    c = gradbus.Client(tier.urls[0], timeout=30)
    c.tier_map = TierMap.spread([tier.urls[0], other.urls[1]], 256)
    with pytest.raises(ValueError, match="another tier map"):
        TierClient(c, {"timeout": 30})
    assert c._closed                              # nothing left open


# Slow: on a machine whose cores are all taken (the suite on 2 cores beside two busy loops)
# the standby of the killed broker once in about ten runs never got its shards' votes and
# nothing was served for 60 s (nothing lost either); the pair tests share that weakness.
@pytest.mark.slow
def test_a_killed_member_broker_with_a_standby_loses_no_acknowledged_push(make_tier):
    """Each member a broker pair with 2 replicas; the active broker of member 1 is SIGKILLed
    while 2 clients push acks="all" to every member. Its standby takes over; every push is
    acknowledged and applied once, on both members."""
    # a shard's vote lasts (liveness - 2) intervals: 3 s here rather than 0.5 s, so that a
    # CPU-starved shard's late heartbeat does not leave the new broker without its votes
    beat = ["--heartbeat-interval", "0.5", "--liveness", "8"]
    tier = make_tier(2, 2, pairs=True, replicas=2, broker_args=beat, shard_args=beat)
    with gradbus.connect(tier.url, timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
    m = tier.members[1]

    def active() -> str | None:
        for name in m.broker_names:
            try:
                if admin.status(m.broker_url(name), timeout=1.0)["pair"]["role"] == "active":
                    return name
            except gradbus.GradbusError:
                pass
        return None

    first = wait_for(active, 30, "member 1's active broker")
    errors: list = []
    seen: list = []
    threads = [threading.Thread(target=_push_all, args=(tier.url, 30, errors, seen))
               for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: admin.status(m.broker_url(first))["counters"].get("pushes_applied", 0)
             >= 10, 60, "pushes applied at member 1")
    m.broker_procs[first].kill()
    for t in threads:
        t.join(180)
    if errors:      # what member 1's processes said, to tell why
        for name, p in [*m.broker_procs.items(), *m.shard_procs.items()]:
            if p.stderr_tail is not None:
                print(f"--- {name}:\n{p.stderr_tail.text(1.0)[-3000:]}")
    assert not errors, errors
    _known_answer(tier.url, 60)
    assert wait_for(active, 30, "a new active broker") != first



def _reach(c: TierClient, name: str):
    """``name``'s weights, or None while its member does not answer (or, just restarted,
    does not know the name yet: its shard registers with it)."""
    try:
        return c.pull([name], timeout=10)[name]
    except (gradbus.BrokerUnavailableError, gradbus.UnknownKeyError):
        return None


def test_a_killed_member_broker_without_a_standby_comes_back_and_loses_no_acknowledged_push(
        make_tier, monkeypatch):
    """Members of one broker each (no standby). Member 1's broker is SIGKILLed while 2
    clients push acks="all" to both members, then started again on its ports, as ``gradbus
    up`` restarts it: member 0 serves on meanwhile, member 1's shard registers with the new
    broker holding its data, the clients' unsettled pushes go again to it, and every push is
    applied exactly once (protocol section 24: a dead member's names wait for it)."""
    # a member that does not answer is given 1 s rather than 5 to answer a HELLO (twice here:
    # at connect, and when a push first needs it): the same refusals, sooner
    monkeypatch.setattr(tier_client, "REACH_TIMEOUT", 1.0)
    tier = make_tier(2, 1)
    with gradbus.connect(tier.url, timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
    m0, m1 = tier.members
    errors: list = []
    threads = [threading.Thread(target=_push_all, args=(u, 30, errors, []))
               for u in (tier.urls[0], tier.urls[1])]
    for t in threads:
        t.start()
    wait_for(lambda: admin.status(tier.urls[1])["counters"].get("pushes_applied", 0) >= 10,
             60, "pushes applied at member 1")
    m1.broker_procs["broker"].kill()
    m1.broker_procs["broker"].wait(10)
    # member 0 serves its names meanwhile (the pushing clients wait: each push goes to both),
    # to a client that starts now too; member 1's names are refused by it, said so
    with gradbus.connect(tier.urls[0], timeout=60) as c:
        assert c.members[1] is None and not c.broker_alive
        solo = next(f"solo{i}" for i in range(1000) if c.tier.owner(f"solo{i}") == 0)
        c.init({solo: np.zeros(4, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        c.push({solo: np.ones(4, np.float32)}, acks="all").result(30)
        assert np.array_equal(c.pull([solo], min_version=1, timeout=30)[solo],
                              np.full(4, -1.0, np.float32))
        theirs = next(n for n in NAMES if c.tier.owner(n) == 1)
        with pytest.raises(gradbus.BrokerUnavailableError, match="no broker answered"):
            c.push({theirs: np.ones(N, np.float32)})
        assert "error" in c.status()["members"][1]
        m1.start_broker()
        # the same client reaches member 1 once it answers
        wait_for(lambda: _reach(c, theirs) is not None, 60, "member 1 reached again")
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    _known_answer(tier.url, 60)
    st = admin.status(tier.urls[1])
    assert st["shards"][0]["alive"] and not st["partitions_down"]

def test_up_runs_a_tier_with_curve_metrics_and_a_data_dir(tmp_path):
    """``gradbus up --tier-brokers 2`` with ``--curve``, ``--metrics-port 0`` and
    ``--data-dir``: one key set admits the client at both members (and refuses one without
    keys), each member's processes serve metrics on ports of their own, a checkpoint asked of
    the first member covers both members' shards under the one data directory, and SIGTERM
    stops it all with exit 0."""
    import os
    import signal
    import urllib.request

    keys, data = tmp_path / "keys", tmp_path / "data"
    with gradbus_up("--tier-brokers", 2, "--shards", 1, "--port", 0, "--curve", keys,
                    "--metrics-port", 0, "--data-dir", data) as (proc, url):
        assert url.startswith("tcp://127.0.0.1:"), url
        assert proc.stdout.readline().startswith("curve: clients use --curve-secret")
        curve = gradbus.Curve.from_files(keys / "client.key_secret", keys / "broker.key")
        with gradbus.connect(url, curve=curve, timeout=60) as c:
            assert isinstance(c, TierClient) and len(c.members) == 2
            c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
            assert {c.tier.owner(n) for n in NAMES} == {0, 1}
            for _ in range(3):
                c.push({n: np.ones(N, np.float32) for n in NAMES}).result(30)
            got = c.pull(NAMES, min_version=3, timeout=30)
        assert all(np.array_equal(got[n], np.full(N, -3 * LR, np.float32)) for n in NAMES)
        with pytest.raises(gradbus.SecurityError):
            gradbus.connect(url, curve=False, timeout=10)

        members = admin.tier_urls(url, curve=curve)
        # a broker and a shard each (a shard names its endpoint in a heartbeat)
        metrics = wait_for(lambda: (lambda ms: ms if all(len(m) == 2 for m in ms) else None)(
            [admin.status(m, curve=curve)["metrics_urls"] for m in members]), 30,
            "every member's shard to name its metrics endpoint")
        every = [u for m in metrics for u in m.values()]
        assert len(set(every)) == 4, metrics
        for i, m in enumerate(metrics):          # each member's broker says its own share
            with urllib.request.urlopen(m["broker"], timeout=10) as r:
                text = r.read().decode()
            held = sum(1 for p in range(256) if TierMap.spread(members, 256).owners[p] == i)
            assert f"gradbus_broker_tier_partitions {held}" in text, text[:400]

        written = admin.checkpoint(url, curve=curve)
        assert [r["shard"] for r in written] == ["b0-shard-0", "b1-shard-0"], written
        assert not any(r.get("error") for r in written), written
        for r in written:
            assert os.path.dirname(os.path.dirname(r["path"])) == str(data), r
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_the_demos_train_through_a_tier_and_the_client_sums_its_members(make_tier):
    """``gradbus demo`` and ``gradbus demo ctr`` against a tier: the model's tensors and the
    CTR tables spread over both members, training works, the summaries read every member.
    The TierClient's compression and cache figures are its members' summed."""
    import json
    import os

    from .child import ROOT

    tier = make_tier(2, 1)
    out = subprocess.run([sys.executable, "-m", "gradbus", "demo", "--broker", tier.url,
                          "--workers", "2", "--epochs", "3", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=200,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["test_accuracy"] > 0.8 and summary["pushes"] > 0, summary
    out = subprocess.run([sys.executable, "-m", "gradbus", "demo", "ctr", "--broker", tier.url,
                          "--workers", "2", "--epochs", "1", "--train", "20000", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=200,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    ctr = json.loads(out.stdout.strip().splitlines()[-1])
    # the tables' rows, read from the member holding each table
    assert set(ctr["rows"]) == {"ctr.emb", "ctr.lin"} and all(ctr["rows"].values()), ctr
    held = [{t["name"] for t in admin.status(u)["tensors"]}
            | {t["name"] for t in admin.status(u).get("tables", [])} for u in tier.urls]
    assert all(held) and not held[0] & held[1], held    # both members hold names, each once

    with gradbus.connect(tier.url, timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        c.push({n: np.ones(N, np.float32) for n in NAMES}, codec="bf16").result(30)
        c.pull(NAMES, min_version=1, timeout=30)
        per = [m.compression_stats() for m in c.members]
        total = c.compression_stats()
        assert total["push_bytes"] == sum(p["push_bytes"] for p in per) > 0
        assert total["ratio"] == pytest.approx(total["push_raw_bytes"] / total["push_bytes"])
        each = [m.cache_stats for m in c.members]
        assert c.cache_stats == {k: sum(e.get(k, 0) for e in each) for k in set().union(*each)}
        assert c.cache_stats["snapshots"] > 0
        assert c.url == tier.url and c.window == c.members[0].window
