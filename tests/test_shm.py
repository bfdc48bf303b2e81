"""Shared-memory segments without sockets: ring slots, the weights board's seqlock (against a
writer in another process), what a reader refuses, the broker's offer, sweeping dead owners'
segments, and a shared-memory directory with no room (a small tmpfs).

Every test has a shared-memory directory of its own (``$GRADBUS_SHM_DIR``) and leaves it
without a gradbus segment."""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from gradbus.codecs import shm
from gradbus.codecs.errors import Code, WireError

from .child import ROOT
from .rigs import end_code, spawn_code

pytestmark = pytest.mark.usefixtures("shm_dir")

CLUSTER = "0badc0de"
OTHER = "12345678"

# ----------------------------------------------------------------------------- the push ring
def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_ring_places_exact_bytes_a_peer_reads_and_reuses_freed_slots_first_fit():
    ring = shm.Ring(CLUSTER, cap=64 << 20)
    reader = shm.Mapper()
    try:
        assert len(ring.arenas) == 1
        seg = ring.arenas[0].seg.name
        bufs = {1: _bytes(1000, 1), 2: _bytes(2000, 2), 3: _bytes(64, 3)}
        refs = {m: ring.place(m, [b]) for m, b in bufs.items()}
        # slots one after the other, each on a cache line: 1000 -> 1024 B, 2000 -> 2048 B
        h = shm.HEADER
        assert [refs[m][0] for m in (1, 2, 3)] == [[seg, h], [seg, h + 1024],
                                                  [seg, h + 1024 + 2048]]
        for m, b in bufs.items():      # what a peer process sees: a read-only mapping of its own
            assert bytes(reader.view(refs[m][0], len(b))) == b
        assert ring.free([1, 99]) == 1          # an id not held is ignored
        assert set(ring.held) == {2, 3}
        four = _bytes(500, 4)
        assert ring.place(4, [four]) == [[seg, h]]      # first fit: the hole msg 1 left
        assert bytes(reader.view([seg, h], 500)) == four
        # a push of several tensors: a slot each, freed together
        five = [_bytes(100, 5), b"", _bytes(3000, 6)]
        r5 = ring.place(5, five)
        assert len(r5) == 3 and len({r[1] for r in r5}) == 3
        assert bytes(reader.view(r5[2], 3000)) == five[2]
        assert ring.free([5]) == 1 and ring.free([5]) == 0
    finally:
        reader.close()
        ring.close()


def test_ring_frees_out_of_order_coalesce_into_one_hole():
    ring = shm.Ring(CLUSTER, cap=64 << 20)
    try:
        arena = ring.arenas[0]
        for m in range(1, 6):
            ring.place(m, [bytes(1024)])      # five slots of 1 KiB from the data start
        # out of order: the middle, then its neighbours, then the ends
        for m in (3, 2, 4, 5):
            ring.free([m])
        h = shm.HEADER
        assert arena.free == [(h + 1024, arena.seg.size - h - 1024)]     # one hole, merged
        ring.free([1])
        assert arena.idle()
        # the merged hole takes a slot none of the single ones could
        assert ring.place(6, [bytes(5 * 1024)])[0][1] == h
        ring.free([6])
        assert arena.idle() and not ring.held
    finally:
        ring.close()


def test_ring_at_its_cap_holds_nothing_for_the_push_and_recovers_after_free():
    first = shm.MIN_RING_SEGMENT
    ring = shm.Ring(CLUSTER, cap=first + 4096, first=first)    # one segment, no room to grow
    try:
        assert len(ring.arenas) == 1
        arena = ring.arenas[0]
        data = arena.seg.size - shm.HEADER
        assert ring.place(1, [bytes(data - 4096)]) is not None
        before = list(arena.free)
        # the first tensor would fit, the second not: nothing of the push stays held
        assert ring.place(2, [bytes(1024), bytes(8192)]) is None
        assert 2 not in ring.held and arena.free == before
        assert ring.stats["shm_ring_full"] == 1
        assert len(ring.arenas) == 1 and ring.failed is None     # at its cap, not broken
        ring.free([1])
        assert ring.place(3, [bytes(1024), bytes(8192)]) is not None     # room again
        ring.free([3])
        assert arena.idle()
    finally:
        ring.close()


