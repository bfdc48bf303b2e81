"""The text of the ops commands' outputs, made from the broker's replies.

Every function here takes a reply (a status, a partition table, checkpoint replies, a move, a
restore plan) and returns text: none touches a socket or a terminal, so each is tested with a
dict. The commands in :mod:`gradbus.cli.ops` fetch and echo.
"""
from __future__ import annotations

import datetime


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 KiB`` ... ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _on(row: dict) -> str:
    """A shard's or worker's SHM column: whether its tensor bytes go through shared memory."""
    return "on" if row.get("shm") else "off"


def _backend(info: dict) -> str:
    """A shard's BACKEND column: its compute backend, and the device unless the host's
    ("cupy cuda:0"); "-" before its first heartbeat."""
    name, dev = info.get("backend"), info.get("device") or ""
    if not name:
        return "-"
    return name if dev in ("", "cpu") else f"{name} {dev.split(' ')[0]}"


def tier_text(tier: dict) -> str:
    """A broker tier member's place and its map (status ``tier``, protocol section 24): which
    member, of how many, the map's version, and each member's share of the home partitions
    (``*``: this one) with its URLs."""
    me = tier["member"]
    arriving = tier.get("incoming") or []
    return (f"member {me} of {len(tier['members'])}, map v{tier['version']}; home partitions: "
            + "  ".join(f"{m['member']}{'*' if m['member'] == me else ''} {m['partitions']} "
                        f"({','.join(m['urls'])})" for m in tier["members"])
            + (f"; {len(arriving)} arriving (a move under way: gradbus tier rebalance "
               f"finishes it)" if arriving else ""))


def status_text(st: dict, url: str) -> str:
    """``gradbus status``: a summary of a broker's status ``st`` (from ``url``), then one table
    each of shards, workers, tensors and (when there are any) embedding tables."""
    c = st["counters"]
    pair = [f"pair     {b['url']}  {b['role'].upper() if b['role'] == 'active' else b['role']}"
            + (f"  epoch {b['epoch']}  takeovers {b['takeovers']}" if "epoch" in b else
               f"  ({b.get('error', '')})")
            for b in st.get("brokers", ())]
    if st.get("tier") is not None:
        pair.append(f"tier     {tier_text(st['tier'])}")
    lines = pair + [
        f"broker   {url}  up {st['uptime_s']:.0f}s  partitions "
        f"{st['partitions_assigned']}/{st['partitions']} assigned"
        + (f"  DOWN {len(st['partitions_down'])}" if st["partitions_down"] else ""),
        (f"pushes   received {c.get('pushes_received', 0)}  applied "
        f"{c.get('pushes_applied', 0)}  batches {c.get('batches', 0)}  duplicates "
        f"{c.get('duplicates', 0)}  errors {sum(st['errors'].values())}"),
        f"replicas {st['replicas']}  under-replicated {st['under_replicated']}  failovers "
        f"{c.get('failovers', 0)}  moves {c.get('moves', 0)}"
        + (f" ({len(st['moves_in_progress'])} under way)" if st["moves_in_progress"] else "")
        + (f"  draining {','.join(st['draining'])}" if st["draining"] else ""),
        f"shm      {'offered' if st.get('shm') else 'off'}  freed {c.get('shm_freed', 0)}"
        f"  inlined {c.get('shm_inlined', 0)}  states {c.get('shm_states', 0)}"
        f"  torn {c.get('shm_states_torn', 0) + c.get('shm_torn_inline', 0)}",
        "",
        (f"{'SHARD':<16}{'STATE':<8}{'PRIMARY':>8}{'STANDBY':>8}{'SYNCING':>8}{'BYTES':>12}"
        f"{'APPLIED':>10}{'INFLIGHT':>10}{'SEEN':>8}{'SHM':>5}  BACKEND"),
    ]
    for s in st["shards"]:
        lines.append(f"{s['id']:<16}{'alive' if s['alive'] else 'DEAD':<8}{s['primary']:>8}"
                     f"{s['standby']:>8}{s['syncing']:>8}"
                     f"{fmt_bytes(s['bytes']):>12}{s['info'].get('pushes_applied', 0):>10}"
                     f"{s['inflight']:>10}{s['last_seen_s']:>7.1f}s{_on(s):>5}  "
                     f"{_backend(s['info'])}")
    lines += ["", (f"{'WORKER':<34}{'PUSHES':>10}{'RATE/S':>8}{'STALENESS':>10}{'REFUSED':>9}"
                  f"{'SEEN':>8}{'SHM':>5}")]
    for w in st["workers"]:
        stale = w.get("staleness")
        lines.append(f"{w['id']:<34}{w['pushes']:>10}{w.get('pushes_per_s', 0):>8.1f}"
                     f"{'-' if stale is None else f'{stale:.1f}':>10}"
                     f"{sum(w.get('errors', {}).values()):>9}{w['last_seen_s']:>7.1f}s"
                     f"{_on(w):>5}")
    lines += ["", f"{'TENSOR':<24}{'DTYPE':<9}{'SHAPE':<18}{'BLOCKS':>7}{'VERSION':>9}  OPTIMIZER"]
    for t in st["tensors"]:
        lines.append(f"{t['name']:<24}{t['dtype']:<9}{tuple(t['shape'])!s:<18}"
                     f"{t['blocks']:>7}{t['version']:>9}  {t['optimizer']}")
    if st.get("tables"):
        lines += ["", (f"{'TABLE':<24}{'DTYPE':<9}{'DIM':>6}{'ROWS':>12}{'BYTES':>12}"
                      f"{'VERSION':>10}  OPTIMIZER")]
        for t in st["tables"]:
            lines.append(f"{t['name']:<24}{t['dtype']:<9}{t['dim']:>6}{t['rows']:>12}"
                         f"{fmt_bytes(t['bytes']):>12}{t['version']:>10}  {t['optimizer']}")
    return "\n".join(lines)


