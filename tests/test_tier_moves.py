"""Moving names between the members of a broker tier under load (protocol 24.4)."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from click.testing import CliRunner

import gradbus
from gradbus import admin, tier_admin
from gradbus.cli import main
from gradbus.codecs.tier import TierMap
from gradbus.tier_cluster import TierCluster
from gradbus.workers.tier_client import TierClient

from .rigs import stop_and_check

pytestmark = pytest.mark.timeout(240)
LR = 2.0 ** -5
N = 1 << 10
NAMES = [f"t{i}" for i in range(8)]
MOMENTUM = 0.5
PUSHES = 150


@pytest.fixture
def tier2():
    t = TierCluster(2, 1, inproc=True).start()
    yield t
    problems = [p for m in t.members for p in stop_and_check(m)]
    if problems:
        pytest.fail("tier state at teardown: " + "; ".join(problems))


def _twins(urls) -> tuple[str, str]:
    """Two names, one held by each member of the first map."""
    tm = TierMap.spread(urls, 256)
    on = {}
    for i in range(64):
        on.setdefault(tm.owner(f"m{i}"), f"m{i}")
    return on[0], on[1]


def _pusher(url: str, pushes: int, names, errors: list, started: threading.Event,
            seen: list) -> None:
    c = None
    try:
        with gradbus.connect(url, timeout=60) as c:
            g = {n: np.ones(N, np.float32) for n in names}
            futs = []
            for k in range(pushes):
                futs.append(c.push(g, acks="all"))
                if k == 5:
                    started.set()
            for f in futs:
                f.result(60)
            seen.append((c.maps_followed, c.stats_moved, c.stats["recovering_retries"]))
    except BaseException as e:
        errors.append(e)
        # to tell why, should it fail: whether a MOVED came without the push's bytes, and
        # what the client saw
        print(f"pusher: {e!r}; moved_push {getattr(e, 'moved_push', 'absent') is not None}; "
              f"map v{getattr(getattr(c, 'tier', None), 'version', None)}; stats_moved "
              f"{getattr(c, 'stats_moved', None)}; "
              f"{dict(c.stats) if c is not None else None}")
        started.set()


def test_draining_a_member_under_two_pushing_clients_keeps_the_answer_exact(tier2):
    urls = tier2.urls
    twins = _twins(urls)
    with gradbus.connect(urls[0], timeout=60) as c:
        assert isinstance(c, TierClient)
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        c.init({n: np.zeros(N, np.float32) for n in twins},
               optimizer=gradbus.SGD(lr=LR, momentum=MOMENTUM))
        for _ in range(3):      # momentum built up on both members before the move
            c.push({n: np.ones(N, np.float32) for n in twins}, acks="all").result(30)
    before = {i: {t["name"] for t in admin.status(u)["tensors"]} for i, u in enumerate(urls)}
    assert before[0] and before[1]
    errors: list = []
    seen: list = []
    started = [threading.Event(), threading.Event()]
    names = NAMES + list(twins)
    threads = [threading.Thread(target=_pusher, args=(u, PUSHES, names, errors, ev, seen))
               for u, ev in zip(urls, started)]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(60)
    lines: list[str] = []
    done = tier_admin.rebalance(urls[0], members=[1], progress=lines.append)
    for t in threads:
        t.join(180)
    assert not errors, errors
    # the clients were pushing through the move: both took the new map mid-run
    assert [s[0] for s in seen] == [1, 1], seen
    assert sorted(done["names"]) == sorted(before[0]), lines
    assert done["version"] == 2
    total = 2 * PUSHES
    with gradbus.connect(urls[1], timeout=60) as c:
        got = c.pull(NAMES, min_version=total, timeout=60)
        assert {n: c.version(n) for n in NAMES} == dict.fromkeys(NAMES, total)
        tw = c.pull(list(twins), min_version=total + 3, timeout=60)
    for n in NAMES:
        assert np.array_equal(got[n], np.full(N, -LR * total, np.float32)), n
    # the moved twin's momentum came with it: both took the same steps from the same state
    assert np.array_equal(tw[twins[0]], tw[twins[1]])
    assert not np.array_equal(tw[twins[0]], np.full(N, -LR * (total + 3), np.float32))
    st0, st1 = admin.status(urls[0]), admin.status(urls[1])
    assert not st0["tensors"], "the drained member forgot every name"
    assert {t["name"] for t in st1["tensors"]} == set(names)
    assert st0["tier"]["version"] == st1["tier"]["version"] == 2
    assert st1["tier"]["members"][0]["partitions"] == 0
    assert not st1["tier"]["incoming"]


def _held(url: str) -> set:
    return {t["name"] for t in admin.status(url)["tensors"]}


def test_a_mover_that_died_is_finished_by_running_it_again(tier2):
    """The mover stops after fencing (the source answers MOVED, the target RECOVERING for
    the moving names): a push waits, nothing is lost, and the same command run again
    finishes the move; the waiting push is then applied once, at the new member."""
    urls = tier2.urls
    with gradbus.connect(urls[0], timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        c.push({n: np.ones(N, np.float32) for n in NAMES}, acks="all").result(30)
        tm = c.tier
        homes = tm.homes(0)
        moving = sorted(n for n in NAMES if tm.owner(n) == 0)
        new = tm.moved(homes, 1)
        a = tier_admin._Member(urls[0], None, 30)
        b = tier_admin._Member(urls[1], None, 30)
        try:
            b.tier("map", map=new.to_json(), incoming=homes)
            held = a.tier("fence", map=new.to_json())
        finally:
            a.close()
            b.close()
        assert sorted(t["name"] for t in held["tensors"]) == moving
        assert admin.status(urls[1])["tier"]["incoming"] == homes
        shown = CliRunner().invoke(main, ["partitions", "--broker", urls[1]])
        assert shown.exit_code == 0, shown.output
        assert (f"tier     member 1 of 2, map v2; home partitions: 0 0 ({urls[0]})  1* 256 "
                f"({urls[1]}); 128 arriving") in shown.output
        # a push of a moving name waits (RECOVERING at its new member) ...
        acked: list = []
        pusher = threading.Thread(target=lambda: acked.append(c.push(
            {n: np.ones(N, np.float32) for n in NAMES}, acks="all").result(60)))
        pusher.start()
        pusher.join(1.0)
        assert pusher.is_alive() and not acked
        lines: list[str] = []
        done = tier_admin.move(urls[0], homes, 1, progress=lines.append)   # run again
        assert any("finishing the move" in ln for ln in lines), lines
        assert sorted(done["names"]) == moving
        pusher.join(60)                         # ... and is applied once the move is done
        assert len(acked) == 1
        got = c.pull(NAMES, min_version=2, timeout=30)
    for n in NAMES:
        assert np.array_equal(got[n], np.full(N, -2 * LR, np.float32)), n
    assert _held(urls[0]) == set() and _held(urls[1]) == set(NAMES)
    assert admin.status(urls[1])["tier"]["incoming"] == []


def test_the_operators_mistakes_are_refused_with_why(tier2):
    urls = tier2.urls
    with gradbus.connect(urls[0], timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        tm = c.tier
    with pytest.raises(ValueError, match="members 0..1, not 2"):
        tier_admin.move(urls[0], [0], 2)
    with pytest.raises(ValueError, match="home partitions are 0..255"):
        tier_admin.move(urls[0], [256], 1)
    a = tier_admin._Member(urls[0], None, 10)
    try:
        # a map that reorders members, or is older than the member's, changes nothing
        swapped = TierMap(2, tm.members[::-1], tm.owners)
        with pytest.raises(gradbus.GradbusError, match="keep every member in its place"):
            a.tier("map", map=swapped.to_json())
        newer = tm.moved([1], 0)
        a.tier("map", map=newer.to_json())
        with pytest.raises(gradbus.GradbusError, match="not newer"):
            a.tier("map", map=tm.moved([3], 0).to_json().copy() | {"v": 1})
        # incoming homes that the map gives another member; an export of names still held
        with pytest.raises(gradbus.GradbusError, match="not this member's"):
            a.tier("map", map=newer.to_json(), incoming=[3])
        mine = next(n for n in NAMES if newer.owner(n) == 0)
        with pytest.raises(gradbus.GradbusError, match="still holds"):
            a.tier("export", p=0, names=[mine])
        with pytest.raises(gradbus.GradbusError, match="unknown step"):
            a.tier("jump")
        # an import of a name that is not moving here
        with pytest.raises(gradbus.GradbusError, match="not moving to this member"):
            a.ask("init", [b"\0" * 4], [{"k": f"{mine}/0", "d": "uint8", "s": [4], "n": 4,
                                          "c": "raw", "x": 0}],
                  opt={"name": "sgd", "lr": 0.1}, tensors=[],
                  imp=[{"key": f"{mine}/0", "st": {"version": 0, "arrays": []}}])
    finally:
        a.close()
    assert admin.status(urls[0])["tier"]["version"] == 2
    with gradbus.connect(urls[1], timeout=30) as c:      # the tier still serves
        c.push({n: np.ones(N, np.float32) for n in NAMES}, acks="all").result(30)


def test_a_member_restarted_after_a_move_takes_the_map_that_moved_names(tmp_path):
    """With a data directory each member keeps the map: a member restarted while the other
    member is down too starts from the map the move made, not the command line's first."""
    t = TierCluster(2, 1, data_dir=str(tmp_path)).start()
    try:
        urls = t.urls
        with gradbus.connect(urls[0], timeout=60) as c:
            c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        tier_admin.rebalance(urls[0], members=[1])
        for m in t.members:
            m.broker_procs["broker"].kill()
            m.broker_procs["broker"].wait(10)
        t.members[0].start_broker()         # the other member is still down
        st = admin.status(urls[0])
        assert st["tier"]["version"] == 2 and st["tier"]["members"][0]["partitions"] == 0
        t.members[1].start_broker()
        with gradbus.connect(urls[0], timeout=60) as c:
            assert c.tier.version == 2
            c.push({n: np.ones(N, np.float32) for n in NAMES}, acks="all").result(60)
    finally:
        problems = [p for m in t.members for p in stop_and_check(m)]
    assert not problems, problems


