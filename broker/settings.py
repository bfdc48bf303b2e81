"""The broker's settings: defaults as named constants and one frozen dataclass holding them.

The configuration file reader and the command line import the defaults from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradbus.codecs import timing, wire

SHARD_CREDIT = 2                 # batches in flight to one shard before the broker holds back:
                                 # one being applied while the next arrives (more only shrinks
                                 # batches and multiplies weight republishes; see docs)
MAX_BATCH_BYTES = 64 << 20       # one batch message to a shard carries at most this much tensor data
MAX_BATCH_ENTRIES = 1024         # ... and at most this many entries (pushes' and inits' blocks):
                                 # a shard applies a message whole before it heartbeats again,
                                 # and 5,000 small inits in one took it past its liveness on a
                                 # busy host
MAX_PENDING_BYTES = 512 << 20    # above this the loop stops reading the frontend (back-pressure)
DEDUPE_WINDOW = 100_000          # (client, msg_id) pairs remembered per client
MAX_PARKED_READS = 10_000        # table reads waiting for a bsp step to be applied
MAX_BLOCKS_PER_TENSOR = 1 << 20  # an INIT asking for more blocks is refused (TOO_LARGE)
MAX_PARAM_BYTES = 1 << 40        # one parameter tensor above this is refused (TOO_LARGE)
MAX_SYNCS = 32                   # partitions catching up on standbys at once ...
MAX_SYNC_BYTES = 64 << 20        # ... and their bytes (one partition, however large, may go):
                                 # a state in transit delays the heartbeats behind it
MOVE_PACE = 1.0                  # after a move of T seconds, the next waits MOVE_PACE * T:
                                 # moving uses at most about half of the shards' time
RATE_TAU = 10.0                  # seconds: time constant of a partition's update rate
MIN_GAIN = 1e-3                  # a rebalance move must lower the imbalance at least this much
LOG_SYNC_INTERVAL = 1.0          # fsync "interval": at most this long between fsyncs


@dataclass(frozen=True, slots=True)
class Settings:
    shard_credit: int = SHARD_CREDIT
    max_batch_bytes: int = MAX_BATCH_BYTES
    max_batch_entries: int = MAX_BATCH_ENTRIES
    max_pending_bytes: int = MAX_PENDING_BYTES
    max_tensor_bytes: int = wire.MAX_TENSOR_BYTES
    heartbeat_interval: float = timing.HEARTBEAT_INTERVAL
    liveness: int = timing.LIVENESS
    client_liveness: int = timing.CLIENT_LIVENESS
    dedupe_window: int = DEDUPE_WINDOW
    replicas: int = 1
    auto_rebalance: bool = True
    replay_until: float | None = None     # wall clock: replayed log records up to this time
    expect_shards: int | None = None      # registered this many: nobody else is coming
    log_fsync: str | None = None          # the update log's fsync policy; None: no log
    max_parked_reads: int = MAX_PARKED_READS
    max_syncs: int = MAX_SYNCS
    max_sync_bytes: int = MAX_SYNC_BYTES
    move_pace: float = MOVE_PACE
    min_gain: float = MIN_GAIN

    def __post_init__(self):
        if not 1 <= self.replicas <= 16:
            raise ValueError("replicas must be in 1..16")

    @property
    def shard_deadline(self) -> float:
        """Seconds of silence after which a shard is declared dead."""
        return self.heartbeat_interval * self.liveness

    @property
    def recovery_grace(self) -> float:
        """After a start, how long shards that held partitions may take to register again."""
        return 2 * (self.shard_deadline + timing.RECONNECT_MAX)
