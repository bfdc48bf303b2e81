"""``gradbus top``: a live dashboard of a running cluster, built from two successive statuses.

:func:`rates` turns two broker statuses (``admin.status``) into per-second figures,
:class:`History` keeps the last samples for the sparklines and :func:`render` makes the rich
renderable of one frame; none of them touch a terminal. :func:`run` is the live loop (alternate
screen, cbreak keyboard, ``q`` or Ctrl-C quits) and :func:`once` prints one frame.
"""
from __future__ import annotations

import math
import os
import select
import sys
import time
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gradbus import admin
from gradbus.cli import render as render_text
from gradbus.codecs import net, wire
from gradbus.codecs.errors import GradbusError, SecurityError

BARS = "▁▂▃▄▅▆▇█"
ASCII_BARS = "_.-~=+*#"
HISTORY = 60          # samples kept per sparkline
MAX_WORKERS = 20      # worker rows shown (the busiest)


# -- figures -----------------------------------------------------------------------------------

def _rate(cur, prev, dt):
    """(cur - prev) / dt, or None when it cannot be known (no earlier sample, a reset counter)."""
    if prev is None or cur is None or not dt or dt <= 0 or cur < prev:
        return None
    return (cur - prev) / dt


def _interval(prev: dict | None, cur: dict, dt: float | None) -> float | None:
    if prev is None:
        return None
    up = cur.get("uptime_s", 0) - prev.get("uptime_s", 0)
    if up <= 0:          # the broker restarted between the samples: its counters began again
        return None
    return dt if dt is not None and dt > 0 else up


def _held(table: dict, sid: str) -> list[int]:
    """Partitions ``sid`` leads or is an in-sync standby of."""
    return [q for q, owner in enumerate(table.get("owners", []))
            if owner == sid or sid in table["standbys"][q]]


def _seq_deltas(prev: dict | None, cur: dict) -> dict[int, int] | None:
    """Batches sequenced to each partition between two statuses carrying the partition table
    (``table``), or None without both."""
    t, pt = cur.get("table"), (prev or {}).get("table")
    if not t or not pt or len(t.get("seqs", [])) != len(pt.get("seqs", [])):
        return None
    return {q: b - a for q, (a, b) in enumerate(zip(pt["seqs"], t["seqs"])) if b > a}


