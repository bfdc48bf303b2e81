"""Serving commands: `gradbus broker`, `gradbus shard` (one process each, in the foreground),
`gradbus up` (a local cluster) and `gradbus restore` (a local cluster from checkpoints)."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading

import click

from gradbus import config
from gradbus.broker.settings import SHARD_CREDIT
from gradbus.cli import options as opts
from gradbus.cli import render
from gradbus.cli.options import (
    broker_option,
    curve_options,
    heartbeat_options,
    metrics_options,
    replicas_option,
)
from gradbus.cluster import RESTART_WINDOW, RESTARTS
from gradbus.codecs.errors import GradbusError
from gradbus.codecs.partition import DEFAULT_PARTITIONS


def tier_kw(members, index, partitions: int, map_file: str | None = None,
            curve=None) -> dict:
    """The broker's tier map and place from ``--tier`` and ``--tier-index``: the newest of the
    command line's first map, the one kept in ``map_file`` and those the other members hold
    (protocol 24.4: a member restarted after a move takes the map that moved names)."""
    from gradbus.codecs.tier import TierMap
    from gradbus.tier_admin import learn_map
    try:
        tm = TierMap.spread(members, partitions)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tier")
    if index is None or index >= len(tm.members):
        raise click.BadParameter(f"give this broker's place in the tier's {len(tm.members)} "
                                 f"members (0-{len(tm.members) - 1})", param_hint="--tier-index")
    try:
        tm = learn_map(tm, index, map_file, curve)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tier-map")
    return {"tier": tm, "tier_index": index, "tier_map_file": map_file}


@config.config_option
@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=5555, show_default=True, type=click.IntRange(0, 65535),
              help="Client port (0: a free one).")
@click.option("--backend-port", default=0, type=click.IntRange(0, 65535),
              help="Shard port (0: a free one; shards learn it from the client port).")
@click.option("--events-port", default=0, type=click.IntRange(0, 65535),
              help="Events (weights) port (0: a free one).")
@click.option("--partitions", default=DEFAULT_PARTITIONS, show_default=True,
              type=click.IntRange(1, 65535), help="Partition count, fixed for the cluster's life.")
@click.option("--batch-window", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Seconds to wait gathering pushes into a batch (0: batch what arrived together).")
@click.option("--spin-us", default="auto", show_default=True, type=config.SPIN_US,
              help="Microseconds the loop polls without sleeping after a turn with messages "
                   "(0: it sleeps at once; auto: 200 where the host has cores to spare, "
                   "else 0); shortens a round trip where a core is spare, burns it.")
@click.option("--shard-credit", default=SHARD_CREDIT, show_default=True, type=click.IntRange(1, 1024),
              help="Batches in flight to one shard.")
@click.option("--max-pending-mb", default=512, show_default=True, type=click.IntRange(1),
              help="Tensor MiB the broker holds (queued, and in flight to shards) at "
                   "most; a push past it is refused with BUSY and sent again.")
@replicas_option
@heartbeat_options
@click.option("--fault-drop", default=0.0, type=click.FloatRange(0, 0.5), hidden=True,
              help="Testing: drop this fraction of pushes in and acks out (seeded).")
@click.option("--fault-seed", default=0, type=int, hidden=True)
@curve_options("broker")
@metrics_options
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Append every batch to an update log in DIR (segment files), for exact "
                   "rebuilds and point-in-time restore.")
@click.option("--log-fsync", type=click.Choice(["always", "interval", "never"]),
              default="interval", show_default=True,
              help="always: before batches go out; interval: at most once a second; never.")
@click.option("--replay-log", type=click.Path(exists=True, file_okay=False), default=None,
              help="Replay this update log onto partitions the shards bring back (after their "
                   "seq), and onto partitions none brings back.")
@click.option("--replay-until", default=None,
              help="Replay only batches logged at or before this time (unix seconds or ISO "
                   "8601).")
@click.option("--shm/--no-shm", default=True, show_default=True,
              help="Tensor bytes through shared memory with peers on this host.")
@click.option("--expect-shards", type=click.IntRange(1), default=None,
              help="After a restart or restore: once this many shards registered, stop "
                   "waiting for others to bring partitions back.")
@click.option("--peer", default=None, metavar="URL",
              help="A broker pair: the other broker's pair address (its --peer-port). One of "
                   "the two is active, the other a standby that takes over when it is gone; "
                   "shards and clients name both brokers' client URLs, comma-separated.")
@click.option("--peer-port", default=0, type=click.IntRange(0, 65535),
              help="With --peer: the port this broker's pair address binds (0: a free one, "
                   "printed as 'pair: URL').")
@click.option("--inproc-shards", default=0, type=click.IntRange(0, 64),
              help="Run this many shards inside the broker's process (ids shard-0, shard-1, "
                   "...): no crossing between broker and shard, but they fail together. "
                   "Not with --peer or CURVE.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="With --inproc-shards: they checkpoint under DIR/<shard id>/ and start "
                   "from their newest checkpoint there.")
@click.option("--checkpoint-interval", default=60.0, show_default=True,
              type=click.FloatRange(0),
              help="With --inproc-shards and --data-dir: seconds between checkpoints (0: only "
                   "on request and at a clean stop).")
@click.option("--tier", "tier_members", multiple=True, metavar="URL[,URL]",
              help="A broker tier (protocol section 24): every member's client URL (a pair's "
                   "two, comma-separated), once each, in the same order on every member. "
                   "Each member sequences the tensors and tables whose names' home "
                   "partitions the tier's map gives it.")
@click.option("--tier-index", default=None, type=click.IntRange(0),
              help="With --tier: which member this broker is (0-based); a pair's two "
                   "brokers are the same member.")
@click.option("--tier-map", "tier_map_file", type=click.Path(dir_okay=False), default=None,
              help="With --tier: a file where this member keeps the tier's map (written at "
                   "every move, read at start), so a member restarted while no other member "
                   "answers still takes the map that moved names (gradbus tier).")
@click.option("-v", "--verbose", count=True)
def broker(host, port, backend_port, events_port, partitions, batch_window, spin_us, shard_credit,
           max_pending_mb, replicas, heartbeat_interval, liveness, fault_drop, fault_seed,
           verbose, curve, metrics_port, metrics_host, log_dir, log_fsync, replay_log,
           replay_until, shm, expect_shards, peer, peer_port, inproc_shards, data_dir,
           checkpoint_interval, tier_members, tier_index, tier_map_file):
    """Run a broker in the foreground. Prints 'listening: URL' when bound (and 'metrics: URL'
    with --metrics-port, 'pair: URL' with --peer)."""
    opts.setup_logging(verbose)
    opts.server_process()
    from gradbus.broker.server import BrokerServer
    exporter = opts.exporter(metrics_port, metrics_host, "broker-metrics")
    from gradbus.broker import log as ulog
    log_kw = {}
    try:
        if replay_log:
            log_kw.update(replay=ulog.LogIndex(replay_log),
                          replay_until=opts.parse_time(replay_until, "--replay-until"))
        if log_dir:
            log_kw["log"] = ulog.UpdateLog(log_dir, log_fsync)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"update log: {e}")
    if peer is not None and log_kw:
        raise click.UsageError("--peer runs without an update log for now")
    if inproc_shards and (peer is not None or curve is not None):
        raise click.UsageError("--inproc-shards runs without --peer and without CURVE")
    if data_dir and not inproc_shards:
        raise click.UsageError("--data-dir is for --inproc-shards (a shard process takes "
                               "its own)")
    pair_kw = {"peer": peer, "peer_port": peer_port} if peer is not None else {}
    if tier_members:
        # the other members are asked for their map with this broker's own key pair, which
        # they admit where every member holds the one broker key pair (compose, `up --curve`)
        asks = None if curve is None else dataclasses.replace(curve, server_key=curve.public,
                                                              allow=None)
        pair_kw.update(tier_kw(tier_members, tier_index, partitions, tier_map_file, asks))
    elif tier_index is not None or tier_map_file:
        raise click.UsageError("--tier-index and --tier-map are for a member of a --tier")

    def start(pair=None):
        return BrokerServer(host, port, backend_port=backend_port, events_port=events_port,
                            partitions=partitions, batch_window=batch_window,
                            spin=config.spin_seconds(spin_us),
                            shard_credit=shard_credit, max_pending_bytes=max_pending_mb << 20,
                            replicas=replicas, heartbeat_interval=heartbeat_interval,
                            liveness=liveness, fault_drop=fault_drop, fault_seed=fault_seed,
                            curve=curve, on_metrics=exporter.update if exporter else None,
                            expect_shards=expect_shards, shm=shm, pair=pair, **pair_kw,
                            **log_kw)
    srv = None
    exporters = [exporter] if exporter else []    # the broker's, then each inproc shard's
    try:
        srv = start()
        for i in range(inproc_shards):
            shard = _inproc_shard(srv, f"shard-{i}", shm=shm,
                                  heartbeat_interval=heartbeat_interval, liveness=liveness,
                                  data_dir=data_dir, checkpoint_interval=checkpoint_interval)
            if exporter:    # as `up` numbers them: shard i on PORT+1+i (0: free ports)
                exporters.append(opts.exporter(metrics_port + 1 + i if metrics_port else 0,
                                               metrics_host, f"{shard.shard_id}-metrics"))
                shard.on_metrics, shard.metrics_url = exporters[-1].update, exporters[-1].url
    except Exception as e:
        if srv is not None:
            srv.close()
        for exp in exporters:
            exp.close()
        raise click.ClickException(f"cannot start broker: {e}")
    stop = threading.Event()
    opts.on_signals(lambda: (stop.set(), srv.stop()))
    click.echo(f"listening: {srv.url}", nl=True)
    logging.getLogger("gradbus.broker").info("loop: %s", srv.spin.describe())
    if srv.pair_link is not None:
        click.echo(f"pair: {srv.pair_link.url}")
    if exporter:
        click.echo(f"metrics: {exporter.url}")
    sys.stdout.flush()
    try:
        while True:
            if exporter:
                srv.core.metrics_url = exporter.url
            srv.run()
            if srv.deposed is None or stop.is_set():
                break
            # deposed: the same ports again, as the standby, holding nothing
            backend_port, events_port = srv.backend_port, srv.events_port
            pair_kw["peer_port"] = srv.pair_link.port
            srv = start(srv.pair)
    finally:
        for exp in exporters:
            exp.close()
        if log_kw.get("log"):
            log_kw["log"].close()


def _inproc_shard(srv, shard_id: str, data_dir: str | None, **kw):
    """A shard inside the broker's process, from its newest checkpoint under ``data_dir``
    where it has one."""
    from gradbus.shards import checkpoint
    from gradbus.shards.server import ShardServer
    restore = None
    if data_dir:
        ck = checkpoint.newest(data_dir, shard_id)
        restore = ck.path if ck is not None else None
    return srv.add_shard(lambda connect: ShardServer(srv.url, shard_id, ctx=srv.ctx,
                                                     data_dir=data_dir, restore=restore,
                                                     connect=connect, **kw))


@config.config_option
@click.group(invoke_without_command=True)
@broker_option
@click.option("--id", "shard_id", default=None, help="Shard id (default: a random one).")
@click.option("--weights-codec", default="raw", show_default=True,
              help="Codec chain for republished weights, e.g. raw, bf16, raw|shuffle|zstd; "
                   "prefix delta| to send the change since the last publish.")
@click.option("--nan-policy", type=click.Choice(["refuse", "allow"]), default="refuse",
              show_default=True, help="What to do with a gradient holding NaN or Inf.")
@click.option("--fault-apply-delay", default=0.0, type=click.FloatRange(0, 10), hidden=True,
              help="Testing: sleep this long before each batch or snapshot (a slow shard).")
@heartbeat_options
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Write checkpoints under DIR/<shard id>/ (off when unset).")
@click.option("--checkpoint-interval", default=60.0, show_default=True,
              type=click.FloatRange(0),
              help="Seconds between checkpoints with --data-dir (0: only on request and at a "
                   "clean stop).")
@click.option("--checkpoint-keep", default=3, show_default=True, type=click.IntRange(1),
              help="Checkpoints kept.")
@click.option("--shm/--no-shm", default=True, show_default=True,
              help="Tensor bytes through shared memory with peers on this host.")
@click.option("--restore", "restore_path", type=click.Path(exists=True, file_okay=False),
              default=None, help="Load this checkpoint directory before registering.")
@click.option("--spin-us", default="auto", show_default=True, type=config.SPIN_US,
              help="Microseconds the loop polls without sleeping after a turn with messages "
                   "(0: it sleeps at once; auto: 200 where the host has cores to spare, "
                   "else 0).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0, 256),
              help="Threads that pass over a batch's bytes (0: the usable cores over "
                   "$GRADBUS_HOST_SHARDS, the shards of this host, at most 8; or "
                   "$GRADBUS_SHARD_THREADS).")
@curve_options("shard")
@metrics_options
@click.option("-v", "--verbose", count=True)
@click.pass_context
def shard(ctx, broker_url, shard_id, weights_codec, nan_policy, fault_apply_delay,
          heartbeat_interval, liveness, data_dir, checkpoint_interval, checkpoint_keep,
          restore_path, shm, spin_us, threads, verbose, curve, metrics_port, metrics_host):
    """Run a shard in the foreground; it needs only the broker's client URL.
    (`gradbus shard drain ID` moves everything off a running shard instead.)"""
    if ctx.invoked_subcommand is not None:
        return
    opts.setup_logging(verbose)
    opts.server_process()
    from gradbus.shards.server import ShardServer
    srv = ShardServer(broker_url, shard_id, weights_codec=weights_codec, nan_policy=nan_policy,
                      apply_delay=fault_apply_delay, heartbeat_interval=heartbeat_interval,
                      liveness=liveness, data_dir=data_dir,
                      checkpoint_interval=checkpoint_interval,
                      checkpoint_keep=checkpoint_keep, restore=restore_path, curve=curve,
                      shm=shm, spin=config.spin_seconds(spin_us),
                      threads=threads)
    exporter = opts.exporter(metrics_port, metrics_host, f"{srv.shard_id}-metrics")
    if exporter:
        srv.on_metrics, srv.metrics_url = exporter.update, exporter.url
        click.echo(f"metrics: {exporter.url}")
        sys.stdout.flush()
    opts.on_signals(srv.stop)
    try:
        srv.run()
    finally:
        if exporter:
            exporter.close()


@config.config_option
@click.command()
@click.option("--shards", default=None, type=click.IntRange(1, 64),
              help="Shard processes (default: from the host's cores: 2 up to 16 usable "
                   "cores, then one per 8, at most 8).")
@click.option("--port", default=5555, show_default=True, type=click.IntRange(0, 65535),
              help="Client port (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--partitions", default=DEFAULT_PARTITIONS, show_default=True,
              type=click.IntRange(1, 65535))
@replicas_option
@click.option("--curve", "curve_dir", type=click.Path(file_okay=False), default=None,
              metavar="DIR", help="CURVE on: generate (or reuse) broker, shard and client keys "
                                  "in DIR; clients use DIR/client.key_secret and DIR/broker.key.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Prometheus metrics: the broker on PORT, shard i on PORT+1+i (0: free ports; "
                   "unset: off). `gradbus status --json` lists every URL.")
@click.option("--backend-port", default=None, type=click.IntRange(0, 65535),
              help="The broker's shard port (default: a free one below the ephemeral range, "
                   "kept across its restarts).")
@click.option("--events-port", default=None, type=click.IntRange(0, 65535),
              help="The broker's events port (default: a free one below the ephemeral range, "
                   "kept across its restarts).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Shards checkpoint under DIR/<shard id>/ and start (and restart) from their "
                   "newest checkpoint there (default: the [shard] data_dir setting; unset: "
                   "no checkpoints).")
@click.option("--shm/--no-shm", default=True, show_default=True,
              help="Tensor bytes through shared memory with peers on this host.")
@click.option("--max-restarts", default=RESTARTS, show_default=True, type=click.IntRange(0),
              help=f"Restarts of one process within {RESTART_WINDOW:g}s before up gives up "
                   "and exits non-zero (0: none).")
@click.option("--brokers", default=1, show_default=True, type=click.IntRange(1, 2),
              help="2: a broker pair, an active broker (on --port) and a standby (on a free "
                   "port) that takes over when it dies; 'ready:' names both URLs, for "
                   "clients and ops commands.")
@click.option("--inproc", is_flag=True,
              help="The shards run inside the broker's process (gradbus broker "
                   "--inproc-shards): a shorter round trip on one host; they fail and restart "
                   "with the broker. Not with --brokers 2 or --curve.")
@click.option("--tier-brokers", default=1, show_default=True, type=click.IntRange(1, 16),
              help="A broker tier of N members on this host (protocol section 24): each a "
                   "broker (a pair with --brokers 2) with --shards shards of its own, "
                   "sequencing the tensors and tables whose names' home partitions the tier's "
                   "map gives it; 'ready:' names the first member, which clients follow to the "
                   "others. Members after the first take free ports; with --metrics-port P, "
                   "member i's processes take theirs from P + i x (brokers x (1 + shards)); "
                   "--curve and --data-dir are shared.")
def up(shards, port, host, partitions, replicas, curve_dir, metrics_port, backend_port,
       events_port, data_dir, shm, max_restarts, brokers, inproc, tier_brokers):
    """Run a local cluster (broker + shards) in the foreground until Ctrl-C or SIGTERM.

    A process that dies is started again after a back-off: the broker on the same ports, a
    shard from its newest checkpoint in --data-dir. up exits non-zero when one keeps dying,
    or when a process fails at the stop (a shard whose final checkpoint failed)."""
    from gradbus.cluster import LocalCluster, RestartPolicy
    stop = threading.Event()
    opts.on_signals(stop.set)
    ctx = click.get_current_context()
    forward = config.forward_args(ctx)   # children read the same file
    forward = [*forward, "--shm" if shm else "--no-shm"]
    shards = _layout(shards, inproc, tier_brokers)
    if replicas > shards:
        raise click.BadParameter(f"{replicas} replicas need at least as many shards "
                                 f"(--shards {shards})", param_hint="--replicas")
    if brokers == 2 and (backend_port or events_port):
        raise click.UsageError("--brokers 2 runs on free backend and events ports")
    if data_dir is None:    # the shards read the setting too: up restarts them from it
        data_dir = config.resolve(config.loaded(ctx))["shard.data_dir"].value
    if tier_brokers > 1:
        if backend_port or events_port:
            raise click.UsageError("--tier-brokers runs every member on free backend and "
                                   "events ports")
        from gradbus.tier_cluster import TierCluster
        try:
            tier = TierCluster(tier_brokers, shards, pairs=brokers == 2, host=host, port=port,
                               partitions=partitions, quiet=False, replicas=replicas,
                               broker_args=forward, shard_args=forward, inproc=inproc,
                               curve_dir=curve_dir, metrics_port=metrics_port,
                               data_dir=data_dir)
        except (GradbusError, OSError, ValueError) as e:
            raise click.ClickException(str(e))
        _run_cluster(tier, stop, RestartPolicy(max_restarts))
        return
    try:
        cluster = LocalCluster(shards, port=port, host=host, partitions=partitions, quiet=False,
                               replicas=replicas, broker_args=forward, shard_args=forward,
                               curve_dir=curve_dir, metrics_port=metrics_port,
                               backend_port=backend_port or 0, events_port=events_port or 0,
                               data_dir=data_dir, brokers=brokers, inproc=inproc)
    except (GradbusError, OSError, ValueError) as e:
        raise click.ClickException(str(e))
    _run_cluster(cluster, stop, RestartPolicy(max_restarts))


def _layout(shards: int | None, inproc: bool, members: int = 1) -> int:
    """The shards ``up`` runs per broker (``shards``, else from the host's cores and the
    tier's ``members``), said on stderr with the pass threads and the spins the processes
    will choose."""
    from gradbus.codecs import cores
    n = cores.usable_cores()
    picked = shards or max(1, cores.local_shards(n) // members)
    # in-process shards share their broker's one pool; shard processes divide the cores
    threads = cores.pass_threads(host_shards=members * (1 if inproc else picked))
    load = cores.host_load()
    tier = f" on each of {members} tier brokers" if members > 1 else ""
    click.echo(f"layout: {picked} shard{'s' * (picked != 1)}"
               f"{' in the broker process' if inproc else ''}{tier} ({'set' if shards else 'from'} "
               f"{'--shards' if shards else f'{n} usable cores'}), {threads} pass "
               f"thread{'s' * (threads != 1)} "
               f"{('per broker' if members > 1 else 'in all') if inproc else 'each'}; loops spin "
               f"after work: {'yes' if cores.spare(n, load) else 'no'} (load {load:.1f})",
               err=True)
    return picked


def _run_cluster(cluster, stop: threading.Event, policy=None) -> None:
    """Start a local cluster, say 'ready: URL', and keep its processes running
    (:meth:`LocalCluster.supervise`) until a signal; exits non-zero when it gave up on one or
    when one failed at the stop."""
    cluster.start()
    gave_up = None
    try:
        click.echo(f"ready: {cluster.url}")
        if getattr(cluster, "keys", None) is not None:
            click.echo(f"curve: clients use --curve-secret {cluster.keys.path('client', True)} "
                       f"--curve-server-key {cluster.keys.path('broker')}")
        sys.stdout.flush()
        gave_up = cluster.supervise(stop, policy, say=lambda text: click.echo(text, err=True))
    finally:
        codes = cluster.stop()
        click.echo("stopped")
    failed = [f"{name} exited with {code}" for name, code in codes.items() if code != 0]
    if failed:
        failed[-1] += (" while stopping (a shard whose final checkpoint failed exits non-zero: "
                       "see its log above)")
    if gave_up or failed:
        raise click.ClickException("; ".join(([gave_up] if gave_up else []) + failed))


@click.command()
@click.option("--from", "source", required=True, type=click.Path(exists=True, file_okay=False),
              help="A data directory shards checkpointed into (DIR/<shard id>/ckpt-...).")
@click.option("--at", "at", default=None,
              help="Restore each shard's newest checkpoint taken at or before this time "
                   "(unix seconds or ISO 8601; default: the newest).")
@click.option("--port", default=5555, show_default=True, type=click.IntRange(0, 65535))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--partitions", default=DEFAULT_PARTITIONS, show_default=True,
              type=click.IntRange(1, 65535), help="Must match the checkpointed cluster's.")
@replicas_option
@click.option("--data-dir", default=None, type=click.Path(file_okay=False),
              help="Where the restored shards write their checkpoints: any folder but --from "
                   "(default: a new one, FROM/restores/<time>/).")
@click.option("--log", "log_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="The broker's update log (--log-dir): replay it on top of the checkpoints "
                   "up to --at, so the state is exact to the update.")
@click.option("--fallback-to-older", "fallback", is_flag=True,
              help="If a shard's newest checkpoint is damaged, use its newest undamaged one "
                   "(each skipped checkpoint is named in a warning).")
@click.option("--dry-run", is_flag=True, help="Print what would be restored and exit.")
def restore(source, at, port, host, partitions, replicas, data_dir, log_dir, fallback, dry_run):
    """Start a local cluster from checkpoints: one shard per checkpointed shard id, each loading
    its newest checkpoint at or before --at, in the foreground until Ctrl-C or SIGTERM. Every
    checkpoint chosen is checked in full first: a damaged one is refused, naming the file, or
    with --fallback-to-older skipped for an older one."""
    from gradbus.cluster import LocalCluster
    from gradbus.shards import checkpoint
    when = opts.parse_time(at)
    if data_dir is not None and _same_dir(data_dir, source):
        raise click.BadParameter("must not be --from: a restored cluster never writes into the "
                                 "history it reads (leave --data-dir out for a new folder "
                                 f"{os.path.join(source, RESTORES, '<time>')})",
                                 param_hint="--data-dir")
    ids = checkpoint.shards_in(source) or (["shard-0"] if log_dir else [])
    chosen = _choose_checkpoints(source, ids, when, at, fallback)
    if not chosen and not log_dir:
        raise click.ClickException(f"no checkpoint in {source}"
                                   + (f" taken at or before {at}" if at else ""))
    click.echo(render.restore_plan_text(ids, chosen, log_dir, at))
    if dry_run:
        return
    stop = threading.Event()
    opts.on_signals(stop.set)
    ddir = data_dir or _new_timeline(source)
    click.echo(f"new checkpoints go to {ddir}")
    replay = ["--replay-log", log_dir, "--expect-shards", str(len(ids))] + (
        ["--replay-until", repr(when)] if when else []) if log_dir else []
    cluster = LocalCluster(len(ids), port=port, host=host, partitions=partitions, quiet=False,
                           replicas=replicas, shard_ids=ids, broker_args=replay, data_dir=ddir,
                           restore_from={sid: ck.path for sid, ck in chosen.items()})
    _run_cluster(cluster, stop)


RESTORES = "restores"     # FROM/restores/<time>/: the checkpoints of clusters restored from FROM


def _choose_checkpoints(source: str, ids: list[str], when: float | None, at: str | None,
                        fallback: bool) -> dict:
    """Each shard id's newest checkpoint at or before ``when``, loaded in full to check it (a
    shard id without one is left out: it starts empty). A damaged one is refused naming the
    file, or with ``fallback`` skipped for the next older, each skip said on stderr; a shard
    whose every checkpoint there is damaged is refused either way."""
    import logging

    from gradbus.shards import checkpoint
    skipped: list[str] = []

    class Say(logging.Handler):     # the skips checkpoint.newest logs, as warnings here
        def emit(self, record):
            skipped.append(record.getMessage())
            click.echo(f"warning: {record.getMessage()}", err=True)
    say, logger = Say(logging.WARNING), logging.getLogger(checkpoint.log.name)
    logger.addHandler(say)
    chosen = {}
    try:
        for sid in ids:
            del skipped[:]
            ck = checkpoint.newest(source, sid, when, fallback=fallback)
            if ck is None:
                if skipped:
                    raise click.ClickException(
                        f"every checkpoint of {sid} in {source}"
                        + (f" taken at or before {at}" if at else "")
                        + " is damaged (see the warnings above)")
                continue
            if not fallback:
                checkpoint.load(ck)     # with fallback, newest loaded it already
            chosen[sid] = ck
    except checkpoint.DamagedCheckpoint as e:
        raise click.ClickException(f"{e} (--fallback-to-older restores the newest undamaged "
                                   f"checkpoint instead)") from None
    finally:
        logger.removeHandler(say)
    return chosen


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _new_timeline(source: str) -> str:
    """A new folder FROM/restores/<local time>[-N]/ for a restored cluster's checkpoints: no
    shard id of FROM is named "restores", so restores from FROM never see these."""
    import datetime
    base = os.path.join(source, RESTORES,
                        datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S"))
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for n in range(1, 1000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise click.ClickException(f"cannot make a new folder under {os.path.dirname(base)}")
