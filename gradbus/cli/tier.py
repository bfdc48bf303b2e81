"""``gradbus tier``: a broker tier's map, and moving names between its members (protocol
section 24.4): ``map``, ``move``, ``rebalance``, ``drain``, ``join``."""
from __future__ import annotations

import json

import click

from gradbus.cli.options import broker_option, curve_options


def _tier_options(f):
    f = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(f)
    f = click.option("--timeout", default=60.0, show_default=True, type=float,
                     help="Seconds each step may take.")(f)
    return broker_option(curve_options("client")(f))


def _run(as_json: bool, fn, **kw) -> None:
    try:      # progress on stderr, even with --json
        done = fn(progress=lambda line: click.echo(line, err=True), **kw)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(done, indent=2))
        return
    click.echo(f"map v{done['version']}: {len(done['names'])} names moved "
               f"({done['bytes'] / 2 ** 20:.1f} MiB)")


@click.group()
def tier() -> None:
    """A broker tier: its map, and moving names between members under load."""


@tier.command("map")
@broker_option
@curve_options("client")
@click.option("--json", "as_json", is_flag=True, help="Print the map as JSON.")
@click.option("--timeout", default=5.0, show_default=True, type=float)
def map_cmd(broker_url, curve, as_json, timeout):
    """The newest map the members hold: each member's URLs and home partitions."""
    from gradbus import tier_admin
    tm = tier_admin.current_map(broker_url, timeout, curve)
    if as_json:
        click.echo(json.dumps(tm.to_json(), indent=2))
        return
    click.echo(f"tier map v{tm.version}, {tm.partitions} home partitions")
    for d in tm.describe():
        click.echo(f"  member {d['member']}: {d['partitions']:>5} home partitions  "
                   f"{','.join(d['urls'])}")


@tier.command()
@click.argument("homes")
@click.option("--to", "to", required=True, type=click.IntRange(0), help="The member to give them.")
@_tier_options
def move(homes, to, broker_url, curve, as_json, timeout):
    """Give home partitions HOMES (comma-separated, ranges as 3-9) to member --to."""
    from gradbus import tier_admin
    try:
        hs = [h for part in homes.split(",") if part for h in _range(part)]
    except ValueError:
        raise click.BadParameter(f"{homes!r}: home partitions as 1,2,5-9", param_hint="HOMES")
    _run(as_json, tier_admin.move, url=broker_url, homes=hs, to=to, curve=curve,
         timeout=timeout)


def _range(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


@tier.command()
@_tier_options
def rebalance(broker_url, curve, as_json, timeout):
    """Even out the home partitions over every member (finishing any move left half done)."""
    from gradbus import tier_admin
    _run(as_json, tier_admin.rebalance, url=broker_url, curve=curve, timeout=timeout)


@tier.command()
@click.argument("member", type=click.IntRange(0))
@_tier_options
def drain(member, broker_url, curve, as_json, timeout):
    """Move every name of MEMBER (its index) to the other members, e.g. before stopping it."""
    from gradbus import tier_admin
    tm = tier_admin.current_map(broker_url, min(timeout, 5.0), curve)
    rest = [i for i in range(len(tm.members)) if i != member]
    if member >= len(tm.members) or not rest:
        raise click.UsageError(f"drain: the tier's members are 0..{len(tm.members) - 1}, and "
                               f"one must be left")
    _run(as_json, tier_admin.rebalance, url=broker_url, members=rest, curve=curve,
         timeout=timeout)


@tier.command()
@click.argument("member_url")
@_tier_options
def join(member_url, broker_url, curve, as_json, timeout):
    """Add the broker at MEMBER_URL (started with --tier naming every member and it last) to
    the tier, and give it its share."""
    from gradbus import tier_admin
    _run(as_json, tier_admin.join, url=broker_url, member=member_url, curve=curve,
         timeout=timeout)
