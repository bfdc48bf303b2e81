"""Who is there: the shards (identity, liveness, credit in use, queued reads) and the clients
(liveness, push rate, staleness, errors). Liveness is judged on the injected clock.

A shard's ``partitions`` and ``bytes`` are written only by the partition table; a client's
duplicate window (``seen``) only by settlement.
"""
from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field


@dataclass(slots=True)
class ShardInfo:
    id: str
    identity: bytes
    last_seen: float
    alive: bool = True
    left: bool = False                    # dead because it said bye (drained, stopped)
    inflight: int = 0                     # batch messages sent, not yet APPLIED
    partitions: set = field(default_factory=set)    # the partition table's to write
    bytes: int = 0                        # bytes of parameters placed on it (the table's)
    info: dict = field(default_factory=dict)
    snapshots: list = field(default_factory=list)  # outstanding (client, req)
    queued_snapshots: list = field(default_factory=list)  # (client, req, keys, of, rows, shm)
    shm: bool = False                     # reads pushes from, and publishes into, shared memory
    key: str | None = None                # the CURVE key that registered it (None: CURVE off)
    token: bytes | None = None            # the registered process's own secret (REGISTER)


@dataclass(slots=True)
class ClientInfo:
    identity: bytes
    last_seen: float
    pushes: int = 0
    seen: OrderedDict = field(default_factory=OrderedDict)  # msg_id -> "pending"|ack/err frames
    errors: dict = field(default_factory=lambda: defaultdict(int))  # code -> pushes refused
    rate: float = 0.0              # pushes per second, smoothed over about 5 s
    rate_at: float = 0.0
    staleness: float | None = None     # versions behind on arrival, smoothed
    shm: bool = False              # its pushes and weights go through shared memory

    def count_push(self, now: float) -> None:
        """One push more, and the exponentially smoothed push rate (time constant 5 s)."""
        self.pushes += 1
        dt = max(now - self.rate_at, 1e-6)
        decay = math.exp(-dt / 5.0)
        self.rate = self.rate * decay + (1 - decay) / dt
        self.rate_at = now


class Membership:
    def __init__(self, settings):
        self.settings = settings
        self.shards: dict[str, ShardInfo] = {}
        self.by_identity: dict[bytes, str] = {}
        self.clients: dict[bytes, ClientInfo] = {}

    def live(self, shard_id: str | None) -> bool:
        s = self.shards.get(shard_id) if shard_id else None
        return bool(s and s.alive)

    def live_shards(self) -> list[ShardInfo]:
        return [s for s in self.shards.values() if s.alive]

    def client(self, identity: bytes, now: float) -> ClientInfo:
        """The client sending now (registered on its first message)."""
        c = self.clients.get(identity)
        if c is None:
            c = self.clients[identity] = ClientInfo(identity, now)
        c.last_seen = now
        return c

    def shard_of(self, identity: bytes) -> ShardInfo | None:
        """The registered, live shard behind a backend identity."""
        sid = self.by_identity.get(identity)
        s = self.shards.get(sid) if sid else None
        return s if s is not None and s.alive else None

    def new_shard(self, sid: str, identity: bytes, now: float) -> ShardInfo:
        s = self.shards[sid] = ShardInfo(sid, identity, now)
        return s

    def revive(self, s: ShardInfo, identity: bytes, now: float) -> None:
        """``s`` registered again, on connection ``identity``: its old connection no longer
        speaks for it."""
        if identity != s.identity and self.by_identity.get(s.identity) == s.id:
            del self.by_identity[s.identity]
        s.identity, s.alive, s.last_seen, s.inflight, s.left = identity, True, now, 0, False

    def silent_shards(self, now: float) -> list[ShardInfo]:
        deadline = self.settings.shard_deadline
        return [s for s in self.shards.values() if s.alive and now - s.last_seen > deadline]

    def expire_clients(self, now: float, busy) -> None:
        """Forget clients silent past their liveness that have nothing pending (``busy(id)``)."""
        limit = self.settings.heartbeat_interval * self.settings.client_liveness
        for ident, c in list(self.clients.items()):
            if now - c.last_seen > limit and not busy(ident):
                del self.clients[ident]

    def validate_state(self) -> list[str]:
        problems = []
        for ident, sid in self.by_identity.items():
            if sid not in self.shards:
                problems.append(f"identity {ident!r} names unknown shard {sid}")
            elif self.shards[sid].identity != ident:
                problems.append(f"identity {ident!r} names shard {sid}, registered on "
                                f"{self.shards[sid].identity!r}")
        for s in self.shards.values():
            if s.inflight < 0:
                problems.append(f"shard {s.id} has {s.inflight} batches in flight")
            if not s.alive and (s.snapshots or s.queued_snapshots or s.inflight):
                problems.append(f"dead shard {s.id} still has reads or batches outstanding")
        return problems
