"""The broker core's components, driven without sockets: the partition table's accounting,
typed actions, settlement and the one ACK per client, the update log's write policy on the
injected clock, a returning shard rebuilt from a log handed over as an event, a lost
partition revived, the acknowledged marks, and the refusals of a live shard's id."""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest

from gradbus.broker import core as bcore
from gradbus.broker import log as ulog
from gradbus.broker import settings
from gradbus.broker.acked import AckMarks
from gradbus.broker.actions import (
    AckClient,
    Acked,
    Adopt,
    AppendLog,
    Publish,
    ReadLog,
    SyncLog,
    ToClient,
    ToShard,
)
from gradbus.broker.admission import MAX_LOGGED, Admission
from gradbus.broker.core import BrokerCore
from gradbus.broker.membership import Membership, ShardInfo
from gradbus.broker.partition_table import PartitionTable
from gradbus.broker.recovery import LogPolicy
from gradbus.broker.ring_refs import RingRefs
from gradbus.codecs import wire
from gradbus.codecs.errors import WireError
from gradbus.codecs.partition import partition_of
from gradbus.shards.core import ShardCore

from .rigs import Rig, encode_blocks, init_msg, push_msg, unpack


def _table(ids=("a", "b", "c"), replicas=1):
    shards = {sid: ShardInfo(sid, sid.encode(), 0.0) for sid in ids}
    return PartitionTable(8, replicas, shards), shards


def test_the_partition_table_keeps_bytes_equal_to_what_each_shard_holds():
    tb, sh = _table(replicas=2)
    assert tb.place(0) == "a" and tb.standbys[0] == ["b"]
    tb.account(0, 100)
    assert (sh["a"].bytes, sh["b"].bytes, sh["c"].bytes) == (100, 100, 0)
    tb.start_catch_up(0, sh["c"], 1.0)           # a move b -> c: counted at c from now on
    tb.start_leaving(0, "b")
    assert (sh["b"].bytes, sh["c"].bytes) == (0, 100)
    tb.account(0, 10)                             # grows while moving: not on the leaving copy
    assert (sh["a"].bytes, sh["b"].bytes, sh["c"].bytes) == (110, 0, 110)
    assert tb.validate_state() == []
    assert tb.synced(0, "c") == 1.0
    assert tb.finish_move(0, "b", "c")
    assert tb.standbys[0] == ["c"] and 0 not in sh["b"].partitions and not tb.leaving
    assert tb.validate_state() == []
    sh["c"].bytes += 1                            # a hand edit is caught
    assert any("counts 111 bytes, holds 110" in x for x in tb.validate_state())


def test_a_cancelled_move_gives_the_source_its_bytes_back():
    tb, sh = _table()
    tb.place(3)
    tb.account(3, 64)
    tb.start_catch_up(3, sh["b"], 0.0)
    tb.start_leaving(3, "a")
    assert (sh["a"].bytes, sh["b"].bytes) == (0, 64)
    assert tb.cancel_catch_up(3, "b")
    tb.stop_leaving(3)
    assert (sh["a"].bytes, sh["b"].bytes) == (64, 0) and tb.validate_state() == []


def test_failover_promotes_the_standby_and_the_dead_primary_lets_go():
    tb, sh = _table(replicas=2)
    tb.place(1)
    tb.account(1, 8)
    sh["a"].alive = False
    assert tb.fail_over(1, sh["a"]) == "b"
    assert tb.owners[1] == "b" and tb.epochs[1] == 2 and tb.standbys[1] == []
    assert sh["a"].bytes == 0 and 1 not in sh["a"].partitions
    assert tb.validate_state() == []


def test_a_lost_partition_revived_elsewhere_moves_its_bytes_and_takes_the_next_epoch():
    tb, sh = _table()
    tb.place(2)
    tb.account(2, 64)
    tb.lost.add(2)
    with pytest.raises(WireError, match="k: partition 2 is lost"):
        tb.live_owner("k", 2)
    tb.revive(sh["b"], 2, epoch=1, nbytes=80)
    assert tb.owners[2] == "b" and tb.epochs[2] == 2 and not tb.lost
    assert (sh["a"].bytes, sh["b"].bytes) == (0, 80) and 2 not in sh["a"].partitions
    tb.lost.add(2)
    tb.revive(sh["b"], 2, epoch=3)              # its own copy back, sent in a later epoch
    assert tb.epochs[2] == 3 and sh["b"].bytes == 80 and tb.validate_state() == []


