"""The ops commands' text, made by pure functions from replies (no broker, no socket)."""
from __future__ import annotations

from types import SimpleNamespace

from click.testing import CliRunner

from gradbus.cli import main, render

STATUS = {
    "uptime_s": 12.4, "partitions_assigned": 8, "partitions": 8, "partitions_down": [3],
    "counters": {"pushes_received": 5, "pushes_applied": 4, "batches": 2, "failovers": 1,
                 "moves": 3, "shm_freed": 4, "shm_states": 5,
                 "shm_states_torn": 1, "shm_torn_inline": 2},
    "shm": True,
    "errors": {"X": 2}, "replicas": 2, "under_replicated": 1, "moves_in_progress": [1],
    "draining": ["s1"],
    "shards": [{"id": "s0", "alive": True, "primary": 4, "standby": 4, "syncing": 0,
                "bytes": 123456, "info": {"pushes_applied": 7, "backend": "cupy",
                                           "device": "cuda:0 NVIDIA H100 80GB HBM3"},
                "inflight": 1,
                "last_seen_s": 0.25, "shm": True},
               {"id": "s1", "alive": False, "primary": 0, "standby": 0, "syncing": 1,
                "bytes": 10, "info": {}, "inflight": 0, "last_seen_s": 5.0}],
    "workers": [{"id": "w1", "pushes": 9, "pushes_per_s": 1.5, "staleness": 0.5,
                 "errors": {"A": 1}, "last_seen_s": 0.1, "shm": True},
                {"id": "w2", "pushes": 0, "last_seen_s": 2.0}],
    "tensors": [{"name": "w", "dtype": "float32", "shape": [3, 4], "blocks": 1, "version": 5,
                 "optimizer": "sgd"}],
    "tables": [{"name": "emb", "dtype": "float32", "dim": 8, "rows": 100, "bytes": 3200,
                "version": 2, "optimizer": "adam"}],
}

TABLE = {"owners": ["s0", None, "s1"], "standbys": [["s1"], [], []],
         "syncing": [[], [], ["s0"]], "epochs": [1, 0, 2], "seqs": [5, 0, 7], "down": [2],
         "bytes": [100, 0, 5000], "rates": [1.0, 0, 2.5], "version": 3}