def partition_rows(t: dict, show_all: bool = False) -> list[dict]:
    """One row per placed partition of a partition table ``t`` (every one with ``show_all``)."""
    return [{"p": p, "primary": o, "standbys": t["standbys"][p], "syncing": t["syncing"][p],
             "epoch": t["epochs"][p], "seq": t["seqs"][p], "down": p in t["down"],
             "bytes": t["bytes"][p], "updates_per_s": t["rates"][p]}
            for p, o in enumerate(t["owners"]) if o or show_all]


def partitions_text(rows: list[dict]) -> str:
    """``gradbus partitions``: the rows of :func:`partition_rows` as a table."""
    lines = [(f"{'PARTITION':>9}  {'PRIMARY':<16}{'STANDBYS':<28}{'EPOCH':>6}{'SEQ':>10}"
             f"{'BYTES':>10}{'UPD/S':>8}  STATE")]
    for r in rows:
        state = "DOWN" if r["down"] else ("syncing " + ",".join(r["syncing"]) if r["syncing"]
                                          else "ok")
        lines.append(f"{r['p']:>9}  {r['primary'] or '-':<16}"
                     f"{','.join(r['standbys']) or '-':<28}"
                     f"{r['epoch']:>6}{r['seq']:>10}{fmt_bytes(r['bytes']):>10}"
                     f"{r['updates_per_s']:>8.1f}  {state}")
    return "\n".join(lines)


def checkpoint_text(replies: list[dict]) -> str:
    """``gradbus checkpoint``: where each shard's checkpoint went, or why it failed."""
    lines = [f"{'SHARD':<16}{'PARTITIONS':>11}  PATH"]
    for r in replies:
        lines.append(f"{r['shard']:<16}{r.get('partitions', 0):>11}  "
                     + (r.get("path") or f"FAILED: {r.get('error')}"))
    return "\n".join(lines)


def move_line(m: dict) -> str:
    """One finished partition move, as ``gradbus rebalance`` and ``shard drain`` follow them."""
    return (f"  moved partition {m['p']:>5} {m['from']} -> {m['to']}  "
            f"{fmt_bytes(m['bytes'])} in {m['seconds']:.3f}s")


def restore_plan_text(ids: list[str], chosen: dict, log_dir: str | None,
                      at: str | None) -> str:
    """``gradbus restore``: the checkpoint each shard id starts from (``chosen``: shard id ->
    checkpoint with ``time``, ``partitions`` and ``path``; a missing id starts empty) and the
    update log replayed on top."""
    lines = []
    for sid in ids:
        ck = chosen.get(sid)
        if ck is None:
            lines.append(f"{sid:<16} {'(no checkpoint: starts empty)':<23}")
            continue
        stamp = datetime.datetime.fromtimestamp(ck.time).isoformat(timespec="milliseconds")
        lines.append(f"{sid:<16} {stamp}  {len(ck.partitions):>4} partitions  {ck.path}")
    if log_dir:
        lines.append(f"replaying the update log {log_dir}"
                     + (f" up to {at}" if at else " to its end"))
    return "\n".join(lines)
