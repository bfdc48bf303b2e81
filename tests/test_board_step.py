"""A primary's step straight into its weights board: the board's next version of a block is
written by the step itself (no copy onto the board after it), the block's values then live
there, and every other reader of the values (a standby's step, a snapshot, a state export, a
digest, a checkpoint) sees the same bits as a shard that steps in place."""
from __future__ import annotations

import numpy as np
import pytest

from gradbus.codecs import shm, wire
from gradbus.codecs.partition import TensorLayout
from gradbus.shards.backend import NumpyBackend
from gradbus.shards.store import ParameterStore

from .rigs import JIT_PATHS, CheckedShard, init_one_block, unpack

pytestmark = pytest.mark.usefixtures("shm_dir")

CLUSTER = "b0a4d57e"
N = 3 * 65536 + 17          # a few of the numpy path's chunks, and a short last one
OPTS = [{"name": "sgd", "lr": 0.5, "momentum": 0.0},
        {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        {"name": "adam", "lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8},
        {"name": "adagrad", "lr": 0.1, "eps": 1e-10}]


@pytest.fixture
def board():
    b = shm.Board(CLUSTER, segment_bytes=1 << 20)
    yield b
    b.close()


@pytest.fixture
def reader():
    m = shm.Mapper()
    yield m
    m.close()


def _floats(view) -> np.ndarray:
    return np.frombuffer(view, np.float32)


# ----------------------------------------------------------------------------- the board
def test_a_begun_version_is_skipped_by_readers_until_it_is_committed(board, reader):
    a, b = np.arange(1000, dtype=np.float32), -np.arange(1000, dtype=np.float32)
    ra = board.write("w/0", a, version=1, seq=1)
    live = board.live_ref("w/0")
    dst = board.begin("w/0", b.nbytes)
    assert _floats(board.newest("w/0")[0]).tobytes() == a.tobytes()
    dst[:] = b.tobytes()
    out = bytearray(a.nbytes)                     # written, not committed: readers read a
    assert reader.read_live(live, memoryview(out))[1] == 1 and bytes(out) == a.tobytes()
    rb = board.commit("w/0", version=2, seq=2)
    assert reader.read_live(live, memoryview(out))[1] == 2 and bytes(out) == b.tobytes()
    view, ref = board.newest("w/0")
    assert ref == rb and rb[1] != ra[1] and rb[2] == ra[2] + 1 and board.holds("w/0", 2)
    assert _floats(view).tobytes() == b.tobytes()
    assert bytes(reader.copy(rb, b.nbytes)) == b.tobytes()
    assert bytes(reader.copy(ra, a.nbytes)) == a.tobytes()        # one behind: still whole


def test_a_version_begun_and_given_up_leaves_the_newest_as_it_was(board, reader):
    a, b = np.ones(500, np.float32), np.full(500, 2, np.float32)
    ra = board.write("w/0", a, version=1)
    rb = board.write("w/0", b, version=2)
    dst = board.begin("w/0", a.nbytes)            # over a's place: a's ref fails from now on
    dst[:] = bytes(a.nbytes)
    assert reader.copy(ra, a.nbytes) is None
    out = bytearray(b.nbytes)
    assert reader.read_live(board.live_ref("w/0"), memoryview(out))[1] == 2
    assert bytes(out) == b.tobytes() and board.holds("w/0", 2)
    assert board.newest("w/0")[1] == rb and bytes(reader.copy(rb, b.nbytes)) == b.tobytes()


def test_a_block_never_written_has_no_newest(board):
    assert board.newest("w/9") is None
    board.begin("w/9", 64)
    assert board.newest("w/9") is None and not board.holds("w/9", 0)


# ----------------------------------------------------------------------------- the store
def _store(opt: dict, path: str, with_board=None, dtype: str = "float32"):
    store = ParameterStore(NumpyBackend(jit=None if path == "numba" else False))
    layout = TensorLayout("w", dtype, (N,), N * 8)
    blk, _ = store.create("w/0", 0, layout, {"name": "normal", "mean": 0.0, "std": 1.0,
                                             "seed": 3}, opt)
    store.use_board(with_board)
    return store, blk


# float16 (numpy's path either way) with SGD only: it underflows Adam's and Adagrad's eps to 0
CASES = [(o, "float32") for o in OPTS] + [(o, "float16") for o in OPTS[:2]]


@pytest.mark.parametrize("path", JIT_PATHS)
@pytest.mark.parametrize("opt,dtype", CASES,
                         ids=lambda c: c if isinstance(c, str) else
                         f"{c['name']}{c.get('momentum', '')}")
def test_steps_onto_the_board_give_the_bits_of_steps_in_place(board, reader, opt, path, dtype):
    on, blk = _store(opt, path, board, dtype)
    off, ref_blk = _store(opt, path, None, dtype)
    init = blk.held.copy()
    scratch = np.empty(N, dtype)
    rng = np.random.default_rng(7)
    for step in range(1, 5):
        g = (rng.normal(size=N) * 1e-2).astype(dtype)
        on.step(blk, g, 2, scratch, seq=step, onto_board=True)
        off.step(ref_blk, g, 2, scratch, seq=step, onto_board=True)   # no board: in place
        assert blk.live is not None and ref_blk.live is None
        assert blk.version == ref_blk.version == 2 * step
        assert np.array_equal(blk.newest, ref_blk.value)
        for name, arr in ref_blk.state.items():
            assert np.array_equal(np.asarray(blk.state[name]), np.asarray(arr)), name
        # published where readers find it, and nowhere else
        view, ref = board.newest("w/0")
        assert board.holds("w/0", blk.version) and blk.live.ctypes.data == \
            np.frombuffer(view, np.uint8).ctypes.data
        assert bytes(reader.copy(ref, blk.held.nbytes)) == ref_blk.value.tobytes()
        if step < 3:
            assert np.array_equal(blk.held, init)   # the owned values were not written
        if step == 2:                               # asked for: settled, and stepped on after
            assert np.array_equal(blk.value, ref_blk.value) and blk.live is None


def test_a_board_without_room_steps_in_place(board):
    store, blk = _store(OPTS[0], "numpy", board)
    board.failed = "no room (test)"                 # no segment can be added
    before = blk.held.copy()
    store.step(blk, np.ones(N, np.float32), 1, None, seq=1, onto_board=True)
    assert blk.live is None and blk.version == 1
    assert np.array_equal(blk.value, before - np.float32(0.5))


def test_leaving_the_board_settles_every_live_block(board):
    store, blk = _store(OPTS[0], "numba", board)
    store.step(blk, np.ones(N, np.float32), 1, None, seq=1, onto_board=True)
    want = blk.newest.copy()
    assert blk.live is not None
    store.use_board(None)
    assert blk.live is None and np.array_equal(blk.held, want) and store.board is None


# ----------------------------------------------------------------------------- the shard
def _batch(seq: int, grads, primary: str) -> list:
    encs = [wire.encode_tensor("w/0", g) for g in grads]
    return [wire.pack(wire.BATCH, [d for d, _ in encs],
                      parts=[{"p": 0, "seq": seq, "epoch": 1, "o": primary,
                              "e": [{"op": "push", "i": i, "c": "c", "m": 10 * seq + i}
                                    for i in range(len(grads))]}]),
            *[bytes(b) for _, b in encs]]


def _init(sc, opt) -> None:
    init_one_block(sc, opt, N)


@pytest.mark.parametrize("opt", OPTS[1:3], ids=["momentum", "adam"])
def test_a_primary_stepping_onto_its_board_and_a_standby_stepping_in_place_agree(
        board, reader, opt):
    """The same batches (one push, then several summed) to a primary with a board and to a
    standby: the same bits, the same digest, the same exported state; the primary's UPDATE
    names the board's newest version, which holds those bits."""
    primary, standby = CheckedShard("p0"), CheckedShard("s1")   # invariants after each message
    primary.publisher.board = board
    for sc in (primary, standby):
        _init(sc, opt)
    rng = np.random.default_rng(1)
    for seq in range(2, 8):
        grads = [rng.normal(size=N).astype(np.float32) for _ in range(1 + seq % 3)]
        out = primary.handle(_batch(seq, grads, "p0"))
        standby.handle(_batch(seq, grads, "p0"))
        blk, twin = primary.store.blocks["w/0"], standby.store.blocks["w/0"]
        assert blk.live is not None and twin.live is None
        assert np.array_equal(blk.newest, twin.value)
        update = unpack(out[0][1])
        ref = update["t"][0]["r"]
        assert ref == board.newest("w/0")[1] and update["t"][0]["ver"] == twin.version
        assert bytes(reader.copy(ref, blk.held.nbytes)) == twin.value.tobytes()
    assert (primary.replication.partition_digest(0)
            == standby.replication.partition_digest(0))
    got, want = primary.replication.export(0, "x"), standby.replication.export(0, "x")
    assert [bytes(f) for f in got[1:]] == [bytes(f) for f in want[1:]]
    assert primary.store.blocks["w/0"].live is not None      # reading did not settle it
    primary.publisher.board = None                             # the board withdrawn: settled
    assert primary.store.blocks["w/0"].live is None
    assert np.array_equal(primary.store.blocks["w/0"].held, standby.store.blocks["w/0"].value)


def test_a_delta_weights_chain_keeps_its_values_in_hand(board):
    sc = CheckedShard("p0", weights_codec="delta|raw")
    sc.publisher.board = board
    _init(sc, OPTS[0])
    sc.handle(_batch(2, [np.ones(N, np.float32)], "p0"))
    assert sc.store.board is None and sc.store.blocks["w/0"].live is None


def test_board_steps_turned_off_step_in_place_and_copy(board, monkeypatch):
    """``GRADBUS_BOARD_STEP=0``: the store never keeps values on the board (the publisher
    copies them there after each step)."""
    monkeypatch.setenv("GRADBUS_BOARD_STEP", "0")
    store, blk = _store(OPTS[0], "numba", board)
    store.step(blk, np.ones(N, np.float32), 1, None, seq=1, onto_board=True)
    assert store.board is None and blk.live is None and board.newest("w/0") is None
