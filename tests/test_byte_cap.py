"""The byte cap at the frontend (in memory): a push or init the cap has no room for is answered
BUSY at once and nothing of it is kept; ops requests and resends of held ids still reach the
core; the SDK sends a BUSY push again after its own back-off, never fails it."""
from __future__ import annotations

import numpy as np

from gradbus.broker.flow import ByteCap
from gradbus.codecs import wire
from gradbus.codecs.errors import Code
from gradbus.workers.resend import BUSY_MAX, BUSY_RETRY, ResendTimer

from .rigs import Rig, init_msg, push_msg, unpack
from .rigs import agent_feed as feed
from .rigs import agent_push as push
from .rigs import agent_resent as resent
from .rigs import make_agent_state as make_state


def _rig(cap: int):
    rig = Rig(("s0",), shard_credit=1, max_pending_bytes=cap)
    admit = ByteCap(rig.broker, rig.broker.on_frontend)

    def send(ident, frames):
        rig.deliver(admit(ident, frames, rig.now))
        rig.deliver(rig.broker.flush(rig.now))
    return rig, send


def test_pushes_past_the_cap_are_refused_busy_and_nothing_is_kept():
    rig, send = _rig(cap=600)                     # room for two 256 B pushes, not three
    frames, layout = init_msg(1, "w", np.zeros(64, np.float32))
    send(b"c", frames)
    assert rig.replies(b"c")[0]["kind"] == "init_ok"
    rig.hold = True                               # the shard stops applying
    g = np.ones(64, np.float32)
    for m in (2, 3, 4, 5):
        send(b"c", push_msg(m, layout, g))
    sq = rig.broker.sequencer
    assert sq.held_bytes == 512 and sq.inflight_bytes == 256 and sq.pending_bytes == 256
    busy = rig.replies(b"c")
    assert [(r["kind"], r["code"], r["msg"]) for r in busy] == [
        ("error", Code.BUSY.value, 4), ("error", Code.BUSY.value, 5)]
    assert rig.broker.counters["busy"] == 2
    client = rig.broker.clients[b"c"]
    assert 4 not in client.seen and 5 not in client.seen          # not remembered
    send(b"c", push_msg(3, layout, g))            # a resend of a held id: the core drops it
    assert rig.replies(b"c") == [] and rig.broker.counters["duplicates"] == 1
    assert sq.held_bytes == 512
    send(b"ops", [wire.pack(wire.STATUS, req=7)])  # ops requests are answered at the cap
    st = rig.replies(b"ops")
    assert st[0]["kind"] == "status_reply" and st[0]["status"]["pending_bytes"] == 256
    rig.broker.validate_state()
    rig.hold = False                              # the shard applies what was held
    for a in rig.held:
        rig.to_shard(a.identity.decode(), a.frames)
    rig.held.clear()
    rig.deliver(rig.broker.flush(rig.now))
    assert sorted(r["msg"] for r in rig.replies(b"c")) == [2, 3]
    assert sq.held_bytes == 0
    for m in (4, 5):                              # sent again: accepted now
        send(b"c", push_msg(m, layout, g))
    assert sorted(r["msg"] for r in rig.replies(b"c")) == [4, 5]
    values = rig.shards["s0"].store.blocks
    w = np.concatenate([values[k].value for k in layout.block_keys()])
    assert np.array_equal(w, np.full(64, -4 * 0.5, np.float32))      # each applied once
    rig.broker.validate_state()


def test_one_push_above_the_cap_goes_alone():
    rig, send = _rig(cap=100)
    frames, layout = init_msg(1, "w", np.zeros(64, np.float32))   # 256 B > cap, nothing held
    send(b"c", frames)
    assert rig.replies(b"c")[0]["kind"] == "init_ok"
    rig.hold = True
    send(b"c", push_msg(2, layout, np.ones(64, np.float32)))
    send(b"c", push_msg(3, layout, np.ones(64, np.float32)))
    assert [(r["kind"], r.get("code")) for r in rig.replies(b"c")] == [("error", "BUSY")]


def test_busy_is_retried_after_a_growing_backoff_and_never_fails_the_future():
    state, clock = make_state(resend=ResendTimer(5.0, 60.0))
    frames, fut = push(state, 9)
    delays = []
    for _ in range(8):
        t0 = clock.t
        feed(state, wire.pack(wire.ERROR, msg=9, code=Code.BUSY.value, message="full"))
        assert not fut.done() and 9 in state.credit.held         # credit still held
        at = state.resend.next_at()
        delays.append(at - t0)
        clock.t = at - 1e-6
        state.tick()
        assert resent(state.take(), frames) == 0
        clock.t = at
        state.tick()
        assert resent(state.take(), frames) == 1
        state.validate_state()
    assert delays[0] >= BUSY_RETRY and all(b > a for a, b in zip(delays[:6], delays[1:6]))
    assert max(delays) <= 1.5 * BUSY_MAX
    assert state.resend.delay == 5.0 and state.stats["busy_retries"] == 8
    feed(state, wire.pack(wire.ACK, msg=9))
    assert fut.result(0)["kind"] == "ack" and not state.credit.held
    assert not state.resend.busy and not state.resend.soon
    state.validate_state()
    assert unpack(frames[0])["msg"] == 9
