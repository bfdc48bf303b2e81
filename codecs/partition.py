"""Keys, blocks and partitions: the one place that does this math.

A dense tensor is flattened (C order) and cut into blocks of ``block_elems`` elements; block ``i``
of tensor ``name`` has key ``"name/i"``. A key maps to a partition by CRC-32 of its UTF-8 bytes
modulo the partition count, which is fixed when the cluster is created. CRC-32 is in the standard
library and frozen, so every process and version agrees on the placement.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import numpy as np

DEFAULT_PARTITIONS = 256
# Bytes per block of a dense tensor by default: each block is a key, and every key costs its
# own descriptor, sequencing, step and board slot per push. 4 MiB (BytePS cuts tensors into
# partitions of about the same size) keeps that per-key work a small part of a large tensor's
# push; a smaller block spreads one large tensor over more partitions (and shards).
DEFAULT_BLOCK_BYTES = 4 << 20
MAX_NAME_LEN = 256


def partition_of(key: str, partitions: int) -> int:
    """Stable partition of a key: CRC-32 of a dense block key (``"name/i"``), or the partition a
    table's row key names (``"name#p"``, see :func:`row_key`)."""
    row = split_row_key(key)
    return row[1] if row is not None else zlib.crc32(key.encode("utf-8")) % partitions


# -- sparse tables ---------------------------------------------------------------------------
# A table's rows are placed by row id: partition = mix64(id XOR seed(name)) mod P, with mix64 the
# splitmix64 finalizer and seed(name) = CRC-32 of the name times the 64-bit golden ratio (or,
# for a table spread over S < P partitions, the (that mod S)-th of its S partitions). The rows
# of table ``name`` in partition ``p`` travel and are stored under the key ``"name#p"``.
GOLDEN = np.uint64(0x9E3779B97F4A7C15)     # the 64-bit golden ratio
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def mix64(x: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """The splitmix64 finalizer on a uint64 array (wrapping arithmetic): a new array, or with
    ``tmp`` (scratch of ``x``'s shape) ``x`` itself, mixed in place."""
    if tmp is None:
        x = np.array(x, dtype=np.uint64)
        tmp = np.empty_like(x)
    with np.errstate(over="ignore"):
        x ^= np.right_shift(x, _S30, out=tmp)
        x *= _M1
        x ^= np.right_shift(x, _S27, out=tmp)
        x *= _M2
        x ^= np.right_shift(x, _S31, out=tmp)
    return x


def _seed(name: str) -> np.uint64:
    with np.errstate(over="ignore"):
        return np.uint64(zlib.crc32(name.encode("utf-8"))) * GOLDEN


@functools.lru_cache(maxsize=1024)
def table_partitions(name: str, partitions: int, spread: int = 0) -> np.ndarray:
    """The partitions a table's rows live in: all of them (``spread`` 0 or >= P), or the
    ``spread`` that come first when the partitions are ordered by mix64(p XOR seed(name))."""
    if not spread or spread >= partitions:
        out = np.arange(partitions, dtype=np.int64)
    else:
        order = np.argsort(mix64(np.arange(partitions, dtype=np.uint64) ^ _seed(name)),
                           kind="stable")
        out = order[:spread].astype(np.int64)
    out.flags.writeable = False     # cached: shared by every caller
    return out


def row_partitions(name: str, ids: np.ndarray, partitions: int, spread: int = 0) -> np.ndarray:
    """The partition of each row id (int64 array) of table ``name``: mix64(id XOR seed(name))
    mod P, or with ``spread`` S < P, the (that mod S)-th of the table's partitions."""
    h = mix64(np.asarray(ids, dtype=np.int64).view(np.uint64) ^ _seed(name))
    if not spread or spread >= partitions:
        return (h % np.uint64(partitions)).astype(np.int64)
    return table_partitions(name, partitions, spread)[(h % np.uint64(spread)).astype(np.int64)]


def row_key(name: str, p: int) -> str:
    return f"{name}#{p}"


def split_row_key(key: str) -> tuple[str, int] | None:
    """``"emb#5"`` -> ``("emb", 5)``; None for a key that is not a row key."""
    head, sep, tail = key.rpartition("#")
    if sep and head and tail.isdigit():
        return head, int(tail)
    return None


def block_key(name: str, index: int) -> str:
    return f"{name}/{index}"


@dataclass(frozen=True)
class TensorLayout:
    """How one named tensor is laid out in blocks. What derives from the fields is computed
    once (a layout never changes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    block_elems: int

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nblocks(self) -> int:
        return max(1, -(-self.size // self.block_elems))

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        return tuple(block_key(self.name, i) for i in range(self.nblocks))

    def block_range(self, i: int) -> tuple[int, int]:
        start = i * self.block_elems
        return start, min(self.size, start + self.block_elems)

    def block_bytes(self, i: int) -> int:
        """Bytes of block ``i`` (parameters are float32 or float64)."""
        start, stop = self.block_range(i)
        return (stop - start) * (8 if self.dtype == "float64" else 4)

    def block_keys(self) -> tuple[str, ...]:
        return self.keys

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