def test_the_acknowledged_marks_say_which_copy_brings_a_partition_back():
    am = AckMarks(4)
    am.note(1, 1, 5)
    am.note(1, 2, 3)                            # a later epoch, an older seq: both kept
    assert am.need(1) == (2, 5) and am.covers(1, (2, 5)) and am.covers(1, (3, 9))
    assert not am.covers(1, (2, 4)) and not am.covers(1, (1, 9))
    assert "seq >= 5 (epoch >= 2)" in am.lost_message(1)
    assert am.need(0) == (0, 0) and am.covers(0, (0, 0)) and am.validate_state() == []


def test_admission_refuses_a_takeover_of_a_live_id_and_logs_a_bounded_number():
    errors = defaultdict(int)
    ad = Admission(errors)
    live = ShardInfo("s", b"s", 0.0, token=b"L" * 16)
    assert ad.claim(None, b"x", None, None, 0.1, 0.5) is None        # a new id
    assert ad.claim(live, b"s", None, None, 0.1, 0.5) is None        # its own connection
    assert "in use" in ad.claim(live, b"x", None, None, 0.5, 0.5)
    assert "in use" in ad.claim(live, b"x", None, b"M" * 16, 0.5, 0.5)   # another process
    assert ad.claim(live, b"x", None, b"L" * 16, 0.5, 0.5) is None   # its own: a reconnect
    assert ad.claim(live, b"x", None, None, 0.51, 0.5) is None       # silent past the deadline
    live.key = "K"
    assert "another CURVE key" in ad.claim(live, b"x", "J", b"L" * 16, 0.51, 0.5)
    assert ad.claim(live, b"x", "K", b"L" * 16, 0.1, 0.5) is None
    live.key = None
    for i in range(MAX_LOGGED + 10):
        assert "in use by a live shard" in ad.register_refusal(live, b"x%d" % i, None, None,
                                                               0.1, 0.5)
    assert errors["SHARD_ID_IN_USE"] == MAX_LOGGED + 10
    assert len(ad._logged) == MAX_LOGGED and ad.validate_state() == []
    assert "operator role" in ad.role_refusal(frozenset({"client"}), False, wire.ADMIN)
    assert ad.role_refusal(None, True, wire.REGISTER) is None and errors["FORBIDDEN"] == 1


def test_liveness_is_judged_on_the_injected_clock():
    m = Membership(settings.Settings(heartbeat_interval=0.25, liveness=4, client_liveness=8))
    s = m.new_shard("s", b"s", now=10.0)
    assert m.silent_shards(11.0) == []
    assert m.silent_shards(11.01) == [s]
    m.client(b"c", 10.0)
    m.expire_clients(12.01, busy=lambda ident: True)      # something pending: kept
    assert b"c" in m.clients
    m.expire_clients(11.99, busy=lambda ident: False)
    assert b"c" in m.clients
    m.expire_clients(12.01, busy=lambda ident: False)
    assert b"c" not in m.clients


