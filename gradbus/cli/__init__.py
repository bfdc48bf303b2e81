"""The ``gradbus`` command.

Serving (:mod:`gradbus.cli.serve`):
  broker              run a broker in the foreground
  shard               run a shard in the foreground
  up                  a local cluster: a broker and N shards, restarted when they die
  restore             a local cluster started from checkpoints (at a point in time)

Operating a running cluster (:mod:`gradbus.cli.ops`, text from :mod:`gradbus.cli.render`):
  status              shards, partitions, workers, tensors and counters
  top                 a live dashboard
  partitions          the partition table
  checkpoint          every shard writes a checkpoint now
  rebalance           even out the shards' load by moving partitions
  shard drain ID      move everything off a shard, which then stops

A broker tier (:mod:`gradbus.cli.tier`, the mover in :mod:`gradbus.tier_admin`):
  tier                the tier's map, and moving names between its members under load
  tier map            the newest map: each member's share of the home partitions
  tier move HOMES     give home partitions to one member
  tier rebalance      even out the home partitions over the members
  tier drain I        move every name of member I to the others
  tier join URL       add a broker to the tier and give it its share

Demos (:mod:`gradbus.cli.demo`):
  demo                train an MLP on handwritten digits
  demo ctr            train a click-through-rate model on embedding tables
  worker, ctr-worker  one demo worker (hidden; the demos start them)

Files:
  keys generate DIR   a CURVE key pair (:mod:`gradbus.cli.keys`)
  config show         the settings every command would use, and where each came from
  config check FILE   validate a cluster config file (both in :mod:`gradbus.config`)

Shared options (broker URL, heartbeats, metrics, CURVE) are in :mod:`gradbus.cli.options`.
"""
from __future__ import annotations

import click

from gradbus import config
from gradbus.cli import demo, keys, ops, serve, tier
from gradbus.codecs.errors import GradbusError


class _Gradbus(click.Group):
    """The command group: a GradbusError from any command is reported like a click error
    ("Error: CODE: message", exit status 1)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except GradbusError as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=_Gradbus, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gradbus")
def main() -> None:
    """gradbus: an asynchronous parameter server over a ZeroMQ broker."""


serve.shard.add_command(ops.shard_drain)
for _cmd in (serve.broker, serve.shard, serve.up, serve.restore, ops.status, ops.top,
             ops.partitions, ops.checkpoint_cmd, ops.rebalance, demo.demo, demo.ctr_worker_cmd,
             demo.worker_cmd, keys.keys, config.config_group, tier.tier):
    main.add_command(_cmd)

__all__ = ["main"]
