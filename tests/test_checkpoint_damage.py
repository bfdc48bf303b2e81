"""Damaged checkpoints are refused, each with a message naming the file and what is wrong: a
garbage MANIFEST, a partition file from another checkpoint, a missing partition file, a flipped
header byte. Restore falls back to an older checkpoint only when told to, and then says so."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gradbus.codecs import wire
from gradbus.codecs.errors import WireError
from gradbus.shards import checkpoint

from .rigs import ADAM, RepRig, init_msg, push_msg

DAMAGES = ["manifest", "older_file", "missing_file", "header_byte"]


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints at t=1 and t=2 of one shard, with pushes between them (so every partition
    is at another seq in the second)."""
    rig = RepRig(("s0",))
    frames, layout = init_msg(1, "w", np.arange(40, dtype=np.float32), opt=ADAM)
    rig.client(b"c", frames)
    rng = np.random.default_rng(0)
    root = str(tmp_path / "data")
    cks = []
    for t in (1.0, 2.0):
        for m in range(int(t) * 10, int(t) * 10 + 5):
            rig.client(b"c", push_msg(m, layout, rng.standard_normal(40).astype(np.float32)))
        cks.append(checkpoint.write(root, "s0", rig.shards["s0"].states(), keep=3, now=t))
    assert cks[0].partitions != cks[1].partitions
    return root, cks[0], cks[1]


def _damage(kind: str, old: checkpoint.Checkpoint, new: checkpoint.Checkpoint) -> str:
    """Damage ``new`` the ``kind`` way; the file damaged."""
    if kind == "manifest":
        path = os.path.join(new.path, checkpoint.MANIFEST)
        with open(path, "wb") as f:
            f.write(b"\x93garbage, not a manifest")
        return path
    p = new.partitions[0][0]
    path = os.path.join(new.path, f"p{p:05d}.gbs")
    if kind == "older_file":
        shutil.copyfile(os.path.join(old.path, f"p{p:05d}.gbs"), path)
    elif kind == "missing_file":
        os.remove(path)
    else:
        with open(path, "rb") as f:
            data = bytearray(f.read())
        at = data.index(wire.STATE.encode(), len(checkpoint.MAGIC) + 4)   # the kind's value
        data[at] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(data))
    return path


WHAT = {"manifest": "not a msgpack manifest",
        "older_file": "where the MANIFEST says partition",
        "missing_file": "cannot be read",
        "header_byte": "UNKNOWN_KIND"}


@pytest.mark.parametrize("kind", DAMAGES)
def test_each_damage_is_refused_naming_the_file(two_checkpoints, kind):
    root, old, new = two_checkpoints
    path = _damage(kind, old, new)
    with pytest.raises(WireError) as e:
        checkpoint.load(checkpoint.newest(root, "s0"))
    assert path in str(e.value) and WHAT[kind] in str(e.value), str(e.value)
    assert isinstance(e.value, checkpoint.DamagedCheckpoint) and e.value.path == path


def test_a_garbage_manifest_is_no_silent_fallback(two_checkpoints):
    root, old, new = two_checkpoints
    path = _damage("manifest", old, new)
    with pytest.raises(WireError, match="refusing to restore an older checkpoint") as e:
        checkpoint.newest(root, "s0")
    assert path in str(e.value)
    assert checkpoint.newest(root, "s0", at=1.5) == old    # what was asked for is intact
    assert checkpoint.shards_in(root) == ["s0"]
    shutil.rmtree(old.path)                     # its only checkpoint damaged: still listed
    assert checkpoint.shards_in(root) == ["s0"]


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_fallback_when_asked_for_names_the_damaged_checkpoint(two_checkpoints, caplog, kind):
    root, old, new = two_checkpoints
    _damage(kind, old, new)
    with caplog.at_level(logging.WARNING, logger="gradbus.shard"):
        assert checkpoint.newest(root, "s0", fallback=True) == old
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(new.path in m and "falling back" in m for m in warned), warned


def test_restore_command_refuses_a_garbage_manifest(two_checkpoints):
    root, old, new = two_checkpoints
    path = _damage("manifest", old, new)
    r = subprocess.run([sys.executable, "-m", "gradbus", "restore", "--from", root, "--dry-run"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and path in r.stderr, (r.stdout, r.stderr)
    assert old.path not in r.stdout             # the older one is not offered instead


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_shard_restoring_a_damaged_checkpoint_exits_naming_the_file(two_checkpoints, kind):
    """The shard process loads its --restore checkpoint before it connects: it exits non-zero
    with the file and the damage in its error, not a traceback."""
    root, old, new = two_checkpoints
    path = _damage(kind, old, new)
    r = subprocess.run([sys.executable, "-m", "gradbus", "shard", "--broker",
                        "tcp://127.0.0.1:9", "--id", "s0", "--restore", new.path],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and path in r.stderr and WHAT[kind] in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