def test_actions_are_frozen_and_settings_too():
    a = ToShard(b"s", [b"x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.identity = b"t"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.Settings().shard_credit = 3
    assert not hasattr(a, "__dict__")                      # slots
    assert isinstance(Adopt(b"s", [b"x"], 3), ToShard)
    assert isinstance(AckClient(b"c", [b"x"], (1,)), ToClient)
    assert bcore.SHARD_CREDIT == settings.SHARD_CREDIT == BrokerCore(4).settings.shard_credit
    assert BrokerCore(4, shard_credit=5, max_sync_bytes=7).settings.max_sync_bytes == 7
    with pytest.raises(TypeError):
        BrokerCore(4, no_such_setting=1)


def test_settled_pushes_become_one_ack_per_client_and_no_pseudo_action_escapes():
    rig = Rig(("s0",), shard_credit=1)
    frames, layout = init_msg(1, "w", np.zeros(4, np.float32))
    rig.client(b"c", frames)
    rig.client(b"d", [wire.pack(wire.CATALOG, req=1)])
    rig.replies(b"c")
    rig.hold = True
    rig.client(b"c", push_msg(2, layout, np.ones(4, np.float32)))     # uses the only credit
    rig.client(b"c", push_msg(3, layout, np.ones(4, np.float32)))
    rig.client(b"d", push_msg(1, layout, np.ones(4, np.float32)))
    rig.hold = False
    first = rig.held.pop()
    out = []
    for f in rig.shards["s0"].handle([bytes(x) for x in first.frames]):
        out += rig.broker.on_backend(b"s0", [bytes(x) for x in f], 0.0)
    out += rig.broker.flush(0.0)                 # msgs 3 (c) and 1 (d) in one batch
    batch = [a for a in out if isinstance(a, ToShard)]
    assert len(batch) == 1
    for f in rig.shards["s0"].handle([bytes(x) for x in batch[0].frames]):
        out += rig.broker.on_backend(b"s0", [bytes(x) for x in f], 0.0)
    acks = [a for a in out if isinstance(a, AckClient)]
    assert sorted((a.identity, a.msgs) for a in acks) == [(b"c", (2,)), (b"c", (3,)),
                                                           (b"d", (1,))]
    assert not [a for a in out if isinstance(a, Acked)]
    assert all(isinstance(a, (ToClient, ToShard, Publish)) for a in out)
    rig.broker.validate_state()


def test_slots_freed_with_an_ack_ride_in_it_and_acks_go_first():
    """One step's freed ring slots go in the ACK to their client (``free``); a client with
    slots freed and nothing acknowledged gets a FREE; the ACKs come before the step's other
    actions."""
    core = BrokerCore(16)
    core.sequencer.freed += [(b"c", 2), (b"c", 3), (b"d", 7)]
    pub = Publish([wire.topic_partition(0), wire.pack(wire.UPDATE, p=0, seq=1, epoch=1)])
    out = core._coalesce([pub, Acked(b"c", 2, 5), Acked(b"c", 3, 6)])
    assert isinstance(out[0], AckClient) and out[0].identity == b"c"
    ack = unpack(out[0].frames[0])
    assert (ack["msgs"], ack["vers"], ack["free"]) == ([2, 3], [5, 6], [2, 3])
    assert out[1] is pub
    free = [unpack(a.frames[0]) for a in out[2:] if isinstance(a, ToClient)]
    assert [(a.identity, f["kind"], f["msgs"]) for a, f in zip(out[2:], free)] == [
        (b"d", wire.FREE, [7])]
    assert not core.sequencer.freed and core.counters["shm_freed"] == 3


def test_rebalance_counts_the_moves_it_started_by_their_adopt_actions():
    rig = Rig(("s0",), auto_rebalance=False)
    frames, layout = init_msg(1, "w", np.zeros(64, np.float32))
    rig.client(b"c", frames)
    rig.shards["s1"] = ShardCore("s1")
    rig.deliver(rig.broker.on_backend(b"s1", [wire.pack(wire.REGISTER, shard="s1")], 0.0))
    out = rig.broker.on_frontend(b"ops", [wire.pack(wire.ADMIN, req=7, op="rebalance")], 0.0)
    adopts = [a for a in out if isinstance(a, Adopt)]
    reply = unpack([a for a in out if isinstance(a, ToClient)][0].frames[0])
    assert adopts and reply["result"]["moves_started"] == len(adopts) == len(rig.broker.moves)
    assert {a.p for a in adopts} == set(rig.broker.moves)
    rig.deliver(out)
    rig.broker.validate_state()


def test_the_log_policy_times_fsyncs_on_the_injected_clock():
    def kinds(pol, now):
        acts = []
        pol.append(acts, [], [], [], 0.0, now)
        return [type(a) for a in acts]
    assert kinds(LogPolicy("always", 0.0), 0.0) == [AppendLog, SyncLog]
    assert kinds(LogPolicy("never", 0.0), 100.0) == [AppendLog]
    pol = LogPolicy("interval", 0.0)
    assert kinds(pol, 0.5) == [AppendLog]
    acts = []
    pol.tick(acts, 0.9)
    assert acts == []
    pol.tick(acts, 1.0)
    assert acts == [SyncLog()]
    pol.tick(acts, 5.0)                           # nothing written since: nothing to sync
    assert acts == [SyncLog()]


def test_batches_are_logged_before_they_go_out_and_the_core_does_no_log_io(tmp_path):
    rig = Rig(("s0",), log_fsync="always")
    out = rig.broker.on_frontend(b"c", init_msg(1, "w", np.zeros(4, np.float32))[0], 0.0)
    out += rig.broker.flush(0.0)
    kinds = [type(a) for a in out]
    assert kinds.index(AppendLog) < kinds.index(SyncLog) < kinds.index(ToShard)
    lg = ulog.UpdateLog(str(tmp_path), "always")
    for a in out:
        if isinstance(a, AppendLog):
            lg.append(a.parts, a.t_list, a.frames, a.time)
    lg.close()
    assert [h["seq"] for h, _ in ulog.LogIndex(str(tmp_path)).after(partition_of("w/0", 16), 0)
            ] == [1]


def test_a_returning_sole_owner_is_rebuilt_from_the_log_handed_over_with_its_register(
        tmp_path):
    """The core asks for its log (ReadLog) instead of reading it (not for a REGISTER that would
    take over the live shard's id from another connection); fed the index, it replays what the
    shard lost."""
    rig = Rig(("s0",), log_fsync="never")
    lg = ulog.UpdateLog(str(tmp_path), "never")
    b = rig.broker

    def deliver_logging(actions):
        for a in actions:
            if isinstance(a, AppendLog):
                lg.append(a.parts, a.t_list, a.frames, a.time)
        rig.deliver(actions)

    frames, layout = init_msg(1, "w", np.arange(4, dtype=np.float32))
    deliver_logging(b.on_frontend(b"c", frames, 0.0))
    deliver_logging(b.flush(0.0))
    for m in (2, 3):
        deliver_logging(b.on_frontend(b"c", push_msg(m, layout, np.ones(4, np.float32)), 0.0))
        deliver_logging(b.flush(0.0))
    rig.shards["s0"] = ShardCore("s0")                    # restarted with nothing
    reg = [wire.pack(wire.REGISTER, shard="s0", **rig.shards["s0"].register_fields())]
    out = b.on_backend(b"x", reg, 0.0)    # its id from another connection: refused, no log read
    assert [type(a) for a in out] == [ToShard] and unpack(out[0].frames[0])["code"] == \
        "SHARD_ID_IN_USE"
    out = b.on_backend(b"s0", reg, 0.0)
    assert out == [ReadLog(b"s0", reg)]                   # asks; reads nothing itself
    lg.close()
    rig.deliver(b.on_backend(b"s0", reg, 0.0, log_index=ulog.LogIndex(str(tmp_path))))
    assert b.recovery.replaying and not b.table.lost
    for _ in range(3):                # one logged batch per message, paced by credit
        rig.deliver(b.flush(0.0))
    assert not b.recovery.replaying and b.counters["replayed"] == 3
    assert np.array_equal(rig.shards["s0"].store.blocks["w/0"].value,
                          np.arange(4, dtype=np.float32) - 2 * 0.5)
    b.validate_state()


def test_validate_state_runs_every_component():
    b = BrokerCore(4)
    b.on_backend(b"s", [wire.pack(wire.REGISTER, shard="s")], 0.0)
    b.validate_state()
    b.sequencer.pending_bytes = -1
    b.shards["s"].bytes = 5
    b.settlement.pending[(b"c", 1)] = bcore.Pending(b"c", 1, "push", 0)
    with pytest.raises(RuntimeError) as e:
        b.validate_state()
    assert "pending_bytes -1 < 0" in str(e.value)
    assert "shard s counts 5 bytes, holds 0" in str(e.value)
    assert "settled but still pending" in str(e.value)


def test_ring_refs_count_per_push_and_per_segment():
    r = RingRefs()
    a, b = (b"c", 1), (b"c", 2)
    r.hold(a, "s1")
    r.hold(a, "s2")
    r.hold(b, "s1")
    r.release([(a, "s1")])
    assert r.referenced("s1") and r.referenced("s2") and r.freed == []
    r.release([(a, "s2")])
    assert r.freed == [a] and not r.referenced("s2") and r.referenced("s1")
    assert r.validate_state([(b, "s1")]) == []
    assert r.validate_state([]) != []
    r.release([(b, "s1")])
    assert r.freed == [a, b] and not r.segs and not r.live and r.validate_state([]) == []


def test_a_push_naming_a_swept_ring_segment_is_refused_before_any_replica_reads_it():
    """A dead client's last push, read after the sweep removed its ring: refused BAD_FIELD
    (and its slots freed), never sequenced, so no replica applies it from a mapping it still
    had while another cannot open the segment."""
    rig = Rig(("s0",))
    frames, layout = init_msg(1, "w", np.zeros(8, np.float32))
    rig.client(b"c", frames)
    rig.replies(b"c")
    gone = "gradbus-0badc0de-w4242-1-0-abcd"
    rig.broker.sequencer.rings.removed([gone])
    descs, bufs = encode_blocks(layout, np.ones(8, np.float32))
    for d in descs:
        d["r"] = [gone, 64]
    rig.client(b"c", [wire.pack(wire.PUSH, descs, msg=2, acks=1), *[b""] * len(bufs)])
    replies = rig.replies(b"c")
    assert [(h["kind"], h.get("code")) for h in replies] == [("error", "BAD_FIELD"),
                                                             ("free", None)]
    assert "is gone" in replies[0]["message"] and replies[1]["msgs"] == [2]
    assert rig.broker.counters["pushes_received"] == 0 and not rig.broker.pending_entries


def test_the_run_id_is_named_in_welcome_table_and_every_events_heartbeat():
    a, b = BrokerCore(8), BrokerCore(8)
    assert a.run != b.run and 0 <= a.run < 1 << 63          # one per broker process
    welcome = unpack(a.on_frontend(b"c", [wire.pack(wire.HELLO, role="client")], 0.0)[0]
                     .frames[0])
    assert welcome["run"] == a.run
    assert unpack(a.table.message()[1])["run"] == a.run
    hb = [x for x in a.on_tick(10.0) if isinstance(x, Publish)]
    assert [unpack(x.frames[1])["run"] for x in hb] == [a.run]
    assert unpack(a.events_heartbeat().frames[1])["run"] == a.run
