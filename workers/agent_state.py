"""What the agent thread knows and decides, without a socket: :class:`AgentState`.

It is fed the user's commands (:mod:`.commands`), the broker's replies and events (as frames),
and the passing of time (:meth:`AgentState.tick`), and answers with typed actions
(:mod:`.actions`), ``Send`` (frames to the broker) and ``Subscribe`` (a topic on the events
socket), which the agent loop (:mod:`.agent`) carries out. Futures are resolved and the weight
cache is fed here, under the condition the client's readers wait on. Time is read only from
the injected ``clock``. The snapshots and table reads in flight are its part
:class:`~.reads_state.ReadState` (``reads``).

A client that reads shared memory says so in its first heartbeat (sent at once) and its
snapshots; a shard's reply may then reference the shard's reply area. Such a reply is copied
out (:meth:`ReadState.resolved`); one rewritten before it was read whole, or a broker's
``SHM_TORN`` answer, is asked again under a new id, with frames (``shm: false``), for the same
waiter (:meth:`ReadState.reask`): a reader never sees bytes other than the reply's.

A client that reads weights as frames (no shared memory: another host, or shared memory off)
follows its partitions by conflated delivery (protocol section 22) over its DEALER, not the
events socket: the broker sends each partition the UPDATE that applied the client's own push,
and the newest one when the client's application read it (a CREDIT); the versions nobody read
are skipped. What is followed, and the credits, are its part :class:`~.follow_state.FollowState`
(``follows``).

Broker silence is judged with the broker's own heartbeat interval, as WELCOME names it (``hb``;
the default interval for a broker that does not say): silent after ``LIVENESS`` intervals
without a heartbeat or reply, and never sooner than with the default interval (a broker
beating faster than the default is not held to a tighter window than before).

A broker that restarted says so: its events heartbeats carry another run id than the one
WELCOME (or the heartbeats before) named. What the old broker held is lost with it, so the
client sends again at once every push and init not settled (the resend timer would wait
seconds), every request not answered, and every read in flight (asked again under a new id, its
parts so far dropped). Pushes the new broker refuses with RECOVERING (its shards not all back
yet) are sent again at each partition-table change, a shard registering, rather than after a
fixed pause (:mod:`.resend`).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future

from gradbus.codecs import hops, messages, timing, wire
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.errors import Code, WireError, error_from

from .actions import AskTable, Reconnect, Send
from .cache import LiveBlock
from .commands import (
    CheckTable,
    Forward,
    Read,
    ReadRows,
    Refresh,
    Request,
    SendMessage,
    Stop,
    Track,
    Watch,
)
from .follow_state import FollowState
from .moved import moved_push
from .reads_state import ReadState
from .resend import ResendTimer

log = logging.getLogger("gradbus.client")

_TABLE, _HEARTBEAT, _UPDATE = (frozenset({k}) for k in (wire.TABLE, wire.HEARTBEAT, wire.UPDATE))


def broker_interval(welcome: dict) -> float:
    """The seconds between the broker's heartbeats, as its WELCOME names them (``hb``), else
    the default interval (a broker from before the field)."""
    hb = welcome.get("hb")
    if isinstance(hb, (int, float)) and not isinstance(hb, bool) and math.isfinite(hb) and hb > 0:
        return float(hb)
    return timing.HEARTBEAT_INTERVAL


class AgentState:
    def __init__(self, welcome: dict, *, cache, cond: threading.Condition, credit, versions,
                 stats, next_id, max_tensor_bytes: int, resend: ResendTimer | None,
                 clock=time.monotonic, shm=None, brokers: int = 1):
        self.cache, self.cond, self.credit, self.versions = cache, cond, credit, versions
        self.stats, self.next_id, self.max_tensor_bytes = stats, next_id, max_tensor_bytes
        self.resend = resend
        self.clock = clock
        self.hb_interval = broker_interval(welcome)
        self.broker_run = messages.run_id(welcome.get("run"))   # None: a broker that does not say
        self.silence_after = max(self.hb_interval, timing.HEARTBEAT_INTERVAL) * timing.LIVENESS
        self.hb_every = timing.HEARTBEAT_INTERVAL   # the client's own heartbeats
        self.poll_ms = int(self.hb_every * 1000 / 2)
        now = clock()
        self.last_heard = self.last_hb = now
        self.broker_silent = False
        self.stopped = False
        # a broker pair (protocol section 23): the brokers known, and whether this client is
        # on its way to the other one
        self.brokers = brokers
        self.leaving: str | None = None
        self.async_errors: list = []                # errors of pushes nobody waits on
        self.msg_futures: dict[int, Future] = {}    # msg -> Future of a push or init
        self.req_futures: dict[int, Future] = {}    # req -> Future of a request
        self.req_frames: dict[int, list] = {}       # req -> a plain request's frames (resent
                                                    # to a restarted broker)
        self.reads = ReadState(self)                # snapshots and table reads in flight
        self.free_later: set[int] = set()           # pushes FREEd before their final answer
        self.out: list = []
        self.shm = shm                              # a ClientShm, or None: frames only
        self.follows = FollowState(self)            # updates followed, conflated credits
        self.conflated = self.follows.conflated
        self._hb = wire.pack(wire.HEARTBEAT, **({"shm": True} if shm is not None else {}))
        if shm is not None:     # the broker learns at once that replies may reference shards'
            self.last_hb = now - self.hb_every      # shared memory (the first tick says so)

    def take(self) -> list:
        """The actions decided since the last call, in order."""
        out, self.out = self.out, []
        return out

    # -- commands ------------------------------------------------------------------------------
    def command(self, cmd) -> None:
        t = type(cmd)
        if t is SendMessage:
            if hops.ON and not cmd.sent:
                hops.stamp("agent_send", cmd.msg)
            if cmd.future is not None:
                self.msg_futures[cmd.msg] = cmd.future
            self.follows.pushed_to(cmd.parts)
            if self.resend is not None:
                self.resend.sent(cmd.msg, cmd.frames, self.clock())
            if not cmd.sent:
                self.out.append(Send(cmd.frames))
        elif t is Forward:
            self.out.append(Send(cmd.frames))
        elif t is Request:
            self.req_futures[cmd.req] = cmd.future
            self.req_frames[cmd.req] = cmd.frames
            self.out.append(Send(cmd.frames))
        elif t is ReadRows:
            self.req_futures[cmd.req] = cmd.future
            self.reads.rows(cmd.req, cmd.frames)
            self.out.append(Send(cmd.frames))
        elif t is Track:
            keys, new = [], []
            for layout in cmd.layouts:
                new_parts, ks = self.cache.track(layout)
                new += new_parts
                keys += ks
            self.follows.track(new)
            if keys:
                self._snapshot(keys, cmd.future)
            else:
                cmd.future.set_result(None)
        elif t is Refresh:
            with self.cond:
                parts = self.cache.resync(cmd.keys)
            for p in parts:
                self._resnapshot(p)
        elif t is CheckTable:
            self.stats["table_asks"] += 1
            self.out.append(AskTable())
        elif t is Watch:
            self.follows.watch(cmd.parts, cmd.on)
            if cmd.on:      # a change that came before the subscription took hold is seen
                with self.cond:
                    self.cond.notify_all()
        elif t is Read:
            self.follows.read(cmd.parts, cmd.seqs, cmd.waiting)
        elif t is Stop:
            self.stopped = True
        else:
            raise TypeError(f"not a command: {cmd!r}")

    # -- a broker pair -----------------------------------------------------------------------
    def leave(self, why: str) -> None:
        """Of a broker pair: go to the other broker (once, until :meth:`arrived`)."""
        if self.brokers > 1 and self.leaving is None and not self.stopped:
            self.leaving = why
            self.out.append(Reconnect(why))

    def arrived(self, welcome: dict) -> None:
        """The agent reached a broker (the other one, or the same again) and its sockets are
        open: one that is another process than the last gets everything unanswered again."""
        self.leaving = None
        self.stats["broker_switches"] += 1
        self.heard()
        with self.cond:
            self.broker_silent = False
            self.cond.notify_all()
        self._run(messages.run_id(welcome.get("run")))

    def stay(self) -> None:
        """No broker answered: try again at the next tick that finds this one silent."""
        self.leaving = None

    def link_lost(self) -> None:
        """The local link to the broker closed: what it may have carried unanswered goes
        again, now, on the DEALER (the broker's duplicate window applies each once)."""
        if self.resend is not None:
            for frames in self.resend.all_now(self.clock()):
                self.stats["link_resends"] += 1
                self.out.append(Send(frames))

    def fail_all(self, err: BaseException, queued=()) -> None:
        """The agent stops: every queued command's Future and every Future waiting on the
        broker fail with ``err``."""
        futs = [cmd.future for cmd in queued]
        futs += self.msg_futures.values()
        futs += self.req_futures.values()
        for f in futs:
            if f is not None and not f.done():
                f.set_exception(err)
        for waiting in (self.msg_futures, self.req_futures, self.req_frames):
            waiting.clear()
        self.reads.clear()
        with self.cond:
            self.cond.notify_all()

    # -- time ----------------------------------------------------------------------------------
    def heard(self) -> None:
        """Something came from the broker."""
        self.last_heard = self.clock()

    def tick(self) -> None:
        """What is due now: broker silence, re-snapshots, resends, our heartbeat."""
        now = self.clock()
        silent = now - self.last_heard > self.silence_after
        if silent != self.broker_silent:
            with self.cond:
                self.broker_silent = silent
                self.cond.notify_all()
            if silent:
                self.stats["broker_silences"] += 1
        if silent:
            self.leave(f"the broker was silent for {now - self.last_heard:.1f}s")
        self.reads.due(now)
        if self.resend is not None and self.resend.unsettled:
            for frames in self.resend.due(now):
                self.stats["resends"] += 1
                self.out.append(Send(frames))
        if now - self.last_hb >= self.hb_every:
            self.out.append(Send([self._hb]))
            self.last_hb = now

    # -- replies on the DEALER -------------------------------------------------------------------
    def reply(self, frames) -> None:
        """One message from the broker's frontend (a malformed one is counted and dropped)."""
        self._guarded(self._reply, frames)

    def _guarded(self, handler, frames) -> None:
        """Messages are typed (every field checked) when unpacked: a malformed one is a
        WireError, counted and dropped, never fatal."""
        try:
            handler(frames)
        except WireError as e:
            self.stats["bad_messages"] += 1
            log.warning("bad message from broker: %s", e)

    def _reply(self, frames) -> None:
        m = messages.unpack(frames[0], wire.CLIENT_KINDS)
        kind = m.kind
        if kind == wire.ERROR and m.code == Code.NOT_ACTIVE.value:
            # a standby: whatever it refused goes to the other broker, answered there
            self.stats["not_active"] += 1
            self.leave("the broker is the standby of its pair")
            return
        if kind in (wire.ACK, wire.INIT_OK) or (kind == wire.ERROR and m.msg is not None):
            if kind == wire.ACK and m.free and self.shm is not None:
                # the slots first: a push waiting for this ACK's credit finds room in the ring
                self.stats["shm_freed"] += self.shm.free(m.free)
            self._settle(m)
        elif kind == wire.FREE:
            self.stats["free_messages"] += 1
            if self.shm is not None:
                self._free(m.msgs)
        elif kind == wire.SNAPSHOT_REPLY:
            self.reads.on_snapshot(m, frames[1:])
        elif kind == wire.ROWS_REPLY:
            self.reads.on_rows(m, frames[1:])
        elif kind == wire.UPDATE:         # conflated delivery
            self._on_update(m, frames[1:])
        elif kind in (wire.CATALOG_REPLY, wire.STATUS_REPLY) or (kind == wire.ERROR
                                                                 and m.req is not None):
            self._answer(kind, m)
        elif kind == wire.ERROR:
            self.stats["errors"] += 1
            log.warning("broker error: %s %s", m.code, m.message)

    def _free(self, msgs) -> None:
        """A FREE: the broker needs these pushes' ring slots no more. A push this client may
        still send again (no final answer yet: refused RECOVERING, or its answer lost with a
        broker that died) keeps them until it has one: a resend names the same slots, which
        must still hold its bytes."""
        resend = self.resend
        now = [m for m in msgs if resend is None or m not in resend]
        if len(now) < len(msgs):
            self.free_later.update(m for m in msgs if resend is not None and m in resend)
        self.stats["shm_freed"] += self.shm.free(now)

    def _answer(self, kind: str, h) -> None:
        req = h.req
        self.req_frames.pop(req, None)
        if self.reads.answered(kind, h):
            return
        fut = self.req_futures.pop(req, None)
        if fut is not None and not fut.done():
            if kind == wire.ERROR:
                fut.set_exception(error_from(h.code, h.message))
            else:
                fut.set_result(h.header)

    def _settle(self, h) -> None:
        """Settle what an ACK (one push, or ``msgs``: several), INIT_OK or ERROR answers. The
        credit of every push it settles returns at once, after their Futures are resolved."""
        kind = h.kind
        ids = h.ids if kind == wire.ACK else (h.msg,)
        if hops.ON:
            hops.stamp_woke("agent_wake", ids)
            hops.stamp("agent_ack", ids)
        settled = [m for m in ids if self._settle_one(kind, m, h)]
        if hops.ON:
            hops.stamp("resolved", settled)
        if settled:
            # the credit returns last: flush() never ends before the Future (or the error a
            # later push() raises) is settled
            self.credit.release(settled)

    def _settle_one(self, kind: str, msg: int, h) -> bool:
        """Resolve the Future of push or init ``msg``; False when it is to be sent again
        instead, or was settled before (an answer to a resend: counted once)."""
        resend, moved = self.resend, None
        if resend is not None:
            if (kind == wire.ERROR and h.code == Code.RECOVERING.value
                    and resend.refused_recovering(msg, self.clock())):
                # a restarted broker still hearing from its shards: send it again shortly
                self.stats["recovering_retries"] += 1
                return False
            if (kind == wire.ERROR and h.code == Code.BUSY.value
                    and resend.refused_busy(msg, self.clock())):
                # the broker at its byte cap kept nothing of it: send it again after a back-off
                self.stats["busy_retries"] += 1
                return False
            if kind == wire.ERROR and h.code == Code.MOVED.value and msg in resend.unsettled:
                # a tier member no longer holds the name: the bytes go to the one that does
                moved = moved_push(resend.unsettled[msg][0], self.shm)
            resend.settled(msg, self.clock())
            if msg in self.free_later:       # the broker freed it before it answered
                self.free_later.discard(msg)
                self.stats["shm_freed"] += self.shm.free((msg,))
        fut = self.msg_futures.pop(msg, None)
        if fut is None and msg not in self.credit.held:
            self.stats["duplicate_answers"] += 1
            return False
        if kind == wire.ERROR:
            self.stats["push_errors"] += 1
            err = error_from(h.code, h.message)
            if moved is not None:
                err.moved_push = moved
            if fut is None:
                self.async_errors.append(err)
            elif not fut.done():
                fut.set_exception(err)
        else:
            result = h.header
            if kind == wire.ACK:
                self.stats["pushes_acked"] += 1
                result = {"kind": wire.ACK, "msg": msg, "ver": h.version(msg)}
            if fut is not None and not fut.done():
                fut.set_result(result)
        return True

    def decode_blocks(self, h, frames, keep=None) -> list:
        """Validated, checksummed and decoded ``(key, array, version, base)`` of a message's
        tensors (only keys in ``keep``, when given)."""
        mtb = self.max_tensor_bytes
        descs = h.descs(frames, mtb)
        live = self.shm is not None and h.kind == wire.SNAPSHOT_REPLY
        out = []
        for d, f, raw in zip(descs, frames, h.t):
            if keep is not None and d.key not in keep:
                continue
            ref = raw.get("b") if live else None
            if (type(ref) is list and len(ref) == 3 and type(ref[0]) is str and d.base is None
                    and d.codec == "raw"):
                # where the shard's board keeps the block's newest version: read from there
                value = LiveBlock(self.shm.mapper, ref, tcodec.DTYPES[d.dtype],
                                  d.nbytes // tcodec.DTYPES[d.dtype].itemsize)
            else:
                # a block copied out of a shard's board under matching stamps (d.ref) is whole
                # by the stamp protocol, and never left this host's memory: not hashed again
                value = wire.decode_tensor(d, f, mtb, verify=d.ref is None)
            out.append((d.key, value, d.version or 0, d.base))
        return out

    def _snapshot(self, keys: list[str], fut: Future | None) -> None:
        self.reads.snapshot(keys, fut)

    def _resnapshot(self, p: int) -> None:
        """Partition ``p`` was put back in resync: snapshot its blocks again."""
        self._snapshot(self.cache.resync_keys(p), None)

    # -- events on the SUB -------------------------------------------------------------------------
    def event(self, frames) -> None:
        """One message from the broker's events socket (a malformed one is counted, dropped)."""
        self._guarded(self._event, frames)

    def _event(self, frames) -> None:
        if len(frames) < 2:
            raise WireError(Code.BAD_FRAME, "an events message is a topic and a header")
        topic = frames[0].bytes
        if topic == wire.TOPIC_TABLE:
            h = messages.unpack(frames[1], _TABLE)
            self._run(h.run)
            with self.cond:
                self.cache.down = set(h.down)
                self.cache.tables += 1
                if h.tier is not None:     # a tier member's map: the tier client follows it
                    self.cache.tier = h.tier
                moved = self.cache.on_table(h.epochs, h.owners, self.cache.down) \
                    if h.epochs is not None else ()
                self.cond.notify_all()
            if self.resend is not None and self.resend.recovering:
                # a shard registered: what a restarted broker refused RECOVERING may be served
                again = self.resend.recovering_now(self.clock())
                self.stats["table_retries"] += len(again)
                self.out.extend(Send(f) for f in again)
            for p in moved:      # a live partition's primary may have changed: find its board
                self._resnapshot(p)
        elif topic == wire.TOPIC_HEARTBEAT:
            self._on_heartbeat(messages.unpack(frames[1], _HEARTBEAT))
        elif topic[:1] in (b"p", b"r"):
            self._on_update(messages.unpack(frames[1], _UPDATE), frames[2:])

    def _on_heartbeat(self, h) -> None:
        self.stats["broker_heartbeats"] += 1
        self._run(h.run)
        if h.tv is not None:
            with self.cond:
                self.versions.on_heartbeat(h.tv)
                self.cond.notify_all()
        if h.ps is not None:      # with seqs of the same length, or neither
            with self.cond:
                behind = self.cache.on_heartbeat(h.ps, h.seqs)
            for p in behind:
                self._resnapshot(p)
            self.follows.heartbeat(h.ps, h.seqs)

    def _run(self, run: int | None) -> None:
        """The run id an event named (None: none)."""
        if run is not None and run != self.broker_run:
            if self.broker_run is not None:
                self._broker_restarted()
            self.broker_run = run

    def _broker_restarted(self) -> None:
        """Another broker process answers now: what the one before held is gone. Send every
        unsettled push and init, every unanswered request, and every read in flight again."""
        self.stats["broker_restarts"] += 1
        self.follows.broker_restarted()          # followed again first, then snapshot
        n = 0
        if self.resend is not None:
            for frames in self.resend.all_now(self.clock()):
                self.out.append(Send(frames))
                n += 1
        self.stats["restart_resends"] += n
        for frames in self.req_frames.values():
            self.out.append(Send(frames))
        reads = self.reads.in_flight()
        for req in reads:
            self.reads.reask(req, frames=False)
        with self.cond:
            live = self.cache.forget_table()
        for p in live:   # a live one's primary may be another shard now, with another board;
            self._resnapshot(p)       # a conflated one's delivery starts again
        log.info("the broker restarted: %d pushes or inits, %d requests and %d reads sent "
                 "again", n, len(self.req_frames), len(reads))

    def _on_update(self, h, tensors) -> None:
        """An UPDATE (``tensors``: its tensor frames), from the events socket or, by conflated
        delivery, the DEALER."""
        self.follows.updated(h.p)
        part = self.cache.parts.get(h.p)
        if part is None:
            return
        if part.live:            # read from the board: the update only wakes a waiting pull
            self.stats["live_wakeups"] += 1
            with self.cond:
                behind = self.cache.live_behind(h.p, [(d.get("k"), d.get("ver"))
                                                      for d in h.t if type(d) is dict
                                                      and type(d.get("ver")) is int])
                self.cond.notify_all()
            if behind:
                self.stats["live_boards_stale"] += 1
                self._resnapshot(h.p)
            return
        held = self.shm.board_blocks(h.t, tensors, self.max_tensor_bytes) \
            if self.shm is not None else None
        if held is not None:       # left in the boards, read when a pull needs them
            blocks = [(d.key, b, d.version or 0, None) for d, b in held if d.key in part.keys]
        elif self.shm is not None and not self.shm.resolve(h, tensors):
            self.stats["shm_torn"] += 1     # rewritten before it was read: the gap re-snapshots
            return
        else:
            blocks = self.decode_blocks(h, tensors, part.keys)
        with self.cond:
            gap = self.cache.on_update(h.p, h.seq, blocks, h.since)
            self.cond.notify_all()
        self.stats["updates_received"] += 1
        self.stats["recv_bytes"] += sum(wire.frame_len(f) for f in tensors)
        if gap:
            self._resnapshot(h.p)

    def validate_state(self) -> None:
        self.reads.validate_state()
        if self.resend is not None:
            self.resend.validate_state()
            assert self.free_later <= self.resend.unsettled.keys(), self.free_later
        self.credit.validate_state()
        self.follows.validate_state()
        self.cache.validate_state()