# ----------------------------------------------------------------------------- the board
def test_board_copies_are_exact_and_a_reader_two_versions_behind_gets_none():
    board = shm.Board(CLUSTER, segment_bytes=1 << 20)
    reader = shm.Mapper()
    try:
        a, b, c = (np.arange(1000, dtype=np.float32) * k for k in (1, 2, 3))
        ra = board.write("w/0", a)
        assert ra[0] == board.arenas[0].seg.name and 1 <= ra[2] < 1 << 57
        assert bytes(reader.copy(ra, a.nbytes)) == a.tobytes()
        rb = board.write("w/0", b)
        assert rb[1] != ra[1] and rb[2] == ra[2] + 1      # the other version of the block
        assert bytes(reader.copy(rb, b.nbytes)) == b.tobytes()
        assert bytes(reader.copy(ra, a.nbytes)) == a.tobytes()    # one behind: still whole
        rc = board.write("w/0", c)
        assert rc[1] == ra[1]                              # back to the first version's place
        assert reader.copy(ra, a.nbytes) is None           # two behind: rewritten, refused
        assert bytes(reader.copy(rc, c.nbytes)) == c.tobytes()
        # a block that grows gets a new place; its old refs are stale
        big = np.ones(5000, np.float32)
        rbig = board.write("w/0", big)
        assert bytes(reader.copy(rbig, big.nbytes)) == big.tobytes()
        # a second block has its own place
        r1 = board.write("w/1", a[:10])
        assert bytes(reader.copy(r1, 40)) == a[:10].tobytes()
        assert bytes(reader.copy(rbig, big.nbytes)) == big.tobytes()
    finally:
        reader.close()
        board.close()


BOARD_WRITER = """
import json, select, sys
import numpy as np
from gradbus.codecs import shm
n = int(sys.argv[2])
board = shm.Board(sys.argv[1], segment_bytes=4 << 20)
def publish():      # every byte of a version is its stamp mod 251
    return board.write("k", np.full(n, (board.stamp + 1) % 251, np.uint8))
print(json.dumps([publish(), publish()]), flush=True)
i = 0
while True:
    i += 1
    if i % 8 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
    publish()
board.close()
"""


def test_board_reads_against_a_writer_process_are_never_torn():
    """A writer process republishes one block as fast as it can, every version constant-valued
    (its stamp mod 251); the reader copies whatever version is current. Every copy returned is
    the whole version its stamp names; raw reads without the stamp checks do see torn blocks,
    so the race is real."""
    n = 256 << 10
    proc = spawn_code(BOARD_WRITER, CLUSTER, n)
    reader = shm.Mapper()
    try:
        refs = json.loads(proc.stdout.readline())
        seg = reader.segment(refs[0][0])
        whole = stale = raw_torn = 0
        word = struct.Struct("<Q")
        deadline = time.monotonic() + 30
        while (whole < 300 or stale < 1 or raw_torn < 1) and time.monotonic() < deadline:
            for name, off, _ in refs:
                stamp = word.unpack_from(seg.view, off - shm.ALIGN)[0]
                if stamp == 0 or stamp == (1 << 64) - 1:     # mid-write: no stamp to ask for
                    continue
                got = reader.copy([name, off, stamp], n)
                if got is None:
                    stale += 1
                else:
                    v = np.frombuffer(got, np.uint8)
                    assert v.min() == v.max() == stamp % 251, (stamp, v.min(), v.max())
                    whole += 1
                raw = np.frombuffer(bytes(seg.view[off:off + n]), np.uint8)
                raw_torn += int(raw.min() != raw.max())
        assert whole >= 300 and stale >= 1, (whole, stale)
        assert raw_torn >= 1, "the writer never overlapped a read: the test proved nothing"
    finally:
        reader.close()
        assert end_code(proc) == 0