def test_fmt_bytes():
    assert [render.fmt_bytes(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 30, 5 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB", "5120.0 GiB"]


def test_status_text():
    assert render.status_text(STATUS, "tcp://h:1").split("\n") == [
        "broker   tcp://h:1  up 12s  partitions 8/8 assigned  DOWN 1",
        "pushes   received 5  applied 4  batches 2  duplicates 0  errors 2",
        "replicas 2  under-replicated 1  failovers 1  moves 3 (1 under way)  draining s1",
        "shm      offered  freed 4  inlined 0  states 5  torn 3",
        "",
        "SHARD           STATE    PRIMARY STANDBY SYNCING       BYTES   APPLIED  INFLIGHT    SEEN  SHM"
        "  BACKEND",
        "s0              alive          4       4       0   120.6 KiB         7         1    0.2s   on"
        "  cupy cuda:0",
        "s1              DEAD           0       0       1        10 B         0         0    5.0s  off"
        "  -",
        "",
        "WORKER                                PUSHES  RATE/S STALENESS  REFUSED    SEEN  SHM",
        "w1                                         9     1.5       0.5        1    0.1s   on",
        "w2                                         0     0.0         -        0    2.0s  off",
        "",
        "TENSOR                  DTYPE    SHAPE              BLOCKS  VERSION  OPTIMIZER",
        "w                       float32  (3, 4)                  1        5  sgd",
        "",
        "TABLE                   DTYPE       DIM        ROWS       BYTES   VERSION  OPTIMIZER",
        "emb                     float32       8         100     3.1 KiB         2  adam",
    ]


def test_status_text_of_a_quiet_cluster_has_no_tables_and_no_extras():
    st = {**STATUS, "partitions_down": [], "moves_in_progress": [], "draining": [],
          "tables": [], "shards": [], "workers": [], "tensors": [], "counters": {},
          "errors": {}, "shm": False}
    assert render.status_text(st, "u").split("\n") == [
        "broker   u  up 12s  partitions 8/8 assigned",
        "pushes   received 0  applied 0  batches 0  duplicates 0  errors 0",
        "replicas 2  under-replicated 1  failovers 0  moves 0",
        "shm      off  freed 0  inlined 0  states 0  torn 0",
        "",
        "SHARD           STATE    PRIMARY STANDBY SYNCING       BYTES   APPLIED  INFLIGHT    SEEN  SHM"
        "  BACKEND",
        "",
        "WORKER                                PUSHES  RATE/S STALENESS  REFUSED    SEEN  SHM",
        "",
        "TENSOR                  DTYPE    SHAPE              BLOCKS  VERSION  OPTIMIZER",
    ]


def test_partition_rows_and_text():
    rows = render.partition_rows(TABLE)
    assert [r["p"] for r in rows] == [0, 2]
    assert [r["p"] for r in render.partition_rows(TABLE, show_all=True)] == [0, 1, 2]
    assert rows[1] == {"p": 2, "primary": "s1", "standbys": [], "syncing": ["s0"], "epoch": 2,
                       "seq": 7, "down": True, "bytes": 5000, "updates_per_s": 2.5}
    assert render.partitions_text(rows).split("\n") == [
        ("PARTITION  PRIMARY         STANDBYS                     EPOCH       SEQ     BYTES   "
        "UPD/S  STATE"),
        ("        0  s0              s1                               1         5     100 B     "
        "1.0  ok"),
        ("        2  s1              -                                2         7   4.9 KiB     "
        "2.5  DOWN"),
    ]
    syncing = render.partition_rows({**TABLE, "down": []})[1]
    assert render.partitions_text([syncing]).split("\n")[1].endswith("syncing s0")


def test_checkpoint_text_and_move_line():
    assert render.checkpoint_text([{"shard": "s0", "partitions": 4, "path": "/x/ck"},
                                   {"shard": "s1", "error": "disk full"}]).split("\n") == [
        "SHARD            PARTITIONS  PATH",
        "s0                        4  /x/ck",
        "s1                        0  FAILED: disk full",
    ]
    assert render.move_line({"p": 7, "from": "s0", "to": "s1", "bytes": 2048,
                             "seconds": 0.0125}) == "  moved partition     7 s0 -> s1  2.0 KiB in 0.013s"


def test_restore_plan_text():
    ck = SimpleNamespace(time=0.0, partitions=[(1, 1, 1), (2, 1, 1)], path="/d/s0/ckpt-1")
    text = render.restore_plan_text(["s0", "s1"], {"s0": ck}, "/log", "T").split("\n")
    assert len(text) == 3
    assert text[0].startswith("s0               ") and text[0].endswith(
        "     2 partitions  /d/s0/ckpt-1")
    assert text[1] == "s1               (no checkpoint: starts empty)"
    assert text[2] == "replaying the update log /log up to T"
    assert render.restore_plan_text(["s1"], {}, "/log", None).split("\n")[1] == (
        "replaying the update log /log to its end")


def test_status_command_prints_the_rendered_status(monkeypatch):
    from gradbus import admin
    monkeypatch.setattr(admin, "status", lambda *a, **k: STATUS)
    r = CliRunner().invoke(main, ["status", "--broker", "tcp://h:1"])
    assert r.exit_code == 0 and r.output == render.status_text(STATUS, "tcp://h:1") + "\n"


def test_every_command_is_named_in_the_package_docstring():
    import click

    from gradbus import cli

    def names(group, prefix=""):
        for n, c in group.commands.items():
            yield prefix + n
            if isinstance(c, click.Group):
                yield from names(c, prefix + n + " ")
    doc = cli.__doc__
    missing = [n for n in names(main) if n not in doc]
    assert not missing, missing
