"""What a shard process reports beyond its core's snapshot (:meth:`ShardCore.metrics`): its
checkpoints (how often it writes them, when it wrote the newest, how many writes failed) and its
shared memory (on or not, refused a segment, weight blocks that went as frames for want of
room). The server loop records the events; :meth:`ShardMeters.snapshot` reads them, with the
loop's :class:`~.shm_io.ShardShm`, into the exporter's snapshot. No I/O here.
"""
from __future__ import annotations

import time

from gradbus.codecs import stats


class ShardMeters:
    def __init__(self, checkpoint_interval: float = 0.0, data_dir: str | None = None,
                 wall=time.time):
        self.wall = wall
        self.started = wall()
        # periodic checkpoints: every checkpoint_interval seconds with a data directory
        self.checkpoint_interval = float(checkpoint_interval) if data_dir else 0.0
        self.last_checkpoint: float | None = None   # wall-clock time of the newest one written
        self.checkpoint_failures = 0

    def checkpoint_written(self, at: float) -> None:
        self.last_checkpoint = at

    def checkpoint_failed(self) -> None:
        self.checkpoint_failures += 1

    def snapshot(self, shm) -> dict:
        """``shm``: the shard's :class:`~.shm_io.ShardShm`."""
        board, replies = shm.board, shm.replies
        exhausted = any(h is not None and h.failed is not None for h in (board, replies))
        return {
            "gradbus_shard_checkpoint_interval_seconds": stats.gauge(
                "Seconds between periodic checkpoints (--checkpoint-interval; 0: none, or no "
                "--data-dir).", self.checkpoint_interval),
            "gradbus_shard_last_checkpoint_timestamp_seconds": stats.gauge(
                "Unix time this shard process wrote its newest checkpoint; before its first, "
                "the time it started.", self.last_checkpoint or self.started),
            "gradbus_shard_checkpoint_failures": stats.counter(
                "Checkpoint writes that failed (disk full, permissions).",
                self.checkpoint_failures),
            "gradbus_shard_shm": stats.gauge(
                "1 if this shard publishes weights into shared memory (its board).",
                int(board is not None and board.failed is None)),
            "gradbus_shard_shm_exhausted": stats.gauge(
                "1 once /dev/shm refused this shard a segment (board or reply area): those "
                "bytes go as frames from then on.", int(exhausted)),
            "gradbus_shard_shm_fallbacks": stats.counter(
                "Weight blocks published as frames because the board had no room.",
                board.stats["shm_board_full"] if board is not None else 0),
        }
