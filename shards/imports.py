"""Blocks and table rows that arrive whole: a name moved here from another tier member
(protocol section 24.4), in sequenced init entries carrying their state, and a partition's
state installed from a primary or a checkpoint (:mod:`.replication`). Either way the block,
its optimizer state and its version equal the exporter's, replacing any of that key."""
from __future__ import annotations

import numpy as np

from gradbus.codecs import wire
from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.partition import split_key

from .rows import RowTable
from .store import Block, ParameterStore


def put_block(store: ParameterStore, backend, key: str, p: int, layout, opt: dict, arrs: list,
              names, scalars: dict, version: int) -> Block:
    """Block ``key`` of partition ``p`` as exported: values ``arrs[0]``, optimizer arrays
    ``names`` in ``arrs[1:]``, ``scalars``, ``version``; one held already is replaced."""
    old = store.blocks.get(key)
    if old is not None and old.p != p:
        store.drop_key(key)
    else:
        store.blocks.pop(key, None)
    blk, _ = store.create(key, p, layout, {"name": "given"}, opt, arrs[0])
    for name, arr in zip(names, arrs[1:]):
        blk.state[name][...] = backend.asarray(arr)
    blk.state.update(scalars)
    blk.version = version
    return blk


def put_table(store: ParameterStore, key: str, p: int, cfg: dict, scalars: dict,
              arrays: dict) -> None:
    """Table rows ``key`` of partition ``p`` as exported (``arrays``: name -> array)."""
    store.install_table(key, p, RowTable.install(cfg, scalars, arrays, store.pool(key, cfg)))


class Imports:
    """A batch's imported entries (one raw frame each), decoded and put in the store."""

    def __init__(self, store: ParameterStore, backend, max_tensor_bytes: int):
        self.store, self.backend, self.max = store, backend, max_tensor_bytes

    def _arrays(self, ent, descs, frames) -> list:
        """Views of the entry's frame (a block's are copied into the store as it is put; a
        table's rows are copied here)."""
        try:
            return ent.st.split(wire.decode_tensor(descs[ent.i], frames[ent.i], self.max))
        except ValueError as e:
            raise WireError(Code.BAD_SHAPE, f"{ent.key}: {e}") from None

    def block(self, ent, descs, frames, p: int) -> Block:
        st = ent.st
        arrs = self._arrays(ent, descs, frames)
        start, stop = ent.layout.block_range(split_key(ent.key)[1])
        if arrs[0].shape != (stop - start,) or arrs[0].dtype != np.dtype(ent.layout.dtype):
            raise WireError(Code.BAD_SHAPE, f"{ent.key}: imported values are not "
                                            f"{ent.layout.dtype}[{stop - start}]")
        return put_block(self.store, self.backend, ent.key, p, ent.layout, ent.opt, arrs,
                         [a[0] for a in st.arrays[1:]], st.scalars, st.version)

    def table(self, ent, descs, frames, p: int) -> None:
        st = ent.st
        arrs = {a[0]: np.array(v) for a, v in zip(st.arrays, self._arrays(ent, descs, frames))}
        try:
            put_table(self.store, ent.key, p, ent.table, st.scalars, arrs)
        except ValueError as e:
            raise WireError(Code.BAD_SHAPE, f"{ent.key}: {e}") from None
