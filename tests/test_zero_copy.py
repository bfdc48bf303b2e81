"""Pushes that copy nothing: gradient buffers that live in the client's push ring
(``Client.gradient_buffer``), through a real broker and shard processes; and pulls that copy
weights once, out of the shards' boards into the array returned.

A raw push of a gradient buffer sends references to where the buffer is: no other ring slot
is taken for it and the shards apply exactly what was written there. The operator's and the
framework's mistakes are covered: pushing a buffer twice, writing to one after its push,
dropping one unpushed, a full ring, another codec, a client without shared memory."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import gradbus
from gradbus.codecs import shm
from gradbus.codecs.partition import TensorLayout, partition_of
from gradbus.workers.cache import BoardBlock, LiveBlock, WeightCache

from .rigs import gradbus_segments, wait_for

pytestmark = pytest.mark.usefixtures("shm_dir")

LR = 0.25      # powers of two: every intermediate result is exact
BLOCK = 4096


def _free_bytes(ring) -> int:
    return sum(length for a in ring.arenas for _, length in a.free)


def _settled(client) -> None:
    """Every slot of this client's ring is back: nothing held, nothing reserved."""
    ring = client.shm.ring
    wait_for(lambda: not ring.held, 20, "every push's slots freed")
    assert not ring.loose
    assert _free_bytes(ring) == sum(a.seg.size - 64 for a in ring.arenas)