def test_a_broker_joins_the_tier_under_load_and_takes_its_share(tier2):
    """A third broker, started naming every member and itself last, holds nothing until
    ``gradbus tier join`` adds it; the join gives it a third of the home partitions while a
    client pushes, and the answer stays exact."""
    import subprocess
    import sys

    from gradbus.cluster import LocalCluster
    from gradbus.codecs import net
    urls = tier2.urls
    extra = LocalCluster(1, inproc=True, shard_ids=["b2-shard-0"])
    url2 = net.url(extra.host, extra.port)
    extra.broker_args = ["--tier", urls[0], "--tier", urls[1], "--tier", url2,
                         "--tier-index", "2"]
    extra.start()
    try:
        st = admin.status(url2)["tier"]
        assert st["member"] == 2 and st["version"] == 1
        assert [m["partitions"] for m in st["members"]] == [128, 128, 0]
        with gradbus.connect(urls[0], timeout=60) as c:
            c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        errors: list = []
        seen: list = []
        started = threading.Event()
        pusher = threading.Thread(target=_pusher, args=(urls[1], PUSHES, NAMES, errors,
                                                        started, seen))
        pusher.start()
        assert started.wait(60)
        r = subprocess.run([sys.executable, "-m", "gradbus", "tier", "join", url2,
                            "--broker", urls[0], "--json"],
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        done = json.loads(r.stdout)
        assert done["member"] == 2 and done["version"] >= 3
        assert "joined" in r.stderr
        pusher.join(180)
        assert not errors, errors
        tm = tier_admin.current_map(urls[0])
        assert sorted(tm.share(i) for i in range(3)) == [85, 85, 86]
        held = [_held(u) for u in (*urls, url2)]
        assert held[2] == {n for n in NAMES if tm.owner(n) == 2} and held[2]
        assert set().union(*held) == set(NAMES) and sum(map(len, held)) == len(NAMES)
        with gradbus.connect(url2, timeout=60) as c:
            got = c.pull(NAMES, min_version=PUSHES, timeout=60)
            assert len(c.members) == 3
        for n in NAMES:
            assert np.array_equal(got[n], np.full(N, -LR * PUSHES, np.float32)), n
    finally:
        problems = stop_and_check(extra)
    assert not problems, problems


def test_names_a_member_holds_that_the_map_gives_another_are_moved_home(tier2):
    """As after members' shards restored from checkpoints older than a move: the map gives
    member 1 home partitions whose names member 0's shards still hold (and member 1's do
    not). ``rebalance`` moves those names to member 1 with their state."""
    urls = tier2.urls
    with gradbus.connect(urls[0], timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in NAMES}, optimizer=gradbus.SGD(lr=LR))
        c.push({n: np.ones(N, np.float32) for n in NAMES}, acks="all").result(30)
        tm = c.tier
    stray = sorted(n for n in NAMES if tm.owner(n) == 0)
    new = tm.moved(tm.homes(0), 1)
    for u in urls:          # the map moved; the names did not
        m = tier_admin._Member(u, None, 10)
        try:
            m.tier("map", map=new.to_json())
        finally:
            m.close()
    assert _held(urls[0]) == set(stray)
    lines: list[str] = []
    done = tier_admin.rebalance(urls[0], members=[1], progress=lines.append)
    assert sorted(done["names"]) == stray and not done.get("conflicts"), lines
    assert any("moving them home" in ln for ln in lines), lines
    assert _held(urls[0]) == set() and _held(urls[1]) == set(NAMES)
    with gradbus.connect(urls[1], timeout=60) as c:
        c.push({n: np.ones(N, np.float32) for n in NAMES}, acks="all").result(30)
        got = c.pull(NAMES, min_version=2, timeout=30)
    for n in NAMES:
        assert np.array_equal(got[n], np.full(N, -2 * LR, np.float32)), n


