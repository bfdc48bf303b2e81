"""Embedding table rows on the client side: placing row ids in partitions, summing duplicate
ids, and putting the rows that come back from several shards in the caller's order.

A table's rows live in every partition (key ``name#p``, see :mod:`gradbus.codecs.partition`);
a push or read names, per partition, the int64 ids it carries.
"""
from __future__ import annotations

import numpy as np

from gradbus.codecs.partition import row_partitions, split_row_key

MAX_IDS_PER_READ = 1 << 18       # ids in one ROWS request (the header stays well under its cap)
MAX_READ_BYTES = 32 << 20        # ... and row bytes in its replies (heartbeats queue behind them)


def as_ids(ids) -> np.ndarray:
    """Row ids as a flat int64 array; ValueError for anything that is not integers."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise ValueError(f"row ids must be integers, not {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() >= 2**63:
        raise ValueError("row ids must fit in int64")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)


def sum_duplicates(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique ids ascending, the rows of equal ids summed)``, summed in the given order."""
    order = np.argsort(ids, kind="stable")
    sid = ids[order]
    if len(sid) < 2 or (sid[1:] != sid[:-1]).all():
        return sid, rows[order]
    starts = np.flatnonzero(np.concatenate(([True], sid[1:] != sid[:-1])))
    return sid[starts], np.add.reduceat(rows[order], starts, axis=0)


def by_partition(name: str, ids: np.ndarray, partitions: int, spread: int = 0):
    """Yield ``(partition, positions in ids)`` for every partition the ids touch."""
    parts = row_partitions(name, ids, partitions, spread)
    order = np.argsort(parts, kind="stable")
    sp = parts[order]
    bounds = np.flatnonzero(np.concatenate(([True], sp[1:] != sp[:-1], [True])))
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield int(sp[a]), order[a:b]


def read_plan(name: str, ids: np.ndarray, partitions: int, row_bytes: int = 4,
              spread: int = 0):
    """The unique ids to read, the inverse map back to ``ids``, and the requests: a list of
    ``(q, positions)``: ``q`` the ROWS query ``[[p, id bytes], ...]`` and ``positions`` per
    entry the indices into the unique ids it covers. ``row_bytes``: the size of one row."""
    uniq, inv = np.unique(ids, return_inverse=True)
    most = max(1, min(MAX_IDS_PER_READ, MAX_READ_BYTES // max(1, row_bytes)))
    reqs, q, pos, n = [], [], [], 0
    for p, where in by_partition(name, uniq, partitions, spread):
        if n and n + len(where) > most:
            reqs.append((q, pos))
            q, pos, n = [], [], 0
        q.append([p, uniq[where].tobytes()])
        pos.append(where)
        n += len(where)
    if q:
        reqs.append((q, pos))
    return uniq, inv.reshape(-1), reqs


def assemble(name: str, uniq: np.ndarray, reqs: list, replies: list, dim: int, dtype):
    """The unique ids' rows from the ROWS replies (``[(descs, arrays), ...]`` per request)."""
    out = np.empty((len(uniq), dim), dtype=dtype)
    filled = 0
    for (q, positions), got in zip(reqs, replies):
        where = {p: pos for (p, _), pos in zip(q, positions)}
        for desc, arr in got:
            name_p = split_row_key(desc.key)
            pos = where.pop(name_p[1], None) if name_p and name_p[0] == name else None
            if pos is None or arr.shape != (len(pos), dim):
                raise ValueError(f"rows reply for {desc.key} does not match the request")
            out[pos] = arr
            filled += len(pos)
    if filled != len(uniq):
        raise ValueError(f"rows reply covered {filled} of {len(uniq)} ids")
    return out