def test_a_raw_push_of_a_gradient_buffer_is_referenced_in_place(make_cluster, shm_dir):
    cluster = make_cluster(1)
    w0 = (np.arange(40_000) % 97).astype(np.float32).reshape(200, 200)
    n = 8
    with gradbus.connect(cluster.url, block_bytes=BLOCK) as c:
        assert c.shm is not None
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        ring = c.shm.ring
        copied = []
        place = ring.place
        ring.place = lambda msg, bufs, digests=None: copied.append(
            sum(memoryview(b).nbytes for b in bufs)) or place(msg, bufs, digests)
        expect = w0.copy()
        for i in range(n):
            buf = c.gradient_buffer("w")
            assert buf.shape == w0.shape and buf.dtype == w0.dtype and buf.flags.writeable
            assert c.shm.in_ring(buf)
            g = np.float32(0.5 * (i + 1))
            buf[...] = g
            before = _free_bytes(ring)
            assert c.push({"w": buf}).result(30)["kind"] == "ack"
            # no slot was taken for the push beyond the buffer itself (it may be freed by now)
            assert _free_bytes(ring) >= before
            assert not buf.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                buf[0, 0] = 1.0
            expect = expect - LR * g
        assert ring.stats["in_place_blocks"] == n * -(-w0.nbytes // BLOCK)
        assert copied == [0] * n                  # nothing was copied into another slot
        got = c.pull(["w"], min_version=n, timeout=30)["w"]
        assert np.array_equal(got, expect)
        _settled(c)
    cluster.stop()
    assert gradbus_segments(shm_dir) == []


def test_a_pushed_buffer_cannot_be_pushed_again(make_cluster):
    cluster = make_cluster(1)
    w0 = np.zeros(5000, np.float32)
    with gradbus.connect(cluster.url, block_bytes=BLOCK) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        buf = c.gradient_buffer("w")
        buf[:] = 1.0
        c.push({"w": buf}).result(30)
        with pytest.raises(ValueError, match="pushed already"):
            c.push({"w": buf})
        with pytest.raises(ValueError, match="pushed already"):
            c.push({"w": buf}, codec="bf16")    # whatever the codec: its bytes are not the caller's
        got = c.pull(["w"], min_version=1, timeout=30)["w"]
        assert np.array_equal(got, np.full(5000, -LR, np.float32))
        assert c.version("w") == 1
        _settled(c)
    cluster.stop()


def test_an_unpushed_buffer_gives_its_slot_back_when_dropped(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, block_bytes=BLOCK) as c:
        c.init({"w": np.zeros(10_000, np.float32)}, optimizer=gradbus.SGD(lr=LR))
        ring = c.shm.ring
        whole = _free_bytes(ring)
        bufs = [c.gradient_buffer("w") for _ in range(5)]
        assert len(ring.loose) == 5 and _free_bytes(ring) <= whole - 5 * 40_000
        view = bufs[0][10:20]             # a view keeps its buffer's slot
        del bufs
        gc.collect()
        assert len(ring.loose) == 1
        del view
        gc.collect()
        assert not ring.loose and _free_bytes(ring) == whole
    cluster.stop()


def test_another_codec_or_accumulation_encodes_the_buffer_and_leaves_it_the_callers(
        make_cluster):
    cluster = make_cluster(1)
    w0 = np.zeros(6000, np.float32)
    with gradbus.connect(cluster.url, block_bytes=BLOCK) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        buf = c.gradient_buffer("w")
        buf[:] = 0.5                                  # exact in bf16
        for _ in range(3):                            # the same buffer, reused: still the caller's
            c.push({"w": buf}, codec="bf16").result(30)
            assert buf.flags.writeable
        c.accumulate(every=2)
        c.push({"w": buf})
        c.push({"w": buf}).result(30)
        assert buf.flags.writeable
        assert c.shm.ring.stats["in_place_blocks"] == 0
        c.accumulate(every=1)
        buf[:] = 1.0
        c.push({"w": buf}).result(30)                 # raw at last: in place
        assert not buf.flags.writeable
        got = c.pull(["w"], min_version=6, timeout=30)["w"]
        assert np.array_equal(got, np.full(6000, -LR * (5 * 0.5 + 1.0), np.float32))
        _settled(c)
    cluster.stop()


def test_a_client_without_shm_or_with_a_full_ring_gets_ordinary_arrays(make_cluster):
    cluster = make_cluster(1)
    w0 = np.zeros(1 << 20, np.float32)                # 4 MiB a buffer
    with gradbus.connect(cluster.url, shm=False) as a:
        a.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        buf = a.gradient_buffer("w")
        assert buf.shape == w0.shape and buf.flags.owndata
        buf[:] = 1.0
        a.push({"w": buf}).result(30)
        assert buf.flags.writeable                    # copied as any array: still the caller's
    with gradbus.connect(cluster.url) as c:
        ring = c.shm.ring
        held = []
        for _ in range(200):                          # the ring's cap is bounded: it runs out
            buf = c.gradient_buffer("w")
            if not c.shm.in_ring(buf):
                break
            held.append(buf)
        else:
            pytest.fail("the ring never ran out")
        assert ring.size <= ring.cap and ring.stats["shm_ring_full"] >= 1
        assert buf.flags.owndata and buf.flags.writeable
        buf[:] = 1.0
        c.push({"w": buf}).result(30)                 # an ordinary push: as frames (ring full)
        held[0][:] = 1.0
        c.push({"w": held[0]}).result(30)             # a reserved one still goes in place
        assert ring.stats["in_place_blocks"] > 0
        got = c.pull(["w"], min_version=3, timeout=30)["w"]
        assert np.array_equal(got, np.full(w0.shape, -3 * LR, np.float32))
        del held, buf
        gc.collect()
        _settled(c)
    cluster.stop()


# ----------------------------------------------------------------------------- pulls from boards
def _board_cache(board, n=8, block=2, P=4):
    """A cache following tensor "w" of ``n`` floats whose blocks are in ``board``, snapshot
    at seq 0, and a function that publishes every block's next value, returning its update."""
    cache = WeightCache(P)
    layout = TensorLayout("w", "float32", (n,), block)
    cache.track(layout)
    keys = layout.block_keys()
    cache.on_snapshot({partition_of(k, P): 0 for k in keys},
                      [(k, np.zeros(block, np.float32), 0, None) for k in keys])
    mapper = shm.Mapper()
    seqs = {}

    def publish(value: float) -> dict:
        """p -> [(key, BoardBlock, version, None)] of one publish of every block."""
        out = {}
        for k in keys:
            p = partition_of(k, P)
            ref = board.write(k, np.full(block, value, np.float32))
            out.setdefault(p, []).append((k, BoardBlock(mapper, ref, np.float32, block),
                                          int(value), None))
        return out

    def apply(updates: dict) -> None:
        for p, blocks in updates.items():
            seqs[p] = seqs.get(p, 0) + 1
            assert not cache.on_update(p, seqs[p], blocks)
            cache.validate_state()

    return cache, publish, apply, mapper


def test_a_pull_reads_board_blocks_once_into_the_array_it_returns():
    board = shm.Board("00c0ffee", segment_bytes=1 << 20)
    cache, publish, apply, mapper = _board_cache(board)
    try:
        apply(publish(1.0))
        first = cache.tensor("w")
        assert np.array_equal(first, np.full(8, 1.0, np.float32)) and not first.flags.writeable
        assert cache.stats["board_reads"] == 4
        assert cache.tensor("w") is first                  # unchanged: the same array again
        assert cache.stats["board_reads"] == 4
        apply(publish(2.0))
        apply(publish(3.0))                                # two publishes before the next read
        second = cache.tensor("w")
        assert np.array_equal(second, np.full(8, 3.0, np.float32))
        assert np.array_equal(first, np.full(8, 1.0, np.float32))   # a read never changes
        assert cache.stats["board_reads"] == 8
    finally:
        mapper.close()
        board.close()


def _live_cache(P: int = 4, block: int = 2):
    """A weight cache following an 8-float tensor in blocks of ``block``: (cache, its block
    keys)."""
    cache = WeightCache(P)
    layout = TensorLayout("w", "float32", (8,), block)
    cache.track(layout)
    return cache, layout.block_keys()


def test_a_live_partition_reads_the_board_needs_no_update_and_resyncs_on_an_epoch_change():
    board = shm.Board("00c0ffee", segment_bytes=1 << 20)
    mapper = shm.Mapper()
    P, block = 4, 2
    cache, keys = _live_cache(P, block)

    def publish(value: float, version: int) -> None:
        for k in keys:
            board.write(k, np.full(block, value, np.float32), version=version, seq=version)

    try:
        publish(1.0, 1)
        parts = {partition_of(k, P) for k in keys}
        cache.on_snapshot({p: 1 for p in parts},
                          [(k, LiveBlock(mapper, board.live_ref(k), np.float32, block), 1, None)
                           for k in keys])
        cache.validate_state()
        assert all(cache.parts[p].live for p in parts) and sorted(cache.newly_live) == \
            sorted(parts)
        first = cache.tensor("w")
        assert np.array_equal(first, np.full(8, 1.0, np.float32)) and cache.version("w") == 1
        reads = cache.stats["live_reads"]
        assert cache.tensor("w") is first and cache.stats["live_reads"] == reads   # unchanged
        publish(2.0, 2)                 # no update: the next read takes the newest anyway
        second = cache.tensor("w")
        assert np.array_equal(second, np.full(8, 2.0, np.float32)) and cache.version("w") == 2
        assert np.array_equal(first, np.full(8, 1.0, np.float32))     # a read never changes
        out = np.empty(8, np.float32)
        publish(3.0, 3)
        assert cache.read_into("w", out) and np.array_equal(out, np.full(8, 3.0, np.float32))
        # updates and heartbeats ahead of a live partition change nothing
        p0 = next(iter(parts))
        assert not cache.on_update(p0, 99, [(keys[0], np.zeros(block, np.float32), 99, None)])
        assert cache.on_heartbeat([p0], [99]) == [] and cache.version("w") == 3
        # the first TABLE says nothing of what the snapshot saw: every live one is asked again
        epochs = [1] * P
        assert sorted(cache.on_table(epochs)) == sorted(parts)
        cache.on_snapshot({p: 3 for p in parts},
                          [(k, LiveBlock(mapper, board.live_ref(k), np.float32, block), 3, None)
                           for k in keys])
        assert cache.on_table(epochs) == []          # the same epochs: nothing moved
        epochs[p0] += 1
        assert cache.on_table(epochs) == [p0] and cache.parts[p0].resync
        cache.validate_state()
        board.forget(keys)              # given up: nothing to read, no version
        assert cache.tensor("w") is None and cache.version("w") == -1
        assert cache.unreadable_live("w") and sorted(cache.stale_keys("w")) == sorted(keys)
    finally:
        mapper.close()
        board.close()


class _PublishesAfterRead:
    """A mapper whose shard writes a newer version of a block right after each read of it."""

    def __init__(self, mapper, publish):
        self.mapper, self.publish = mapper, publish

    def live_version(self, ref):
        return self.mapper.live_version(ref)

    def read_live(self, ref, out):
        got = self.mapper.read_live(ref, out)
        self.publish(ref)
        return got


def test_a_read_names_the_version_it_copied_not_the_one_the_board_holds_after():
    """What a pull returns is the version the caller's next push was computed on (its
    staleness): the oldest block version copied, even when the board moved on at once."""
    board = shm.Board("00c0ffee", segment_bytes=1 << 20)
    mapper = shm.Mapper()
    P, block = 4, 2
    cache, keys = _live_cache(P, block)
    versions = dict.fromkeys(keys, 1)

    def publish(k) -> None:
        versions[k] += 1
        board.write(k, np.full(block, float(versions[k]), np.float32), version=versions[k],
                    seq=versions[k])

    try:
        for k in keys:
            board.write(k, np.full(block, 1.0, np.float32), version=1, seq=1)
        cache.on_snapshot({partition_of(k, P): 1 for k in keys},
                          [(k, LiveBlock(mapper, board.live_ref(k), np.float32, block), 1, None)
                           for k in keys])
        first = cache.tensor("w")
        assert cache.read_versions["w"] == 1 and set(first) == {1.0}
        assert cache.tensor("w") is first and cache.read_versions["w"] == 1   # unchanged
        publish(keys[0])                 # one block ahead: the tensor is at the oldest
        second = cache.tensor("w")
        assert cache.read_versions["w"] == 1 and second[0] == 2.0 and second[-1] == 1.0
        for k in keys[1:]:
            publish(k)
        racing = _PublishesAfterRead(mapper, lambda ref: publish(
            next(k for k in keys if board.live_ref(k) == ref)))
        for k in keys:                   # every read is followed by a newer version at once
            cache.blocks[k].value = LiveBlock(racing, board.live_ref(k), np.float32, block)
        third = cache.tensor("w")
        assert set(third) == {2.0} and cache.read_versions["w"] == 2
        assert cache.version("w") == 3           # where the board is by now
        out = np.empty(8, np.float32)
        assert cache.read_into("w", out) and set(out) == {3.0}
        assert cache.read_versions["w"] == 3 and cache.version("w") == 4
    finally:
        mapper.close()
        board.close()


def test_a_read_of_frames_names_their_version():
    cache, keys = _live_cache()
    P = cache.P
    cache.on_snapshot({partition_of(k, P): 5 for k in keys},
                      [(k, np.full(2, 5.0, np.float32), 5, None) for k in keys])
    assert set(cache.tensor("w")) == {5.0} and cache.read_versions["w"] == 5
    out = np.empty(8, np.float32)
    assert cache.read_into("w", out) and cache.read_versions["w"] == 5


def test_a_live_partition_finds_its_board_again_when_its_shard_is_a_new_process():
    """A restarted shard keeps its name and epoch but writes a new board: the TABLE that shows
    its partitions back up, another primary, or an UPDATE newer than the board, each sends the
    live partition back to be snapshot; the same table again, or an update the board already
    holds, does not."""
    old, new = (shm.Board("00c0ffee", segment_bytes=1 << 20) for _ in range(2))
    mapper = shm.Mapper()
    P, block = 4, 2
    cache, keys = _live_cache(P, block)
    parts = sorted({partition_of(k, P) for k in keys})

    def go_live(board, version):
        for k in keys:
            board.write(k, np.full(block, float(version), np.float32), version=version,
                        seq=version)
        cache.on_snapshot({p: version for p in parts},
                          [(k, LiveBlock(mapper, board.live_ref(k), np.float32, block), version,
                            None) for k in keys])

    try:
        go_live(old, 5)
        owners = ["s0"] * P
        epochs = [1] * P
        assert sorted(cache.on_table(epochs, owners, set())) == parts      # the first TABLE
        go_live(old, 5)
        assert cache.on_table(epochs, owners, set()) == []
        p0 = parts[0]
        # its shard dies: down, nothing to snapshot from yet
        assert cache.on_table(epochs, owners, {p0}) == [] and not cache.parts[p0].resync
        # back up under the same name and epoch: its board is another one
        assert cache.on_table(epochs, owners, set()) == [p0] and cache.parts[p0].resync
        go_live(new, 6)
        assert cache.on_table(epochs, owners, set()) == [] and cache.version("w") == 6
        # another primary, the same epoch (a restarted broker adopted the other copy)
        owners[p0] = "s1"
        assert cache.on_table(epochs, owners, set()) == [p0]
        go_live(new, 6)
        # an update the board already holds changes nothing; one ahead of it (the shard
        # restarted unseen, the client reading the dead board) resyncs
        key0 = next(k for k in keys if partition_of(k, P) == p0)
        assert not cache.live_behind(p0, [(key0, 6)]) and not cache.parts[p0].resync
        go_live(old, 6)     # reading the old board again, which stays at 6
        assert cache.live_behind(p0, [(key0, 7)]) and cache.parts[p0].resync
        assert not cache.live_behind(p0, [(key0, 8)])       # asked once, not again
        go_live(new, 7)
        # a restarted broker (another run id): every live partition is asked again, and the
        # next TABLE, whatever it says, is taken as the first
        assert sorted(cache.forget_table()) == parts and cache.epochs is None
        assert all(cache.parts[p].resync for p in parts)
        go_live(new, 7)
        assert sorted(cache.on_table(epochs, owners, set())) == parts
        cache.validate_state()
    finally:
        mapper.close()
        old.close()
        new.close()


def test_a_block_rewritten_before_the_read_waits_for_its_update():
    board = shm.Board("00c0ffee", segment_bytes=1 << 20)
    cache, publish, apply, mapper = _board_cache(board)
    try:
        apply(publish(1.0))
        publish(2.0)
        later = publish(3.0)         # the block's both versions rewritten: 1.0 is gone
        assert cache.tensor("w") is None
        assert cache.stats["board_rewritten"] == 1
        assert sorted(cache.stale_keys("w")) == sorted(cache.layouts["w"].block_keys())
        apply(later)                  # (2.0's update was lost: the seqs do not say so here)
        assert np.array_equal(cache.tensor("w"), np.full(8, 3.0, np.float32))
        assert cache.stale_keys("w") == []
        # a board gone altogether (its shard stopped) reads as rewritten, never as garbage
        stale = publish(4.0)
        apply(stale)
        board.close()
        mapper.close()
        assert cache.tensor("w") is None
    finally:
        mapper.close()
        board.close()


def test_a_pull_whose_board_block_never_gets_its_update_snapshots_it_again(make_cluster):
    """A block read from a board that has no version of it any more (here: a live ref forged
    to a slot never written) is snapshot again at once: no update would bring it; and a
    block held by an update's ref whose bytes were rewritten and whose newer update never
    comes is snapshot again after REWRITTEN_WAIT."""
    cluster = make_cluster(1)
    w0 = (np.arange(6000) % 31).astype(np.float32)
    with gradbus.connect(cluster.url, block_bytes=BLOCK) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        c.push({"w": np.ones(6000, np.float32)}).result(30)
        expect = w0 - LR
        assert np.array_equal(c.pull(["w"], min_version=1, timeout=30)["w"], expect)
        with c._cond:
            key, blk = next(iter(c.cache.blocks.items()))
            v = blk.value
            assert type(v) is LiveBlock
            seg = v.mapper.segment(v.ref[0])
            blk.value = LiveBlock(v.mapper, [v.ref[0], seg.size - 2 * (v.ref[2] + shm.ALIGN),
                                             v.ref[2]], v.dtype, v.size)    # nothing there
            c.cache.joined.clear()
        got = c.pull(["w"], timeout=30)["w"]
        assert np.array_equal(got, expect)
        assert c.stats["board_refreshes"] == 0
        assert type(c.cache.blocks[key].value) is LiveBlock and \
            c.cache.blocks[key].value.ref == v.ref         # found where it is again
        with c._cond:
            blk = c.cache.blocks[key]
            c.cache.parts[partition_of(key, c.partitions)].live = False
            blk.value = BoardBlock(v.mapper, [v.ref[0], v.ref[1] + shm.ALIGN, 12345], v.dtype,
                                   v.size)                 # an update's ref, long rewritten
            c.cache.joined.clear()
        got = c.pull(["w"], timeout=30)["w"]
        assert np.array_equal(got, expect)
        assert c.stats["board_refreshes"] == 1
        assert type(c.cache.blocks[key].value) is LiveBlock       # the snapshot's ref
        # a read that found a block rewritten, then one that succeeded: a later rewrite waits
        # REWRITTEN_WAIT afresh, not from the first
        with c._cond:
            c._refresh_rewritten(["w"], {"w": None})
        assert "w" in c._rewritten
        c.pull(["w"])
        assert "w" not in c._rewritten and c.stats["board_refreshes"] == 1
    cluster.stop()


def test_a_joined_tensor_of_blocks_held_as_bytes_is_kept_only_while_the_caller_holds_it():
    cache = WeightCache(4)
    layout = TensorLayout("w", "float32", (8,), 2)
    cache.track(layout)
    keys = layout.block_keys()
    cache.on_snapshot({partition_of(k, 4): 0 for k in keys},
                      [(k, np.full(2, i, np.float32), 0, None) for i, k in enumerate(keys)])
    first = cache.tensor("w")
    assert np.array_equal(first, np.repeat(np.arange(4, dtype=np.float32), 2))
    assert cache.tensor("w") is first
    del first
    gc.collect()
    assert cache.joined["w"]() is None          # the cache did not keep a second copy
    again = cache.tensor("w")
    assert np.array_equal(again, np.repeat(np.arange(4, dtype=np.float32), 2))
    assert not again.flags.writeable
    cache.validate_state()


@pytest.mark.parametrize("shm_on", [True, False], ids=["boards", "frames"])
def test_a_pull_into_the_callers_arrays_copies_there_once(make_cluster, shm_on):
    cluster = make_cluster(1)
    w0 = (np.arange(9000) % 17).astype(np.float32).reshape(90, 100)
    b0 = np.arange(3, dtype=np.float64)
    with gradbus.connect(cluster.url, block_bytes=BLOCK, shm=shm_on) as c:
        assert (c.shm is not None) == shm_on
        c.init({"w": w0, "b": b0}, optimizer=gradbus.SGD(lr=LR))
        w, b = np.empty((90, 100), np.float32), np.empty(3, np.float64)
        got = c.pull(out={"w": w, "b": b})          # the names of out: the tensors pulled
        assert got["w"] is w and got["b"] is b
        assert np.array_equal(w, w0) and np.array_equal(b, b0)
        c.push({"w": np.ones_like(w0), "b": np.ones_like(b0)}).result(30)
        flat = np.empty(9000, np.float32)            # another shape of the same size is fine
        got = c.pull(["w", "b"], min_version=1, timeout=30, out={"w": flat})
        assert got["w"] is flat and np.array_equal(flat, (w0 - LR).reshape(-1))
        assert np.array_equal(got["b"], b0 - LR) and not got["b"].flags.writeable
        assert np.array_equal(w, w0)                 # an earlier pull's array is not touched
        for bad in (np.empty(9000, np.float64), np.empty(8999, np.float32),
                    np.empty((100, 90), np.float32).T, w0[::1].copy().view()[::2]):
            with pytest.raises(ValueError, match="out"):
                c.pull(["w"], out={"w": bad})
        ro = np.empty(9000, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            c.pull(["w"], out={"w": ro})
        with pytest.raises(ValueError, match="not pulled"):
            c.pull(["b"], out={"w": flat})
    cluster.stop()


def test_weights_held_as_board_references_outlive_their_shard(make_cluster, shm_dir):
    """The cache reads a dead shard's last weights from its board: the board is mapped when a
    snapshot names it, so once the shard is SIGKILLed and its board swept, a pull still
    returns those weights (as it does for weights held as bytes)."""
    cluster = make_cluster(1)
    w0 = (np.arange(5000) % 13).astype(np.float32)
    with gradbus.connect(cluster.url, block_bytes=BLOCK) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR))
        c.pull(["w"])
        for _ in range(3):
            c.push({"w": np.ones(5000, np.float32)}).result(30)
        wait_for(lambda: c.version("w") == 3, 20, "the weights at version 3")
        assert all(type(b.value) is LiveBlock for b in c.cache.blocks.values())
        pid = cluster.shard_procs["shard-0"].pid
        boards = {n for n in os.listdir(shm_dir) if f"-s{pid}-" in n}
        assert boards
        cluster.kill_shard("shard-0")
        wait_for(lambda: not boards & set(os.listdir(shm_dir)), 30, "the dead shard's board swept")
        got = c.pull(["w"], timeout=10)["w"]
        assert np.array_equal(got, w0 - 3 * LR)
        assert c.stats["board_refreshes"] == 0
    cluster.stop()


