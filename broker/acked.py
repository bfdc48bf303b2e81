"""What the broker has answered for, per partition: the newest ``(epoch, seq)`` of a batch its
primary applied (after which the broker acknowledges the batch's pushes), of a copy the broker
adopted from a registering shard, or of a batch replayed from an update log.

A partition whose only copy is gone (``lost``) comes back as soon as a shard registers
holding a copy that :meth:`AckMarks.covers` that mark: nothing the broker acknowledged is
missing from it. No I/O here.
"""
from __future__ import annotations


class AckMarks:
    def __init__(self, partitions: int):
        self.P = partitions
        self.marks: dict[int, tuple[int, int]] = {}     # p -> (epoch, seq)

    def note(self, p: int, epoch: int, seq: int) -> None:
        """Partition p holds (and may have acknowledged) everything up to ``seq``, sent in
        ``epoch``."""
        old = self.marks.get(p, (0, 0))
        self.marks[p] = (max(old[0], epoch), max(old[1], seq))

    def need(self, p: int) -> tuple[int, int]:
        """The ``(epoch, seq)`` a copy of p must reach to hold everything answered for."""
        return self.marks.get(p, (0, 0))

    def covers(self, p: int, state: tuple[int, int]) -> bool:
        """A copy of p at ``state`` = (epoch, seq) is at least as new as anything answered
        for: its seq is not behind the mark's, nor its epoch (seqs only grow across epochs, so
        a copy that applied the marked batch, or any later one, has both)."""
        epoch, seq = self.need(p)
        return state[1] >= seq and state[0] >= epoch

    def lost_message(self, p: int) -> str:
        epoch, seq = self.need(p)
        return (f"partition {p} is lost: no registered shard holds a copy at seq >= {seq}"
                f"{f' (epoch >= {epoch})' if epoch > 1 else ''}; start a shard with a "
                "checkpoint that has it (--restore)")

    def validate_state(self) -> list[str]:
        return [f"partition {p}'s acknowledged mark {m} is out of range"
                for p, m in self.marks.items()
                if not 0 <= p < self.P or m[0] < 0 or m[1] < 0]
