"""`gradbus top`: figures from two statuses, the rendered frame, `--once` against a live cluster,
and the live dashboard in a pseudo-terminal (refreshes, q and Ctrl-C, terminal restored)."""
from __future__ import annotations

import fcntl
import io
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

import gradbus
from gradbus import top
from gradbus.cli import main
from gradbus.cluster import free_ports

from .rigs import wait_for


def test_help():
    r = CliRunner().invoke(main, ["top", "--help"])
    assert r.exit_code == 0 and "--interval" in r.output and "--once" in r.output
    assert "--curve-secret" in r.output and "--broker" in r.output


# -- synthetic statuses ------------------------------------------------------------------------


def _status(uptime, *, received, applied, wire_b, decoded_b, shards, workers, errors,
            seqs, versions, duplicates=0, failovers=0):
    return {
        "uptime_s": uptime, "partitions": 2, "partitions_assigned": 2, "partitions_down": [],
        "replicas": 1, "under_replicated": 0, "failovers": [], "pending_bytes": 0,
        "counters": {"pushes_received": received, "pushes_applied": applied,
                     "batches": applied, "push_wire_bytes": wire_b,
                     "push_decoded_bytes": decoded_b, "duplicates": duplicates,
                     "failovers": failovers},
        "errors": errors,
        "shards": [{"id": sid, "alive": alive, "partitions": 1, "primary": 1, "standby": 0,
                    "syncing": 0, "bytes": 4096, "inflight": inflight, "last_seen_s": seen,
                    "info": {"pushes_applied": n, "batches": n}}
                   for sid, alive, n, inflight, seen in shards],
        "workers": [{"id": wid, "pushes": n, "errors": errs, "last_seen_s": 0.1}
                    for wid, n, errs in workers],
        "tensors": [{"name": name, "dtype": "float32", "shape": [4], "blocks": 1,
                     "version": v, "optimizer": "sgd"} for name, v in versions],
        "table": {"owners": ["shard-a", "shard-b"], "standbys": [[], []], "syncing": [[], []],
                  "epochs": [1, 1], "seqs": seqs, "down": [], "version": 3},
    }


PREV = _status(10.0, received=100, applied=90, wire_b=1000, decoded_b=4000,
               shards=[("shard-a", True, 50, 0, 0.1), ("shard-b", True, 40, 0, 0.1)],
               workers=[("w1", 60, {}), ("w2", 40, {"NOT_FINITE": 1})],
               errors={"NOT_FINITE": 1}, seqs=[10, 20], versions=[("w", 90)], duplicates=1)
# two seconds later: shard-a applied 60 more and led 20 batches, shard-b died
CUR = _status(12.0, received=160, applied=150, wire_b=3000, decoded_b=10000,
              shards=[("shard-a", True, 110, 3, 0.2), ("shard-b", False, 40, 0, 1.7)],
              workers=[("w1", 100, {}), ("w2", 60, {"NOT_FINITE": 3})],
              errors={"NOT_FINITE": 3}, seqs=[30, 20], versions=[("w", 150)], duplicates=1)


def _text(renderable, width=160) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(renderable)
    return buf.getvalue()


def test_rates_between_two_statuses():
    r = top.rates(PREV, CUR)                 # the interval is the broker's uptime difference
    assert r["dt"] == 2.0
    cl = r["cluster"]
    assert cl["received"] == (160, 30.0) and cl["applied"] == (150, 30.0)
    assert cl["wire_rate"] == 1000.0 and cl["decoded_rate"] == 3000.0
    assert cl["ratio_now"] == 3.0 and cl["ratio_total"] == pytest.approx(10 / 3)
    assert cl["duplicates"] == (1, 0) and cl["failovers"] == (0, 0)
    a, b = r["shards"]
    assert (a["id"], a["alive"], a["applied"], a["applied_rate"]) == ("shard-a", True, 110, 30.0)
    assert a["updates_rate"] == 10.0 and a["inflight"] == 3 and not a["info_stale"]
    assert (b["alive"], b["applied_rate"], b["updates_rate"], b["last_seen_s"]) == \
        (False, 0.0, 0.0, 1.7)
    w1, w2 = r["workers"]
    assert (w1["push_rate"], w2["push_rate"]) == (20.0, 10.0)
    assert (w2["errors"], w2["errors_new"]) == (3, 2)
    assert r["errors"] == [{"code": "NOT_FINITE", "count": 3, "new": 2}]
    assert r["tensors"] == [{"name": "w", "version": 150, "version_rate": 30.0}]
    assert top.rates(PREV, CUR, dt=4.0)["cluster"]["applied"] == (150, 15.0)   # a given dt


