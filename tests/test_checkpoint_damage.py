"""Damaged checkpoints are refused, each with a message naming the file and what is wrong: a
garbage MANIFEST, a partition file from another checkpoint, a missing partition file, a flipped
header byte. Restore falls back to an older checkpoint only when told to, and then says so."""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest

from gradbus.codecs.errors import WireError
from gradbus.shards import checkpoint

from .rigs import CHECKPOINT_DAMAGES as DAMAGES
from .rigs import damage_checkpoint as _damage

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
