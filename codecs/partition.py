"""Keys, blocks and partitions: the one place that does this math.

A dense tensor is flattened (C order) and cut into blocks of ``block_elems`` elements; block ``i``
of tensor ``name`` has key ``"name/i"``. A key maps to a partition by CRC-32 of its UTF-8 bytes
modulo the partition count, which is fixed when the cluster is created. CRC-32 is in the standard
library and frozen, so every process and version agrees on the placement.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

DEFAULT_PARTITIONS = 256
DEFAULT_BLOCK_BYTES = 1 << 20  # 1 MiB per block by default
MAX_NAME_LEN = 256


def partition_of(key: str, partitions: int) -> int:
    """Stable partition of a block key."""
    return zlib.crc32(key.encode("utf-8")) % partitions


def block_key(name: str, index: int) -> str:
    return f"{name}/{index}"


@dataclass(frozen=True)
class TensorLayout:
    """How one named tensor is laid out in blocks."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    block_elems: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return max(1, -(-self.size // self.block_elems))

    def block_range(self, i: int) -> tuple[int, int]:
        start = i * self.block_elems
        return start, min(self.size, start + self.block_elems)

    def block_bytes(self, i: int) -> int:
        """Bytes of block ``i`` (parameters are float32 or float64)."""
        start, stop = self.block_range(i)
        return (stop - start) * (8 if self.dtype == "float64" else 4)

    def block_keys(self) -> list[str]:
        return [block_key(self.name, i) for i in range(self.nblocks)]

    def to_wire(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "block": self.block_elems}

    @classmethod
    def from_wire(cls, d: dict) -> "TensorLayout":
        return cls(d["name"], d["dtype"], tuple(int(x) for x in d["shape"]), int(d["block"]))


def block_elems_for(itemsize: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    return max(1, block_bytes // itemsize)


def split_key(key: str) -> tuple[str, int]:
    """``"name/3"`` -> ``("name", 3)``. Raises ValueError on a malformed key."""
    name, _, idx = key.rpartition("/")
    if not name or not idx.isdigit():
        raise ValueError(f"not a block key: {key!r}")
    return name, int(idx)