def test_unknown_rates_are_none_not_zero():
    first = top.rates(None, CUR)
    assert first["dt"] is None and first["cluster"]["applied"] == (150, None)
    assert all(s["applied_rate"] is None and s["updates_rate"] is None for s in first["shards"])
    restarted = dict(PREV, uptime_s=20.0)    # uptime went down: a new broker, new counters
    assert top.rates(restarted, CUR)["cluster"]["received"] == (160, None)
    # counters a busy shard has not reported while its partitions moved: unknown, said so
    quiet = dict(CUR, shards=[dict(CUR["shards"][0], info=PREV["shards"][0]["info"]),
                              CUR["shards"][1]])
    a = top.rates(PREV, quiet)["shards"][0]
    assert a["info_stale"] and a["applied_rate"] is None and a["updates_rate"] == 10.0
    assert "stale" in _text(top.render(top.rates(PREV, quiet), quiet, top.History()))


def test_sparkline():
    assert top.sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert top.sparkline([0, 0, 0]) == "▁▁▁"
    assert top.sparkline([7, None, 0]) == "█ ▁"
    assert top.sparkline([70, 0, 7, 3.5], width=3) == "▁█▅"   # the last 3, scaled to their peak
    assert top.sparkline([]) == ""
    assert top.sparkline([0, 7], bars=top.ASCII_BARS) == "_#"


def test_history_keeps_the_last_samples_and_gaps():
    h = top.History(size=3)
    for _ in range(5):
        h.record(top.rates(PREV, CUR))
    h.gap()
    assert list(h.cluster) == [30.0, 30.0, None]
    assert list(h.shards["shard-a"]) == [10.0, 10.0, None]
    h.record(top.rates(None, dict(CUR, shards=CUR["shards"][:1])))   # shard-b gone
    assert set(h.shards) == {"shard-a"}


def test_frame_shows_rates_dead_shard_errors_and_sparklines():
    h = top.History()
    for applied in (0, 60, 120, 150):   # earlier samples for the sparkline
        h.cluster.append(applied / 2)
    out = _text(top.frame(PREV, CUR, None, h, url="tcp://x:1"))
    assert "gradbus top  tcp://x:1  up 12s  partitions 2/2" in out
    assert "shards 1/2 alive" in out and "workers 2" in out
    assert "received 160 (30.0/s)" in out and "applied 150 (30.0/s)" in out
    assert "wire 1.0 kB/s" in out and "decoded 3.0 kB/s" in out
    assert "compression 3.00x (total 3.33x)" in out
    assert "duplicates 1 (+0)" in out and "failovers 0 (+0)" in out
    assert "▁▄▇█▄" in out and "peak 75.0/s" in out     # 0, 30, 60, 75, then this 30
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[1:-1]]
            for ln in out.splitlines() if ln.startswith("│")}
    assert rows["shard-a"][:10] == ["shard-a", "alive", "1", "0", "4.1 kB", "10.0", "110",
                                    "30.0", "3", "0.2s"]
    assert rows["shard-b"][1] == "DEAD" and rows["shard-b"][9] == "1.7s"
    assert rows["w2"][:4] == ["w2", "60", "10.0", "3 (+2)"]
    assert rows["w1"][:4] == ["w1", "100", "20.0", "0 (+0)"]
    assert re.search(r"│ NOT_FINITE\s*│\s*3 \(\+2\) │", out)          # errors: count (new)
    assert rows["w"][:3] == ["w", "150", "30.0"]
    assert "staleness   not reported by this broker" in out
    assert "q or Ctrl-C quits" in out