def rates(prev: dict | None, cur: dict, dt: float | None = None) -> dict:
    """Per-second figures between two statuses taken ``dt`` seconds apart (default: the
    difference of the broker's ``uptime_s``). A figure that cannot be known (first sample, a
    restarted broker or shard, a newcomer) is None. A shard's ``updates_rate`` (batches
    sequenced to the partitions it holds in sync) needs the partition table in the statuses
    (``table``, as :func:`sample` fetches them). Returns ``{"dt", "cluster", "shards",
    "workers", "tensors", "tables", "errors"}``."""
    dt = _interval(prev, cur, dt)
    if dt is None:
        prev = None
    c, pc = cur.get("counters", {}), (prev or {}).get("counters", {})

    def counter(name):
        return c.get(name, 0), _rate(c.get(name, 0), pc.get(name, 0) if prev else None, dt)

    def delta(cur_v, prev_v):
        return None if prev is None or prev_v is None or cur_v < prev_v else cur_v - prev_v

    wire_b, wire_rate = counter("push_wire_bytes")
    dec, dec_rate = counter("push_decoded_bytes")
    wire_d = delta(wire_b, pc.get("push_wire_bytes", 0))
    dec_d = delta(dec, pc.get("push_decoded_bytes", 0))
    cluster = {
        "received": counter("pushes_received"), "applied": counter("pushes_applied"),
        "batches": counter("batches"), "wire_rate": wire_rate, "decoded_rate": dec_rate,
        "ratio_total": dec / wire_b if wire_b else None,
        "ratio_now": dec_d / wire_d if wire_d else None,
        "duplicates": (c.get("duplicates", 0),
                       delta(c.get("duplicates", 0), pc.get("duplicates", 0))),
        "failovers": (c.get("failovers", 0), delta(c.get("failovers", 0), pc.get("failovers", 0))),
        "fenced": c.get("fenced_partitions", 0),
        "pending_bytes": cur.get("pending_bytes", 0),
    }
    before = {s["id"]: s for s in (prev or {}).get("shards", [])}
    seqs = _seq_deltas(prev, cur)
    shards = []
    for s in cur.get("shards", []):
        info, p = s.get("info") or {}, before.get(s["id"])
        pinfo = (p.get("info") or {}) if p else {}
        applied = info.get("pushes_applied", 0)
        updates = (None if seqs is None else
                   _rate(sum(seqs.get(q, 0) for q in _held(cur["table"], s["id"])), 0, dt))
        # a shard reports its counters in heartbeats, which a busy shard skips: counters that
        # did not move while its partitions did are not a rate of zero but an unknown one
        stale = p is not None and info == pinfo and bool(updates)
        shards.append({
            "id": s["id"], "alive": s.get("alive", False),
            "partitions": s.get("partitions", 0), "primary": s.get("primary", 0),
            "standby": s.get("standby", 0), "syncing": s.get("syncing", 0),
            "bytes": s.get("bytes", 0), "inflight": s.get("inflight", 0),
            "last_seen_s": s.get("last_seen_s", 0.0), "applied": applied,
            "updates_rate": updates, "info_stale": stale,
            "applied_rate": None if stale else _rate(
                applied, pinfo.get("pushes_applied", 0) if p else None, dt),
        })
    wbefore = {w["id"]: w for w in (prev or {}).get("workers", [])}
    workers = []
    for w in cur.get("workers", []):
        p = wbefore.get(w["id"])
        errors = sum((w.get("errors") or {}).values())
        workers.append({
            "id": w["id"], "pushes": w.get("pushes", 0), "errors": errors,
            "push_rate": _rate(w.get("pushes", 0), p.get("pushes", 0) if p else None, dt),
            "errors_new": (delta(errors, sum((p.get("errors") or {}).values()))
                           if p else None),
            "last_seen_s": w.get("last_seen_s", 0.0)})

    def versioned(kind: str, extra=()) -> list[dict]:
        """Tensors or tables with their version and its rate since the last status."""
        before = {t["name"]: t.get("version", 0) for t in (prev or {}).get(kind, [])}
        return [{"name": t["name"], **{k: t.get(k, 0) for k in extra},
                 "version": t.get("version", 0),
                 "version_rate": _rate(t.get("version", 0), before.get(t["name"]), dt)}
                for t in cur.get(kind, [])]
    tensors = versioned("tensors")
    tables = versioned("tables", ("rows", "bytes"))
    perr = (prev or {}).get("errors", {})
    errors = [{"code": code, "count": n, "new": delta(n, perr.get(code, 0))}
              for code, n in sorted(cur.get("errors", {}).items())]
    return {"dt": dt, "cluster": cluster, "shards": shards, "workers": workers,
            "tensors": tensors, "tables": tables, "errors": errors}


class History:
    """The last ``size`` applied rates of the cluster and update rates of each shard (None: no
    figure)."""

    def __init__(self, size: int = HISTORY):
        self.size = size
        self.cluster: deque = deque(maxlen=size)
        self.shards: dict[str, deque] = {}

    def record(self, r: dict) -> None:
        self.cluster.append(r["cluster"]["applied"][1])
        present = set()
        for s in r["shards"]:
            present.add(s["id"])
            self.shards.setdefault(s["id"], deque(maxlen=self.size)).append(s["updates_rate"])
        for sid in list(self.shards):
            if sid not in present:
                del self.shards[sid]

    def gap(self) -> None:
        """A sample that could not be taken (the broker did not answer)."""
        self.cluster.append(None)
        for h in self.shards.values():
            h.append(None)


def sparkline(values, width: int | None = None, bars: str = BARS) -> str:
    """One character per value, the last ``width`` of them, scaled to their maximum (a blank
    for a missing value; all zeros is the lowest bar)."""
    vals = list(values)[-width:] if width else list(values)
    top = max((v for v in vals if v is not None), default=0) or 0
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif top <= 0:
            out.append(bars[0])
        else:
            out.append(bars[min(len(bars) - 1, int(v / top * (len(bars) - 1) + 0.5))])
    return "".join(out)


