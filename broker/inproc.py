"""Shards inside the broker's process: each talks to the broker over an in-process pipe
(:mod:`gradbus.codecs.pipe`) and is run by the broker's loop, between its reads.

On one host a push's round trip crosses from the broker to its shard and back: two of its four
crossings, each a system call, a wake-up of another process and a loop's turn on each side
(``bench/peers.py --hops``). A shard inside the broker's process has none of that: the loop
hands the batch it flushed to the shard, the shard's core applies it and hands back its
APPLIED, which the broker settles in the same turn of the loop. It is the same shard and the
same protocol (REGISTER, batches, APPLIED, heartbeats, checkpoints), messages packed and
checked as between processes; only the transport is gone.

What it gives up: the shard fails with the broker (a broker that dies takes the shard's state
with it unless a standby shard in another process holds a replica, or it checkpoints), and the
broker's and the shard's work share one core. Not with a broker pair, nor with CURVE (the
pipe has no keys to check, and a pair's standby would have no shard).

The shards are duck-typed (:class:`gradbus.shards.server.ShardServer` built with
``connect=``): ``start()``, ``pump()``, ``turn()``, ``stopping``, ``close()``; this package
never imports the shard's.
"""
from __future__ import annotations

import logging
import os

from gradbus.codecs import wire
from gradbus.codecs.pipe import Pipe

log = logging.getLogger("gradbus.broker")

TURN_EVERY = 0.05       # seconds between a shard's housekeeping turns (its own loop's poll)
PUMP_ROUNDS = 64        # hand-overs each way per pump, so the loop still reads its sockets
IDENTITY_BYTES = 16


class InprocShards:
    """The in-process shards, their pipes by routing identity, and their turns."""

    def __init__(self, welcome, errors):
        """``welcome()``: the WELCOME a shard's HELLO would get (a header dict); ``errors``:
        the broker's error counters (a shard's failure here is counted there)."""
        self._welcome = welcome
        self.errors = errors
        self.shards: list = []
        self.pipes: dict[bytes, tuple[Pipe, object]] = {}
        self.next_turn = 0.0

    def add(self, make_shard):
        """``make_shard(connect)``: a shard built with this connector. It is connected and
        has sent its REGISTER (handled at the loop's next pump)."""
        slot: list = []

        def connect():
            shard = slot[0]
            for pipe, s in self.pipes.values():
                if s is shard:                # a reconnect: the old pipe is done with
                    pipe.close()
            pipe = Pipe()
            # never a zero first byte (libzmq reserves it) nor a link's or a socket's id
            ident = b"P" + os.urandom(IDENTITY_BYTES - 1)
            self.pipes[ident] = (pipe, shard)
            return pipe.shard, self._welcome()

        shard = make_shard(connect)
        slot.append(shard)
        self.shards.append(shard)
        shard.start()
        return shard

    def holds(self, identity: bytes) -> bool:
        """Whether ``identity`` is an in-process shard's (a socket naming it is another peer)."""
        return identity in self.pipes

    def put(self, identity: bytes, frames) -> bool:
        """Hand a message to the shard with ``identity``; False when no pipe has it. A pipe the
        shard closed (it is reconnecting, or stopped) drops the message, counted, as a socket
        to a peer gone would."""
        ent = self.pipes.get(identity)
        if ent is None:
            return False
        if not ent[0].put(frames):
            self.errors["send_pipe_closed"] += 1
        return True

    def busy(self) -> bool:
        """Messages wait on a pipe (the loop must not sleep in poll)."""
        return any(p.to_shard or p.to_broker for p, _ in self.pipes.values())

    def pump(self, handle) -> None:
        """Let each shard take what was handed to it, and ``handle(identity, frames)`` what
        it sent back, until both are empty (at most :data:`PUMP_ROUNDS` rounds a pump)."""
        for ident, (pipe, shard) in list(self.pipes.items()):
            for _ in range(PUMP_ROUNDS):
                if pipe.to_shard:
                    self._guarded(shard, shard.pump)
                if not pipe.to_broker:
                    break
                while (frames := pipe.take()) is not None:
                    handle(ident, frames)
            if pipe.closed and not pipe.to_broker:
                del self.pipes[ident]

    def turn(self, now: float, force: bool = False) -> None:
        """Each shard's housekeeping (heartbeats, checkpoints, the shared-memory prune) every
        :data:`TURN_EVERY` (or now, ``force``), after it took what was handed to it; a shard
        that stopped (drained, or told to) is closed. What the shards sent is left for
        :meth:`pump`."""
        if now < self.next_turn and not force:
            return
        self.next_turn = now + TURN_EVERY
        for shard in list(self.shards):
            if not shard.stopping.is_set():
                self._guarded(shard, shard.pump)
                self._guarded(shard, shard.turn)
            if shard.stopping.is_set():
                self.shards.remove(shard)
                self._guarded(shard, shard.close)

    def _guarded(self, shard, call) -> None:
        """A shard's call: a bug in it is logged and counted, and takes the broker's loop
        down no more than a shard process's bug takes its broker (the shard's own loop
        already keeps a failing message from stopping it)."""
        try:
            call()
        except Exception:
            log.exception("the shard %s in this process failed", shard.shard_id)
            self.errors["INTERNAL"] += 1

    def close(self) -> None:
        """Stop and close every shard (a clean stop: each writes its final checkpoint where
        it has a data directory); a shard whose close fails raises after the others closed."""
        failed = None
        for shard in self.shards:
            shard.stop()
            try:
                shard.close()
            except SystemExit as e:
                failed = e
        self.shards.clear()
        for pipe, _ in self.pipes.values():
            pipe.close()
        self.pipes.clear()
        if failed is not None:
            raise failed


def welcome_of(actions) -> dict:
    """The WELCOME among a HELLO's actions, as a header dict."""
    for act in actions:
        frames = getattr(act, "frames", None)
        if frames:
            h = wire.unpack_header(frames[0], frozenset({wire.WELCOME, wire.ERROR}))
            if h["kind"] == wire.WELCOME:
                return h
            raise RuntimeError(f"the broker refused an in-process shard: {h.get('message')}")
    raise RuntimeError("the broker gave no WELCOME")