def test_staleness_entry_is_shown_when_the_broker_has_one():
    cur = dict(CUR, staleness={"p50": 1, "p99": 4})
    out = _text(top.frame(PREV, cur, None, top.History()))
    assert "not reported" not in out
    assert re.search(r"staleness\s+p50\s+1", out) and re.search(r"p99\s+4", out)


def test_broker_not_answering_note():
    out = _text(top.render(top.rates(None, CUR), CUR, top.History(),
                           note="broker not answering: no reply"))
    assert "broker not answering: no reply" in out


# -- against a live cluster --------------------------------------------------------------------

GRAD = {"w": np.ones(256, np.float32)}


def _init(client) -> None:
    client.init({"w": np.zeros(256, np.float32)}, optimizer=gradbus.SGD(lr=0.01))


class _Pusher:
    """Pushes ``GRAD`` from a thread until stopped; ``count`` is how many were acknowledged."""

    def __init__(self, client):
        self.client, self.count = client, 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-top-pusher", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while not self.stop_event.is_set():
                self.client.push(GRAD, codec="bf16").result(10)
                self.count += 1
        except BaseException as e:   # reported by stop()
            self.error = e

    def stop(self):
        self.stop_event.set()
        self.thread.join(20)
        assert not self.thread.is_alive() and self.error is None, self.error


