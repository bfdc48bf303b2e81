"""The parameter store: flat blocks of dense tensors, their optimizer state and versions."""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from gradbus.codecs import specs
from gradbus.codecs.partition import TensorLayout, split_key, split_row_key

from .optim import CPU, make_rule
from .rows import RowPool, RowTable

RECENT_WINDOW = 8192     # gradient identities remembered per partition
#: ``GRADBUS_BOARD_STEP=0``: a primary steps its blocks in place and copies them onto its
#: weights board after each step, instead of stepping them straight into it
BOARD_STEP_ENV = "GRADBUS_BOARD_STEP"


@dataclass
class Block:
    """A block's values are ``held`` (owned memory), or, after a primary's step wrote them
    straight into its weights board (:meth:`ParameterStore.step`), ``live`` (the
    board's newest version): ``value`` gives the newest either way, copying them back into
    ``held`` first when they are live."""
    key: str
    layout: TensorLayout
    index: int
    held: np.ndarray             # flat, owned, writable
    rule: object
    state: dict
    version: int = 0             # gradients applied (pushes), 0 after init
    p: int = 0                   # partition
    published: np.ndarray | None = None  # delta weights: what subscribers hold (host memory)
    pub_seq: int | None = None           # ... as of the partition seq of that publish
    opt: dict | None = None              # the optimizer's wire form (for replication)
    live: np.ndarray | None = None       # the newest values, on the board, when not in held

    @property
    def value(self) -> np.ndarray:
        """The newest values, owned and writable (in place: the next step starts from them)."""
        if self.live is not None:
            self.settle()
        return self.held

    @value.setter
    def value(self, values: np.ndarray) -> None:
        self.held, self.live = values, None

    @property
    def newest(self) -> np.ndarray:
        """The newest values, to read at once: not to write, and not to keep (a live view is
        written over by the step after next)."""
        return self.held if self.live is None else self.live

    def settle(self) -> None:
        """The newest values back into ``held`` (when they are live on the board)."""
        if self.live is not None:
            np.copyto(self.held, self.live)
            self.live = None

    @property
    def nbytes(self) -> int:
        return self.held.nbytes


def initial_values(layout: TensorLayout, index: int, rule: dict, given=None) -> np.ndarray:
    """The initial flat values of one block. Random rules are seeded by (seed, block index), so
    any shard produces the same values for the same block."""
    start, stop = layout.block_range(index)
    n = stop - start
    dt = np.dtype(layout.dtype)
    name = rule["name"]
    if name == "given":
        if given is None or given.size != n:
            raise ValueError(f"block {index} of {layout.name}: given values missing or of wrong size")
        return np.array(given, dtype=dt).reshape(-1)
    if name == "zeros":
        return np.zeros(n, dt)
    if name == "constant":
        return np.full(n, rule["value"], dt)
    rng = np.random.default_rng([int(rule.get("seed", 0)), index])
    if name == "normal":
        return rng.normal(rule["mean"], rule["std"], n).astype(dt)
    if name == "uniform":
        return rng.uniform(rule["low"], rule["high"], n).astype(dt)
    raise ValueError(f"unknown initializer {name!r}")


@dataclass
class PartitionState:
    p: int
    epoch: int = 0
    seq: int = 0                 # last batch seq applied
    keys: set = field(default_factory=set)
    tables: set = field(default_factory=set)     # row keys ("name#p") of the tables held
    # (client, msg, key) of the gradients applied most recently: a push the broker forwards
    # again (resent to a restarted broker, which forgot its duplicate window) applies once.
    recent: OrderedDict = field(default_factory=OrderedDict)

    def seen(self, ident: tuple) -> bool:
        """Record a gradient's identity; True if it was already applied."""
        if ident in self.recent:
            return True
        self.recent[ident] = None
        if len(self.recent) > RECENT_WINDOW:
            self.recent.popitem(last=False)
        return False