def test_a_move_takes_adam_state_and_table_rows_to_every_replica(tmp_path):
    """Members of 2 shard processes with 2 replicas: an Adam tensor and an embedding table
    move with their optimizer state and rows; the new member's replicas hold the same bytes,
    the moved tensor steps on exactly as its twin that did not move, the rows and the table's
    version are unchanged, and a checkpoint asked afterwards covers the names where they are."""
    t = TierCluster(2, 2, replicas=2, data_dir=str(tmp_path)).start()
    try:
        urls = t.urls
        twins = _twins(urls)
        tm = TierMap.spread(urls, 256)
        table = next(f"emb{i}" for i in range(64) if tm.owner(f"emb{i}") == 0)
        ids = np.arange(0, 400, 7, dtype=np.int64)
        with gradbus.connect(urls[0], timeout=60) as c:
            c.init({n: np.zeros(N, np.float32) for n in twins}, optimizer=gradbus.Adam(lr=LR))
            c.init_table(table, 8, optimizer=gradbus.SGD(lr=0.5))
            for k in range(4):
                c.push({n: np.full(N, k + 1.0, np.float32) for n in twins}, acks="all").result(30)
                c.push_rows(table, ids, np.ones((ids.size, 8), np.float32), acks="all").result(30)
            rows = c.pull_rows(table, ids)
            tv = next(x for x in admin.status(urls[0])["tables"] if x["name"] == table)["version"]
        done = tier_admin.rebalance(urls[0], members=[1])
        assert set(done["names"]) == {twins[0], table}
        with gradbus.connect(urls[1], timeout=60) as c:
            assert np.array_equal(c.pull_rows(table, ids), rows)
            st = admin.status(urls[1])
            assert next(x for x in st["tables"] if x["name"] == table)["version"] == tv
            c.push({n: np.full(N, 5.0, np.float32) for n in twins}, acks="all").result(30)
            c.push_rows(table, ids, np.ones((ids.size, 8), np.float32), acks="all").result(30)
            w = c.pull(list(twins), min_version=5, timeout=30)
            assert np.array_equal(w[twins[0]], w[twins[1]])      # Adam's m, v and t came too
            assert np.allclose(c.pull_rows(table, ids), rows - 0.5)
        # every partition of member 1 has 2 copies, equal at equal seqs
        dg = admin.digest(urls[1])
        by_p: dict = {}
        for parts in dg.values():
            for p, (seq, d) in parts.items():
                by_p.setdefault(p, []).append((seq, d))
        assert by_p and all(len(v) == 2 and v[0] == v[1] for v in by_p.values()), by_p
        replies = admin.checkpoint(urls[0])
        assert {r["shard"] for r in replies} == {f"b{i}-shard-{j}" for i in (0, 1)
                                                 for j in (0, 1)}
    finally:
        problems = [p for m in t.members for p in stop_and_check(m)]
    assert not problems, problems


