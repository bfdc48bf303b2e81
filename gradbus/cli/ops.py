"""Ops commands against a running cluster: status, partitions, checkpoint, rebalance,
shard drain and top. Each fetches a reply with :mod:`gradbus.admin` and prints it as JSON or
as the text :mod:`gradbus.cli.render` makes of it."""
from __future__ import annotations

import json
import sys
import time

import click

from gradbus import config
from gradbus.cli import render
from gradbus.cli.options import broker_option, curve_options
from gradbus.codecs import wire


def _moving_options(wait_help: str):
    """The options of a command that starts partition moves: the broker, --wait (``wait_help``),
    --timeout, --json and the client's CURVE keys."""
    def decorate(f):
        f = curve_options("client")(f)
        f = click.option("--json", "as_json", is_flag=True,
                         help="Print the result (and the moves) as JSON.")(f)
        f = click.option("--timeout", default=600.0, show_default=True, type=float)(f)
        f = click.option("--wait/--no-wait", default=True, show_default=True, help=wait_help)(f)
        return broker_option(f)
    return decorate


@click.command("drain")
@click.argument("shard_id")
@_moving_options("Wait until the shard holds nothing and has stopped, showing progress.")
def shard_drain(shard_id, broker_url, wait, timeout, as_json, curve):
    """Move every partition off SHARD_ID (to the shards holding fewest bytes); the shard stops
    once it holds nothing."""
    from gradbus import admin
    _moving(broker_url, curve, wait, timeout, as_json,
            lambda: admin.drain(broker_url, shard_id, curve=curve),
            lambda res: f"draining {shard_id}: {res['partitions']} partitions to move",
            until_gone=shard_id)


@click.command()
@_moving_options("Wait until the moves are done, showing progress.")
def rebalance(broker_url, wait, timeout, as_json, curve):
    """Even out the shards' load (parameter bytes and update rate) by moving partitions while
    training goes on."""
    from gradbus import admin
    _moving(broker_url, curve, wait, timeout, as_json,
            lambda: admin.rebalance(broker_url, curve=curve),
            lambda res: f"rebalance: {res['moves_started']} moves started")


def _moving(url, curve, wait: bool, timeout: float, as_json: bool, start, said,
            until_gone: str | None = None) -> None:
    """Start moves (``start()``, an admin request), say so (``said(result)``), and with
    ``wait`` follow them to the end; ``as_json`` prints the result and the moves instead."""
    from gradbus import admin
    before = {(m["p"], m["at"]) for m in admin.status(url, curve=curve)["moves"]}
    res = start()
    if not as_json:
        click.echo(said(res))
    moves = _follow_moves(url, curve, timeout, until_gone=until_gone, quiet=as_json,
                          before=before) if wait else []
    if as_json:
        click.echo(json.dumps({**res, "moves": moves}, indent=2))


def _follow_moves(url, curve, timeout: float, until_gone: str | None = None,
                  quiet: bool = False, before: set = frozenset()) -> list[dict]:
    """Print moves as they finish until none is in progress (and ``until_gone`` has stopped);
    returns them."""
    from gradbus import admin
    deadline, seen, done = time.monotonic() + timeout, set(), []
    seen.update(before)                     # moves that finished before this command
    while True:
        st = admin.status(url, curve=curve)
        for m in st["moves"]:
            key = (m["p"], m["at"])
            if key not in seen:
                seen.add(key)
                done.append(m)
                if not quiet:
                    click.echo(render.move_line(m))
        gone = until_gone is None or not any(
            s["alive"] for s in st["shards"] if s["id"] == until_gone)
        if not st["moves_in_progress"] and gone and not st.get("draining"):
            if not quiet:
                click.echo("done")
            return done
        if time.monotonic() > deadline:
            raise click.ClickException(f"still {len(st['moves_in_progress'])} moves after "
                                       f"{timeout:.0f}s")
        time.sleep(0.2)


@click.command("checkpoint")
@broker_option
@curve_options("client")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--timeout", default=60.0, show_default=True, type=float)
def checkpoint_cmd(broker_url, as_json, timeout, curve):
    """Have every shard write a checkpoint now (of a broker tier: every member's); prints
    where each went."""
    from gradbus import admin
    replies = admin.checkpoint(broker_url, timeout, curve=curve)
    if as_json:
        click.echo(json.dumps(replies, indent=2, sort_keys=True))
    else:
        click.echo(render.checkpoint_text(replies))
    if any(r.get("error") for r in replies):
        sys.exit(1)


@click.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@click.option("--all", "show_all", is_flag=True, help="Also list partitions holding nothing.")
@click.option("--timeout", default=5.0, show_default=True, type=float)
@curve_options("client")
def partitions(broker_url, as_json, show_all, timeout, curve):
    """The partition table: primary, standbys, epoch and seq of every placed partition (and,
    of a broker tier's member, the tier's map: each member's share of the home partitions)."""
    from gradbus import admin
    st = admin.request(broker_url, wire.STATUS, timeout, curve=curve, table=True)["status"]
    t = st["table"]
    rows = render.partition_rows(t, show_all)
    tier = st.get("tier")
    if as_json:
        click.echo(json.dumps({"version": t["version"], "partitions": rows,
                               **({"tier": tier} if tier else {})}, indent=2))
        return
    if tier:
        click.echo(f"tier     {render.tier_text(tier)}")
    click.echo(render.partitions_text(rows))


@config.config_option
@click.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--timeout", default=5.0, show_default=True, type=float)
@curve_options("client")
def status(broker_url, as_json, timeout, curve):
    """Shards, partitions, workers, tensor versions and counters of a running cluster."""
    from gradbus import admin
    st = admin.status(broker_url, timeout, curve=curve)
    if as_json:
        click.echo(json.dumps(st, indent=2, sort_keys=True))
        return
    click.echo(render.status_text(st, broker_url))


@config.config_option
@click.command()
@broker_option
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.05, 60),
              help="Seconds between refreshes (and between the two samples of --once).")
@click.option("--once", is_flag=True, help="Print one frame from two samples and exit.")
@curve_options("client")
def top(broker_url, interval, once, curve):
    """A live dashboard of a running cluster: rates, lag, bytes, errors. q or Ctrl-C quits."""
    from gradbus import top as dashboard
    if once:
        dashboard.once(broker_url, interval, curve=curve)
    else:
        dashboard.run(broker_url, interval, curve=curve)