class ParameterStore:
    """Blocks live in the backend's memory (device memory for CuPy)."""

    def __init__(self, backend=CPU):
        self.backend = backend
        self.blocks: dict[str, Block] = {}
        self.tables: dict[str, RowTable] = {}     # row key -> that partition's rows
        self.pools: dict[str, RowPool] = {}       # table name -> the storage of its rows here
        self.partitions: dict[int, PartitionState] = {}
        # a primary's weights board (codecs.shm.Board), where a step may write a block's
        # values straight into the block's next version (the publisher sets it)
        self.board = None
        self.board_steps = (getattr(backend, "steps_out", False)
                            and os.environ.get(BOARD_STEP_ENV, "1") != "0")

    def use_board(self, board) -> None:
        """Let steps write primaries' blocks straight into ``board`` (None: never; also never
        where the backend cannot step out of place, or ``GRADBUS_BOARD_STEP=0``). Values live
        on a board being left are settled first."""
        board = board if self.board_steps else None
        if board is not self.board:
            self.settle()
        self.board = board

    def settle(self) -> None:
        """Every block's values back into the memory it owns."""
        for blk in self.blocks.values():
            blk.settle()

    def step(self, blk: Block, g, k: int, scratch, seq: int, onto_board: bool,
             split=None) -> None:
        """One optimizer step of ``blk`` on ``g`` (the sum of ``k`` gradients). With
        ``onto_board`` (the block's partition is this shard's to publish) and a board with
        room, the step reads the newest values and writes the stepped ones straight into the
        board's next version of the block, published there at ``seq``: no copy onto the board
        after the step, and the block's ``held`` values stay as they were until someone asks
        for ``value``. Otherwise it steps ``value`` in place. ``split``: where the block is
        stepped in pieces at once, called with the rule's ``ranged`` step (see
        :mod:`.optim`)."""
        out = self.board_target(blk, onto_board)
        w = blk.value if out is None else blk.newest
        if split is not None:
            split(blk.rule.ranged(w, g, k, blk.state, out))
        elif out is None:
            blk.rule.step(w, g, k, blk.state, scratch)
        else:
            blk.rule.step(w, g, k, blk.state, scratch, out)
        if out is None:
            blk.version += k
            return
        self.publish_step(blk, out, k, seq)

    def board_target(self, blk: Block, onto_board: bool) -> np.ndarray | None:
        """Where a step of ``blk`` writes the block's next version on the board (see
        :meth:`step`), to be published with :meth:`publish_step`; left unpublished, the block
        keeps its newest version. None where the step goes in place."""
        board = self.board if onto_board else None
        dst = board.begin(blk.key, blk.held.nbytes) if board is not None else None
        return None if dst is None else np.frombuffer(dst, blk.held.dtype)

    def publish_step(self, blk: Block, out: np.ndarray, k: int, seq: int) -> None:
        """``out`` (from :meth:`board_target`, written) is ``blk``'s newest version, ``k``
        gradients on, published at ``seq``."""
        blk.version += k
        self.board.commit(blk.key, blk.version, seq)
        blk.live = out

    def partition(self, p: int) -> PartitionState:
        st = self.partitions.get(p)
        if st is None:
            st = self.partitions[p] = PartitionState(p)
        return st

    def create(self, key: str, p: int, layout: TensorLayout, rule: dict, opt: dict,
               given=None) -> tuple[Block, bool]:
        """Create a block if absent. Returns (block, created)."""
        blk = self.blocks.get(key)
        if blk is not None:
            return blk, False
        _, index = split_key(key)
        value = self.backend.asarray(initial_values(layout, index, rule, given))
        optimizer = make_rule(specs.optimizer_from_wire(opt), self.backend)
        blk = Block(key, layout, index, value, optimizer,
                    optimizer.state(value.size, value.dtype), 0, p, opt=opt)
        self.blocks[key] = blk
        self.partition(p).keys.add(key)
        return blk, True

    def create_table(self, key: str, p: int, cfg: dict) -> tuple[RowTable, bool]:
        """The rows of a table in partition ``p`` (empty), if absent. Returns (rows, created)."""
        tbl = self.tables.get(key)
        if tbl is not None:
            return tbl, False
        tbl = self.tables[key] = RowTable(cfg, self.pool(key, cfg))
        self.partition(p).tables.add(key)
        return tbl, True

    def pool(self, key: str, cfg: dict) -> RowPool:
        """The row storage of the table a row key belongs to (made on first use)."""
        name = split_row_key(key)[0]
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = RowPool(cfg)
        return pool

    def install_table(self, key: str, p: int, tbl: RowTable) -> None:
        old = self.tables.pop(key, None)
        if old is not None:
            old.release()
        self.tables[key] = tbl
        self.partition(p).tables.add(key)

    def drop(self, p: int) -> list[str]:
        """Forget partition ``p``, its blocks and table rows; returns the keys dropped."""
        st = self.partitions.pop(p, None)
        keys = sorted(st.keys) if st else []
        for key in keys:
            self.blocks.pop(key, None)
        for key in (st.tables if st else ()):
            tbl = self.tables.pop(key, None)
            if tbl is not None:
                tbl.release()
        return keys

    def drop_key(self, key: str) -> list[str]:
        """Forget one block or table's rows (its name moved to another tier member); returns
        the block keys dropped."""
        blk = self.blocks.pop(key, None)
        if blk is not None:
            st = self.partitions.get(blk.p)
            if st is not None:
                st.keys.discard(key)
            return [key]
        tbl = self.tables.pop(key, None)
        if tbl is not None:
            tbl.release()
            for st in self.partitions.values():
                st.tables.discard(key)
        return []

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables.values())

    @property
    def nbytes(self) -> int:
        return (sum(b.nbytes for b in self.blocks.values())
                + sum(t.nbytes for t in self.tables.values()))