# ----------------------------------------------------------------------------- what a reader refuses
def _refused(fn):
    with pytest.raises(WireError) as e:
        fn()
    assert e.value.code == Code.BAD_FIELD
    return str(e.value)


def test_mapper_refuses_foreign_names_out_of_bounds_offsets_open_modes_and_bad_magic(shm_dir):
    ring = shm.Ring(CLUSTER, cap=64 << 20)
    m = shm.Mapper()
    try:
        seg = ring.arenas[0].seg
        for bad in ("passwd", "../gradbus-0badc0de-w1-2-3-abcd", "gradbus-0BADC0DE-w1-2-3-abcd",
                    "gradbus-0badc0de-x1-2-3-abcd", seg.name + "/x", "", 7, None):
            _refused(lambda bad=bad: m.view([bad, shm.HEADER], 8))
        _refused(lambda: m.view([seg.name, 0], 8))                   # inside the header
        _refused(lambda: m.view([seg.name, shm.HEADER - 1], 1))
        _refused(lambda: m.view([seg.name, seg.size - 8], 16))       # past the end
        _refused(lambda: m.view([seg.name, shm.HEADER], -1))
        _refused(lambda: m.copy([seg.name, shm.HEADER, 1], 8))       # no stamp word before it
        _refused(lambda: m.copy([seg.name, seg.size, 1], 1))
        assert bytes(m.view([seg.name, seg.size - 8], 8)) == bytes(8)     # the last bytes: fine
        # a name that matches but is gone
        _refused(lambda: m.segment(shm.segment_name(CLUSTER, "w")))
        # open to others (0644): refused even though it is a real segment
        other = shm.Segment.create(CLUSTER, "s", 4096)
        os.chmod(other.path, 0o644)
        assert "private" in _refused(lambda: shm.Mapper().segment(other.name))
        other.close()
        # the right name and mode, but not a gradbus segment
        fake = os.path.join(shm_dir, shm.segment_name(CLUSTER, "s"))
        fd = os.open(fake, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        os.write(fd, b"NOTGRADB" + bytes(8184))
        os.close(fd)
        assert "not a gradbus segment" in _refused(lambda: shm.Mapper().segment(
            os.path.basename(fake)))
        os.unlink(fake)
        # too small to be one, and a symbolic link to a real one
        fd = os.open(fake, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        os.write(fd, shm.MAGIC)
        os.close(fd)
        _refused(lambda: shm.Mapper().segment(os.path.basename(fake)))
        os.unlink(fake)
        os.symlink(seg.path, fake)
        _refused(lambda: shm.Mapper().segment(os.path.basename(fake)))
        os.unlink(fake)
    finally:
        m.close()
        ring.close()


def test_accept_takes_an_offer_only_with_the_same_host_and_the_probes_nonce():
    probe = shm.Segment.create(CLUSTER, "b", 4096)
    try:
        offer = {"cluster": CLUSTER, "seg": probe.name, "nonce": probe.nonce,
                 "host": shm.host_identity()}
        assert shm.accept(offer) == CLUSTER
        assert shm.accept({**offer, "host": "another-boot:0:/dev/shm"}) is None
        assert shm.accept({**offer, "nonce": bytes(16)}) is None
        assert shm.accept({**offer, "nonce": probe.nonce.hex()}) is None
        assert shm.accept({**offer, "cluster": "0BADC0DE"}) is None
        assert shm.accept({**offer, "seg": shm.segment_name(CLUSTER, "b")}) is None   # gone
        assert shm.accept({**offer, "seg": "../probe"}) is None
        assert shm.accept(None) is None and shm.accept("yes") is None
        os.chmod(probe.path, 0o644)
        assert shm.accept(offer) is None
    finally:
        probe.close()


# ----------------------------------------------------------------------------- sweeping
SEGMENT_OWNER = """
import sys
from gradbus.codecs import shm
segs = [shm.Segment.create(c, r, 4096) for c, r in (("0badc0de", "w"), ("0badc0de", "s"),
                                                     ("12345678", "w"))]
print(" ".join(s.name for s in segs), flush=True)
sys.stdin.read()
for s in segs:
    s.close()
"""


def test_sweep_removes_a_dead_owners_segments_only(shm_dir):
    dead = spawn_code(SEGMENT_OWNER)
    live = spawn_code(SEGMENT_OWNER)
    mine = shm.Segment.create(CLUSTER, "w", 4096)
    try:
        dead_names = dead.stdout.readline().split()
        live_names = live.stdout.readline().split()
        assert [shm.owned(n)[2] for n in dead_names] == [dead.pid] * 3
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        # another pid namespace's segment: its pid means nothing here, whatever it is
        ns = shm.owned(mine.name)[3]
        foreign = f"gradbus-{CLUSTER}-w{dead.pid}-{ns + 1}-0-abcd"
        fd = os.open(os.path.join(shm_dir, foreign), os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        assert set(dead_names + live_names + [mine.name, foreign]) <= set(shm.segments())
        assert shm.sweep(CLUSTER, keep={dead_names[1]}) == [dead_names[0]]
        assert sorted(shm.sweep(CLUSTER)) == [dead_names[1]]
        assert shm.sweep(CLUSTER) == []
        left = set(shm.segments())
        assert dead_names[2] in left and foreign in left          # another cluster's
        assert set(live_names) <= left and mine.name in left      # live owners'
        assert shm.segments(OTHER) == sorted([dead_names[2], live_names[2]])
        assert shm.sweep(roles="s") == [] and shm.sweep() == [dead_names[2]]
        os.unlink(os.path.join(shm_dir, foreign))
    finally:
        if dead.poll() is None:
            dead.kill()
        end_code(dead)
        assert end_code(live) == 0
        mine.close()
    assert shm.segments() == []


def test_a_zombie_owner_counts_as_dead():
    proc = spawn_code(SEGMENT_OWNER)
    try:
        names = proc.stdout.readline().split()
        proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:       # dead, not reaped
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    break
            select.select([], [], [], 0.02)
        assert sorted(shm.sweep()) == sorted(names)
    finally:
        end_code(proc)


def test_a_sweep_asks_once_per_owner_however_many_segments_it_owns(monkeypatch):
    """A client owns its ring's segments and more: a sweep checks each owner once (every check
    reads /proc), and still finds every segment of a dead one."""
    live = spawn_code(SEGMENT_OWNER)
    dead = spawn_code(SEGMENT_OWNER)
    try:
        live_names, dead_names = live.stdout.readline().split(), dead.stdout.readline().split()
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        asked = []
        check = shm._alive
        monkeypatch.setattr(shm, "_alive", lambda pid: asked.append(pid) or check(pid))
        assert sorted(shm.dead_segments()) == sorted(dead_names)
        assert sorted(asked) == sorted([live.pid, dead.pid])     # 6 segments, 2 owners
        assert sorted(shm.sweep()) == sorted(dead_names)
        assert set(live_names) <= set(shm.segments())
    finally:
        if dead.poll() is None:
            dead.kill()
        end_code(dead)
        assert end_code(live) == 0


# ----------------------------------------------------------------------------- no room
def test_a_full_directory_is_an_error_at_creation_and_the_ring_falls_back(small_tmpfs, caplog):
    d = small_tmpfs("2m")
    with pytest.raises(shm.ShmFull):
        shm.Segment.create(CLUSTER, "w", 4 << 20)
    assert os.listdir(d) == []             # nothing half made is left
    caplog.set_level(logging.WARNING, logger="gradbus.shm")
    ring = shm.Ring(CLUSTER, cap=64 << 20)     # its first segment (8 MiB) does not fit
    try:
        assert ring.arenas == [] and ring.failed is not None
        for m in range(5):
            assert ring.place(m, [bytes(100)]) is None
        assert not ring.held and ring.stats["shm_ring_full"] == 5
        warned = [r for r in caplog.records if r.name == "gradbus.shm"
                  and r.levelno == logging.WARNING]
        assert len(warned) == 1 and "frames" in warned[0].getMessage()
    finally:
        ring.close()
    board = shm.Board(CLUSTER)                 # 64 MiB: no room either; blocks go as frames
    try:
        assert board.failed is not None and board.write("w/0", bytes(64)) is None
    finally:
        board.close()
    assert os.listdir(d) == []


FILL_THEN_WRITE = """
import errno, os, sys
from gradbus.codecs import shm
seg = shm.Segment.create("0badc0de", "w", 1 << 20)
with open(os.path.join(sys.argv[1], "filler"), "wb", buffering=0) as f:   # every page left
    try:
        while True:
            f.write(bytes(64 << 10))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
try:
    shm.Segment.create("0badc0de", "w", 1 << 20)
    raise SystemExit("a segment was made in a full directory")
except shm.ShmFull:
    pass
seg.view[shm.HEADER:] = b"\\x5a" * (seg.size - shm.HEADER)     # every page of it: no SIGBUS
assert bytes(seg.view[seg.size - 4:]) == b"ZZZZ"
seg.close()
os.unlink(os.path.join(sys.argv[1], "filler"))
print("ok", flush=True)
"""


def test_a_segment_made_before_the_directory_filled_up_is_fully_writable(small_tmpfs):
    """The pages are reserved at creation: filling the tmpfs afterwards and then writing every
    page of the segment never faults (a SIGBUS would end the child with -7)."""
    d = small_tmpfs("2m")
    proc = spawn_code(FILL_THEN_WRITE, d)
    out = proc.stdout.read()
    assert end_code(proc) == 0 and out.strip() == "ok"
    assert os.listdir(d) == []


def test_sweep_abandoned_removes_only_clusters_nobody_is_left_in(shm_dir):
    code = ("import os; from gradbus.codecs import shm; "
            "print(*[shm.Ring(t, 1 << 20, first=1 << 20, role='b').arenas[0].seg.name "
            "for t in ('0000dead', '0000a11e')], flush=True); os._exit(0)")
    dead_here, dead_there = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                           text=True, timeout=60, check=True,
                                           cwd=ROOT).stdout.split()
    live = shm.Ring("0000a11e", 1 << 20, first=1 << 20)    # this process is alive in 0000a11e
    try:
        removed = shm.sweep_abandoned()
        assert removed == [dead_here]
        assert sorted(os.listdir(shm_dir)) == sorted([dead_there, live.arenas[0].seg.name])
    finally:
        live.close()
        shm.sweep("0000a11e")


def test_boards_stamps_start_apart_so_reused_bytes_do_not_pass_for_a_given_up_block():
    """A partition that moved away gives its blocks' slots up; bytes written there later are
    checked against an old ref's stamp only where they happen to equal it, which a random
    start makes as good as impossible (small integers would, against stamps counted from 0)."""
    one, two = shm.Board(CLUSTER, 1 << 20), shm.Board(CLUSTER, 1 << 20)
    reader = shm.Mapper()
    try:
        one.write("w/0", np.zeros(16, np.int64))
        ref = one.write("w/0", np.zeros(16, np.int64))      # the block's second version
        assert two.write("w/0", np.zeros(16, np.int64))[2] not in (ref[2], ref[2] - 1)
        one.forget(["w/0"])
        for n in range(1, 25):          # blocks of small integers over where its stamp was
            for v in range(40):
                one.write(f"x/{n}", np.full(n, v, np.int64))
                assert reader.copy(ref, 128) is None, (n, v)
    finally:
        reader.close()
        one.close()
        two.close()


# ----------------------------------------------------------------------------- live reads
def test_a_live_ref_reads_the_newest_version_with_its_version_and_nothing_once_given_up():
    board = shm.Board(CLUSTER, segment_bytes=1 << 20)
    reader = shm.Mapper()
    try:
        assert board.live_ref("w/0") is None            # never written
        a = np.arange(1000, dtype=np.float32)
        board.write("w/0", a, version=3, seq=7)
        ref = board.live_ref("w/0")
        out = np.empty(1000, np.float32)
        stamp, version = reader.read_live(ref, memoryview(out).cast("B"))
        assert version == 3 and np.array_equal(out, a)
        assert reader.live_version(ref) == (stamp, 3)
        assert board.holds("w/0", 3) and not board.holds("w/0", 4)
        for k in range(4, 9):                            # the newest of the two versions
            board.write("w/0", a * k, version=k, seq=k)
            got = reader.read_live(ref, memoryview(out).cast("B"))
            assert got[1] == k and got[0] > stamp and np.array_equal(out, a * k)
            stamp = got[0]
        assert reader.read_live(ref, memoryview(out[:10]).cast("B")) is None   # other size
        board.forget(["w/0"])                            # its partition moved: given up
        assert reader.read_live(ref, memoryview(out).cast("B")) is None
        assert reader.live_version(ref) is None
        with pytest.raises(WireError):
            reader.live_version([ref[0], 3, ref[2]])     # no slot
    finally:
        reader.close()
        board.close()


LIVE_WRITER = """
import json, select, sys
import numpy as np
from gradbus.codecs import shm
n = int(sys.argv[2])
board = shm.Board(sys.argv[1], segment_bytes=4 << 20)
k = 0
def publish():      # version k: every byte k mod 251
    global k
    k += 1
    board.write("k", np.full(n, k % 251, np.uint8), version=k, seq=k)
publish()
print(json.dumps(board.live_ref("k")), flush=True)
i = 0
while True:
    i += 1
    if i % 8 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
    publish()
board.close()
"""


def test_live_reads_against_a_writer_process_are_whole_and_never_go_back():
    """A writer process republishes one block as fast as it can (version k all k mod 251);
    every live read is one whole version, and versions read never decrease."""
    n = 256 << 10
    proc = spawn_code(LIVE_WRITER, CLUSTER, n)
    reader = shm.Mapper()
    try:
        ref = json.loads(proc.stdout.readline())
        out = np.empty(n, np.uint8)
        last, reads, failed = 0, 0, 0
        deadline = time.monotonic() + 30
        # at least 300 reads, and on until the writer has moved on (on a busy machine it may
        # get no CPU while the first 300 are made)
        while (reads < 300 or last <= 1) and time.monotonic() < deadline:
            got = reader.read_live(ref, memoryview(out))
            if got is None:
                failed += 1
                continue
            _, version = got
            assert out.min() == out.max() == version % 251, (version, out.min(), out.max())
            assert version >= last
            last = version
            reads += 1
        assert reads >= 300 and last > 1, (reads, failed, last)
    finally:
        reader.close()
        assert end_code(proc) == 0


def test_a_reader_unmaps_segments_that_are_gone_once_unused_for_long_enough():
    live, dead = shm.Ring(CLUSTER, 1 << 20), shm.Ring(CLUSTER, 1 << 20)
    reader = shm.Mapper()
    try:
        refs = [r.place(1, [b"x" * 64])[0] for r in (live, dead)]
        for ref in refs:
            assert bytes(reader.view(ref, 64)) == b"x" * 64
        dead.close()                          # its owner removed it: gone from the directory
        assert reader.prune(idle=3600) == 0   # used just now: kept (a batch may still name it)
        assert reader.prune(idle=0) == 1
        assert set(reader.segs) == {refs[0][0]} and set(reader.used) == {refs[0][0]}
        assert bytes(reader.view(refs[0], 64)) == b"x" * 64
        assert reader.prune(idle=0) == 0      # a segment still there is never unmapped
    finally:
        reader.close()
        live.close()
        dead.close()