# -- rendering ---------------------------------------------------------------------------------

def _num(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _per_s(v) -> str:
    return _num(v, "{:.1f}/s")


def _plus(v) -> str:
    return "" if v is None else f" (+{v})"


def _size(n, per: str = "") -> str:
    """Bytes in decimal units (kB, MB, GB), ``per`` appended to the unit."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}{per}" if unit == "B" else f"{n:.1f} {unit}{per}"
        n /= 1000
    return str(n)


def _ratio(v) -> str:
    return _num(v, "{:.2f}x")


def _staleness(value) -> Table | Text:
    """The broker's ``staleness`` entry, shown as it comes (a mapping as rows)."""
    if isinstance(value, dict):
        t = Table.grid(padding=(0, 2))
        for k, v in value.items():
            t.add_row(str(k), v if isinstance(v, str) else repr(v))
        return t
    return Text(repr(value))


def render(r: dict, cur: dict, history: History, *, url: str = "", note: str | None = None,
           width: int = 120, ascii_only: bool = False, interval: float | None = None):
    """One frame: the figures of :func:`rates` ``r`` for status ``cur``, with sparklines from
    ``history``; ``note`` is a warning line (the broker not answering)."""
    bars = ASCII_BARS if ascii_only else BARS
    cl = r["cluster"]
    shards = r["shards"]
    alive = sum(1 for s in shards if s["alive"])
    head = Text.assemble(
        ("gradbus top", "bold"), f"  {url}  up {cur.get('uptime_s', 0):.0f}s  partitions "
        f"{cur.get('partitions_assigned', 0)}/{cur.get('partitions', 0)}",
        (f"  DOWN {len(cur.get('partitions_down', []))}", "bold red")
        if cur.get("partitions_down") else "",
        f"  replicas {cur.get('replicas', 1)}",
        (f"  under-replicated {cur.get('under_replicated', 0)}", "yellow")
        if cur.get("under_replicated") else "",
        f"  shards {alive}/{len(shards)} alive  workers {len(r['workers'])}  "
        + time.strftime("%H:%M:%S"))
    parts: list = [head]
    if note:
        parts.append(Text(note, style="bold red"))

    summary = Table.grid(padding=(0, 3))
    summary.add_column(style="bold")
    summary.add_column()
    rec, app, bat = cl["received"], cl["applied"], cl["batches"]
    summary.add_row("pushes", f"received {rec[0]} ({_per_s(rec[1])})   applied {app[0]} "
                              f"({_per_s(app[1])})   batches {bat[0]} ({_per_s(bat[1])})")
    summary.add_row("bytes", f"wire {_size(cl['wire_rate'], '/s')}   decoded "
                             f"{_size(cl['decoded_rate'], '/s')}   compression "
                             f"{_ratio(cl['ratio_now'])} (total {_ratio(cl['ratio_total'])})   "
                             f"pending {_size(cl['pending_bytes'])}")
    summary.add_row("events", f"duplicates {cl['duplicates'][0]}{_plus(cl['duplicates'][1])}   "
                              f"failovers {cl['failovers'][0]}{_plus(cl['failovers'][1])}   "
                              f"fenced partitions {cl['fenced']}")
    spark_w = max(8, min(history.size, width - 30))
    peak = max((v for v in history.cluster if v is not None), default=None)
    summary.add_row("applied/s", Text(sparkline(history.cluster, spark_w, bars), style="green")
                    + Text(f"  peak {_per_s(peak)}"))
    if "staleness" in cur:
        summary.add_row("staleness", _staleness(cur["staleness"]))
    else:
        summary.add_row("staleness", Text("not reported by this broker", style="dim"))
    if cur.get("tier") is not None:
        summary.add_row("tier", render_text.tier_text(cur["tier"]))
    parts.append(summary)

    st = Table(title="shards", title_justify="left", expand=False, padding=(0, 1))
    for name in ("SHARD", "STATE", "PRIMARY", "STANDBY", "BYTES", "UPDATES/S", "APPLIED",
                 "APPLIED/S", "INFLIGHT", "SEEN"):
        st.add_column(name, no_wrap=True, justify="left" if name in ("SHARD", "STATE")
                      else "right")
    st.add_column("UPDATES/S, LAST SAMPLES", no_wrap=True, overflow="crop")
    shard_spark = max(8, min(history.size, width - 112))
    for s in shards:
        state = (Text("alive", style="green") if s["alive"] else Text("DEAD", style="bold red"))
        if s["alive"] and s["syncing"]:
            state = Text(f"syncing {s['syncing']}", style="yellow")
        seen = Text(f"{s['last_seen_s']:.1f}s", style="" if s["alive"] else "red")
        applied_rate = "stale" if s["info_stale"] else _num(s["applied_rate"])
        st.add_row(s["id"], state, str(s["primary"]), str(s["standby"]), _size(s["bytes"]),
                   _num(s["updates_rate"]), str(s["applied"]), applied_rate, str(s["inflight"]),
                   seen, sparkline(history.shards.get(s["id"], ()), shard_spark, bars))
    parts.append(st)

    workers = sorted(r["workers"], key=lambda w: (-(w["push_rate"] or 0), w["id"]))
    wt = Table(title="workers", title_justify="left", padding=(0, 1))
    for name in ("WORKER", "PUSHES", "PUSHES/S", "ERRORS", "SEEN"):
        wt.add_column(name, justify="left" if name == "WORKER" else "right", no_wrap=True)
    for w in workers[:MAX_WORKERS]:
        wt.add_row(w["id"], str(w["pushes"]), _num(w["push_rate"]),
                   Text(f"{w['errors']}{_plus(w['errors_new'])}",
                        style="red" if w["errors"] else ""),
                   f"{w['last_seen_s']:.1f}s")
    if len(workers) > MAX_WORKERS:
        wt.caption = f"{len(workers) - MAX_WORKERS} more"
    parts.append(wt)

    side = Table.grid(padding=(0, 4))
    tt = Table(title="tensors", title_justify="left", padding=(0, 1))
    for name in ("TENSOR", "VERSION", "UPDATES/S"):
        tt.add_column(name, justify="left" if name == "TENSOR" else "right", no_wrap=True)
    for t in r["tensors"]:
        tt.add_row(t["name"], str(t["version"]), _num(t["version_rate"]))
    et = Table(title="errors", title_justify="left", padding=(0, 1))
    et.add_column("CODE", no_wrap=True)
    et.add_column("COUNT", justify="right", no_wrap=True)
    for e in r["errors"]:
        et.add_row(Text(e["code"], style="red"), f"{e['count']}{_plus(e['new'])}")
    if not r["errors"]:
        et.add_row(Text("none", style="dim"), "")
    side.add_row(tt, et)
    parts.append(side)
    if r.get("tables"):
        tb = Table(title="tables", title_justify="left", padding=(0, 1))
        for name in ("TABLE", "ROWS", "BYTES", "VERSION", "PUSHES/S"):
            tb.add_column(name, justify="left" if name == "TABLE" else "right", no_wrap=True)
        for t in r["tables"]:
            tb.add_row(t["name"], str(t["rows"]), _size(t["bytes"]), str(t["version"]),
                       _num(t["version_rate"]))
        parts.append(tb)

    fo = cur.get("failovers") or []
    if fo:
        parts.append(Text("last failovers: " + "   ".join(
            f"p{f.get('p')} {f.get('from')}->{f.get('to')} epoch {f.get('epoch')}"
            for f in fo[-3:]), style="yellow"))
    every = f"every {interval:g}s   " if interval else ""
    parts.append(Text(f"{every}q or Ctrl-C quits", style="dim"))
    return Group(*parts)


def frame(prev: dict | None, cur: dict, dt: float | None, history: History, **kw):
    """Figures between ``prev`` and ``cur`` added to ``history``, and the frame showing them."""
    r = rates(prev, cur, dt)
    history.record(r)
    return render(r, cur, history, **kw)


# -- terminal ----------------------------------------------------------------------------------

def _ascii_only(console: Console) -> bool:
    return not (console.encoding or "").lower().startswith("utf")


def sample(url: str, timeout: float, curve=None) -> dict:
    """The broker's status with its partition table (``table``), in one request."""
    return admin.request(url, wire.STATUS, timeout, curve=curve, table=True)["status"]


def once(url: str, interval: float = 1.0, curve=None, console: Console | None = None) -> None:
    """Print one frame from two statuses ``interval`` seconds apart (raises GradbusError when
    the broker does not answer)."""
    if console is None:     # not a terminal: wide enough for every column, unless COLUMNS says
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(width=160) if wide else Console()
    timeout = max(1.0, interval)
    t0, prev = time.monotonic(), sample(url, timeout, curve)
    time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    t1, cur = time.monotonic(), sample(url, timeout, curve)
    console.print(frame(prev, cur, t1 - t0, History(), url=url, width=console.width,
                        ascii_only=_ascii_only(console), interval=interval))


class _Keys:
    """Keys from a terminal in cbreak mode (restored by :meth:`close`); without a terminal it
    only waits."""

    def __init__(self, stream=None):
        self.fd, self.saved = None, None
        stream = sys.stdin if stream is None else stream
        try:
            if stream is not None and stream.isatty():
                import termios
                import tty
                self.fd = stream.fileno()
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)     # keys one at a time, no echo; Ctrl-C still SIGINT
        except (OSError, ValueError):
            self.fd = None

    def wait(self, timeout: float) -> bytes:
        """Keys typed within ``timeout`` seconds (returns at the first)."""
        if self.fd is None:
            time.sleep(max(0.0, timeout))
            return b""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return b""
        data = os.read(self.fd, 64)
        if not data:           # end of input: no more keys, only the timer
            self.close()
        return data

    def close(self) -> None:
        if self.saved is not None:
            import termios
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
            self.saved = None
        self.fd = None