def _once(url, interval="0.3"):
    r = CliRunner().invoke(main, ["top", "--broker", url, "--once", "--interval", interval],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return r.output


def _rows(out: str) -> dict[str, list[str]]:
    """Table rows of a frame, by their first cell."""
    rows = ([c.strip() for c in ln.split("│")[1:-1]] for ln in out.splitlines()
            if ln.startswith("│"))
    return {r[0]: r for r in rows}


def test_once_against_a_live_cluster(make_cluster):
    c = make_cluster(2)
    n = 25
    with gradbus.connect(c.url) as client:
        _init(client)
        for _ in range(n):
            client.push(GRAD, codec="bf16").result(10)
        # an idle shard reports every gradient it applied in its next heartbeat
        wait_for(lambda: sum(s["info"].get("pushes_applied", 0) for s in
                             gradbus.admin.status(c.url)["shards"]) == n, 10, "shard reports")
        idle = _once(c.url)
        assert f"received {n} (0.0/s)" in idle and f"applied {n} (0.0/s)" in idle
        assert "(total 2.00x)" in idle                        # bf16: half of float32
        rows = _rows(idle)
        assert rows["w"][:3] == ["w", str(n), "0.0"]          # the tensor's version
        assert rows[client.client_id.hex()][:3] == [client.client_id.hex(), str(n), "0.0"]
        shards = [rows["shard-0"], rows["shard-1"]]
        assert all(r[1] == "alive" for r in shards)
        assert sorted(r[6] for r in shards) == ["0", str(n)]  # w lives on one shard
        assert all(r[5] == "0.0" and r[7] == "0.0" for r in shards)

        pusher = _Pusher(client)
        try:
            wait_for(lambda: pusher.count >= 5, 20, "pushes to start")
            busy = _once(c.url, "0.5")
        finally:
            pusher.stop()
    m = re.search(r"received (\d+) \(([\d.]+)/s\)", busy)
    assert m and n + 5 <= int(m.group(1)) <= n + pusher.count + 1 and float(m.group(2)) > 0
    rows = _rows(busy)
    assert float(rows[client.client_id.hex()][2]) > 0        # the worker's push rate
    updates = sorted(float(rows[s][5]) for s in ("shard-0", "shard-1"))
    assert updates[0] == 0 and updates[1] > 0


def test_curve_options_and_config_file_as_status_takes_them(make_cluster, tmp_path):
    c = make_cluster(1, curve_dir=str(tmp_path / "keys"))
    cfg = tmp_path / "gradbus.toml"
    cfg.write_text(f"[client]\nbroker = '{c.url}'\n[security]\n"
                   f"curve_secret = '{c.keys.path('client', True)}'\n"
                   f"curve_server_key = '{c.keys.path('broker')}'\n")
    r = CliRunner().invoke(main, ["top", "--config", str(cfg), "--once", "--interval", "0.1"],
                           env={"COLUMNS": "200"})     # wide enough for the shard's name
    assert r.exit_code == 0 and "shard-0" in r.output, r.output
    r = CliRunner().invoke(main, ["top", "--broker", c.url, "--once", "--interval", "0.1",
                                  "--curve-secret", c.keys.path("client", True),
                                  "--curve-server-key", c.keys.path("broker")],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "shard-0" in r.output, r.output
    for once in (["--once"], []):      # a refused key ends the live dashboard too
        r = CliRunner().invoke(main, ["top", "--broker", c.url, *once])
        assert r.exit_code == 1 and "requires CURVE" in r.output, r.output


def test_once_without_a_broker_is_a_clear_error():
    r = CliRunner().invoke(main, ["top", "--broker", f"tcp://127.0.0.1:{free_ports(1)[0]}",
                                  "--once", "--interval", "0.1"])
    assert r.exit_code == 1 and "no reply from the broker" in r.output


# -- in a pseudo-terminal ----------------------------------------------------------------------

ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
LEAVE_ALT_SCREEN = b"\x1b[?1049l"


def _terminal_signals() -> None:
    """In the child: SIGINT neither ignored nor blocked, as a shell on a terminal starts it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_masks(pid: int) -> str:
    """The ignored and blocked signal masks of a process, as /proc says them."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(ln.strip() for ln in f if ln.startswith(("SigIgn", "SigBlk")))
    except OSError:
        return "(gone)"


class _Pty:
    """``gradbus top`` on a 160x50 pseudo-terminal; ``raw`` is all it wrote."""

    def __init__(self, url: str, interval: str = "0.3"):
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        self.cooked = termios.tcgetattr(self.slave)
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env.update(TERM="xterm-256color", PYTHONIOENCODING="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradbus", "top", "--broker", url, "--interval", interval],
            stdin=self.slave, stdout=self.slave, stderr=self.slave, env=env, close_fds=True,
            # as a shell on a terminal starts it: Ctrl-C neither ignored nor blocked, whatever
            # this test process has (an ignored or blocked signal passes to a child)
            preexec_fn=_terminal_signals)
        self.raw = b""

    def drain(self) -> None:
        while select.select([self.master], [], [], 0.05)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:      # the child closed its side
                return
            if not data:
                return
            self.raw += data

    def screen(self) -> str:
        """The text of the last frame drawn (escape sequences removed)."""
        self.drain()
        text = ANSI.sub(b"", self.raw).decode("utf-8", "replace")
        return text[text.rfind("gradbus top"):] if "gradbus top" in text else ""

    def frames(self) -> int:
        """Frames drawn so far."""
        self.drain()
        return ANSI.sub(b"", self.raw).count(b"gradbus top")

    def wait_screen(self, cond, timeout: float, what: str) -> str:
        return wait_for(lambda: (lambda s: s if cond(s) else None)(self.screen()), timeout, what)

    def exit_code(self, timeout: float) -> int:
        def ended():
            self.drain()
            return self.proc.poll() is not None
        wait_for(ended, timeout, "top to exit")
        self.drain()
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)
        os.close(self.slave)


def _applied_rate(screen: str) -> float:
    m = re.search(r"applied \d+ \(([\d.]+)/s\)", screen)
    return float(m.group(1)) if m else 0.0


def _updates(screen: str) -> float:
    """The largest UPDATES/S of the shards on the screen (0 without a figure)."""
    rows = _rows(screen)
    return max((float(rows[sid][5]) for sid in ("shard-0", "shard-1")
                if sid in rows and re.fullmatch(r"[\d.]+", rows[sid][5])), default=0.0)


def _restored(term: _Pty) -> bool:
    lflag = termios.tcgetattr(term.slave)[3]
    return bool(lflag & termios.ICANON and lflag & termios.ECHO) and \
        termios.tcgetattr(term.slave) == term.cooked