def test_flush_covers_pushes_sent_on_after_a_move_whose_futures_nobody_reads(tier2):
    """A worker that never reads its push Futures (acks=1) and flushes at the end, as the
    demo does: pushes refused MOVED are sent on to the new member before ``flush`` returns,
    so every push is applied once ``flush`` returned, and none is lost at ``close``."""
    urls = tier2.urls
    tm = TierMap.spread(urls, 256)
    names = [n for n in (f"d{i}" for i in range(64)) if tm.owner(n) == 1][:4]
    with gradbus.connect(urls[0], timeout=60) as c:
        c.init({n: np.zeros(N, np.float32) for n in names}, optimizer=gradbus.SGD(lr=LR))
    flushed: list = []
    errors: list = []
    started, moved = threading.Event(), threading.Event()

    def work():
        try:
            with gradbus.connect(urls[0], timeout=60, shm=False) as w:   # MOVED more often
                g = {n: np.ones(N, np.float32) for n in names}
                k = after = 0
                while after < 50:          # pushes before, across and after the move
                    w.push(g)
                    k += 1
                    after += moved.is_set()
                    if k == 20:
                        started.set()
                w.flush(60)
                flushed.append((k, w.stats_moved, w.stats["recovering_retries"]))
        except BaseException as e:
            errors.append(e)
            started.set()
    th = threading.Thread(target=work)
    th.start()
    assert started.wait(60)
    tier_admin.rebalance(urls[0], members=[0])
    moved.set()
    th.join(180)
    assert not errors, errors
    (pushes, sent_on, retried), = flushed
    assert sent_on + retried >= 1, flushed      # the pushes crossed the move
    st = admin.status(urls[0])      # read once flush returned: nothing still travelling
    assert {t["name"]: t["version"] for t in st["tensors"]} == dict.fromkeys(names, pushes)