def _waiting(url: str, note: str):
    """The frame before any status arrived."""
    return Group(Text.assemble(("gradbus top", "bold"), f"  {url}"), Text(note, style="bold red"),
                 Text("q or Ctrl-C quits", style="dim"))


def run(url: str, interval: float = 1.0, curve=None, console: Console | None = None) -> int:
    """The live dashboard on the alternate screen until ``q`` or Ctrl-C; 0 when it quits. A
    broker that stops answering is shown as such and asked again each interval; a malformed
    URL or a CURVE key the broker refuses raises GradbusError."""
    net.split_url(url)
    console = console or Console()
    opts = {"url": url, "ascii_only": _ascii_only(console), "interval": interval}
    history = History()
    timeout = max(1.0, interval)
    prev = prev_t = None          # the status the next rates start from, and when it came
    last = last_t = None          # the last status received
    keys = _Keys()
    try:
        with Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                  redirect_stderr=False) as live:
            next_poll = time.monotonic()
            while True:
                pressed = keys.wait(next_poll - time.monotonic())
                if b"q" in pressed or b"Q" in pressed or b"\x03" in pressed:
                    return 0
                now = time.monotonic()
                if now < next_poll:
                    continue
                next_poll = max(next_poll + interval, now)
                try:
                    st, t = sample(url, timeout, curve), time.monotonic()
                except SecurityError:
                    raise
                except GradbusError as e:
                    history.gap()
                    prev = prev_t = None
                    note = f"broker not answering: {e}"
                    if last is None:
                        view = _waiting(url, note)
                    else:
                        note += f"; the figures below are {time.monotonic() - last_t:.0f}s old"
                        view = render(rates(None, last), last, history, note=note,
                                      width=console.width, **opts)
                else:
                    view = frame(prev, st, t - prev_t if prev_t is not None else None, history,
                                 width=console.width, **opts)
                    prev, prev_t = last, last_t = st, t
                live.update(view, refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        keys.close()