def test_accumulation_by_threshold_sends_a_sum_whose_weights_cannot_be_read_now():
    """The threshold filter compares a sum with the weights' norm; with a block rewritten in
    its board (unreadable until its update comes) the sum is sent, never an error."""
    import collections

    from gradbus.workers.pipeline import PushPipeline
    board = shm.Board("00c0ffee", segment_bytes=1 << 20)
    cache, publish, apply, mapper = _board_cache(board, n=8, block=8, P=1)
    try:
        apply(publish(1.0))
        pipe = PushPipeline(cache, True, np.random.default_rng(0))
        pipe.configure(1, threshold=10.0)
        stats = collections.Counter()
        small = {"w": np.full(8, 0.01, np.float32)}
        assert pipe.add(small, "raw", 1, stats)[0] == {}          # below 10x the weights' norm
        publish(2.0)
        publish(3.0)                                              # 1.0 rewritten twice
        cache.joined.clear()            # (else the read before is served again, as it was)
        assert cache.tensor("w") is None
        due, counts = pipe.add(small, "raw", 1, stats)
        assert list(due) == ["w"] and counts == {"w": 2}
        assert np.allclose(due["w"], 0.02)
    finally:
        mapper.close()
        board.close()


class _AheadAfterRead:
    """A client's mapper whose board, right after each read, says a newer version is there
    (a shard that published between the read and anything after it)."""

    def __init__(self, mapper):
        self.mapper, self.reads = mapper, 0

    def __getattr__(self, name):
        return getattr(self.mapper, name)

    def live_version(self, ref):
        got = self.mapper.live_version(ref)
        return got and (got[0], got[1] + 5 * self.reads)

    def read_live(self, ref, out):
        got = self.mapper.read_live(ref, out)
        self.reads += 1
        return got


def test_a_pull_records_the_version_it_returned_for_the_next_push(make_cluster):
    """An ssp tensor's push carries the version its weights were pulled at: the one the pull
    copied, not a newer one the board holds by the time the pull returns (that would hide
    staleness)."""
    cluster = make_cluster(1)
    w0 = np.zeros(1000, np.float32)
    with gradbus.connect(cluster.url) as c:
        c.init({"w": w0}, optimizer=gradbus.SGD(lr=LR), consistency="ssp:1000")
        for _ in range(3):
            c.push({"w": np.ones(1000, np.float32)}).result(30)
        c.pull(["w"], min_version=3, timeout=30)
        with c._cond:
            (key, blk), = c.cache.blocks.items()
            assert type(blk.value) is LiveBlock
            racing = _AheadAfterRead(blk.value.mapper)
            blk.value = LiveBlock(racing, blk.value.ref, blk.value.dtype, blk.value.size)
            c.cache.joined.clear()
        got = c.pull(["w"], timeout=30)["w"]
        assert racing.reads == 1 and np.array_equal(got, np.full(1000, -3 * LR, np.float32))
        assert c.cache.version("w") == 8                 # what the board says by now
        assert c.versions.pulled["w"] == 3               # what was read