def test_top_in_a_pty_refreshes_and_quits_on_q(make_cluster):
    c = make_cluster(2)
    client = gradbus.connect(c.url)
    pusher = None
    term = _Pty(c.url)
    try:
        _init(client)
        pusher = _Pusher(client)
        screen = term.wait_screen(lambda s: "shard-0" in s and "shard-1" in s
                                  and _applied_rate(s) > 0 and _updates(s) > 0, 30,
                                  "shards and a push rate")
        spark = next(ln for ln in screen.splitlines() if ln.startswith("applied/s"))
        assert any(b in spark for b in top.BARS), spark                # a sparkline drawn
        frames = term.frames()
        wait_for(lambda: term.frames() >= frames + 2, 10, "two more refreshes")
        assert b"\x1b[?1049h" in term.raw                     # on the alternate screen
        pusher.stop()
        pusher = None
        client.close()
        c.stop()                                              # the broker goes away
        term.wait_screen(lambda s: "broker not answering" in s, 15, "the broker to be missed")
        assert term.proc.poll() is None                       # and top keeps going
        os.write(term.master, b"q")
        assert term.exit_code(10) == 0
        assert term.raw.rstrip(b"\r\n").endswith(LEAVE_ALT_SCREEN), term.raw[-80:]
        assert _restored(term)                                # cbreak undone
    finally:
        if pusher is not None:
            pusher.stop()
        client.close()
        term.close()


def test_top_in_a_pty_without_a_broker_keeps_trying_and_quits_on_ctrl_c():
    term = _Pty(f"tcp://127.0.0.1:{free_ports(1)[0]}", interval="0.1")
    try:
        term.wait_screen(lambda s: "broker not answering" in s, 20, "the not-answering note")
        assert term.proc.poll() is None
        # once the terminal is in cbreak mode, Ctrl-C is what the terminal driver sends
        wait_for(lambda: not termios.tcgetattr(term.slave)[3] & termios.ICANON, 10, "cbreak")
        masks = _signal_masks(term.proc.pid)
        term.proc.send_signal(signal.SIGINT)
        try:
            code = term.exit_code(30)
        except TimeoutError:
            pytest.fail(f"top did not exit on SIGINT (its signal masks: {masks}); its "
                        f"screen: {term.screen()[-600:]!r}")
        assert code == 0
        assert LEAVE_ALT_SCREEN in term.raw[-64:]
        assert _restored(term)
    finally:
        term.close()


def test_tables_are_shown_with_their_push_rate():
    table = {"name": "emb", "dim": 8, "dtype": "float32", "optimizer": "adagrad",
             "rows": 1000, "bytes": 64000, "expiry_s": 0.0, "min_count": 1}
    prev = dict(PREV, tables=[dict(table, version=10)])
    cur = dict(CUR, tables=[dict(table, version=50, rows=1500, bytes=96000)])
    r = top.rates(prev, cur)
    assert r["tables"] == [{"name": "emb", "rows": 1500, "bytes": 96000, "version": 50,
                            "version_rate": 20.0}]
    out = _text(top.frame(prev, cur, None, top.History()))
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[1:-1]]
            for ln in out.splitlines() if ln.startswith("│")}
    assert rows["emb"] == ["emb", "1500", "96.0 kB", "50", "20.0"]
    assert "tables" not in _text(top.frame(PREV, CUR, None, top.History()))


def test_a_tier_members_place_and_map_are_shown():
    tier = {"member": 1, "version": 3, "members": [
        {"member": 0, "partitions": 100, "urls": ["tcp://a:5555"]},
        {"member": 1, "partitions": 156, "urls": ["tcp://b1:5555", "tcp://b2:5555"]}]}
    out = _text(top.frame(PREV, dict(CUR, tier=tier), None, top.History()))
    assert re.search(r"tier\s+member 1 of 2, map v3; home partitions: 0 100 \(tcp://a:5555\)"
                     r"\s+1\* 156 \(tcp://b1:5555,tcp://b2:5555\)", out), out
    assert "member" not in _text(top.frame(PREV, CUR, None, top.History()))
