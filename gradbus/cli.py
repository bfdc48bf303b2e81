"""The ``gradbus`` command: broker, shard, up, demo, status."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import click

from gradbus import config
from gradbus.codecs import net, timing
from gradbus.codecs.errors import GradbusError
from gradbus.codecs.partition import DEFAULT_PARTITIONS

broker_option = click.option(
    "--broker", "broker_url", default=net.default_broker, show_default="$GRADBUS_BROKER or "
    + net.DEFAULT_BROKER, help="The broker's client URL.")


replicas_option = click.option(
    "--replicas", default=1, show_default=True, type=click.IntRange(1, 16),
    help="Copies of every partition: a primary and replicas-1 hot standbys on other shards.")


def heartbeat_options(f):
    f = click.option("--liveness", default=timing.LIVENESS, show_default=True,
                     type=click.IntRange(2, 100),
                     help="Heartbeat intervals of silence before a peer is declared dead.")(f)
    return click.option("--heartbeat-interval", default=timing.HEARTBEAT_INTERVAL,
                        show_default=True, type=click.FloatRange(0.01, 60),
                        help="Seconds between heartbeats (broker and shards must agree).")(f)


def _logging(verbose: int) -> None:
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _on_signals(stop) -> None:
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gradbus")
def main() -> None:
    """gradbus: an asynchronous parameter server over a ZeroMQ broker."""


@config.config_option
@main.command()
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
@click.option("--shard-credit", default=4, show_default=True, type=click.IntRange(1, 1024),
              help="Batches in flight to one shard.")
@click.option("--max-pending-mb", default=512, show_default=True, type=click.IntRange(1),
              help="Queued tensor MiB above which the broker stops reading clients.")
@replicas_option
@heartbeat_options
@click.option("--fault-drop", default=0.0, type=click.FloatRange(0, 0.5), hidden=True,
              help="Testing: drop this fraction of pushes in and acks out (seeded).")
@click.option("--fault-seed", default=0, type=int, hidden=True)
@click.option("-v", "--verbose", count=True)
def broker(host, port, backend_port, events_port, partitions, batch_window, shard_credit,
           max_pending_mb, replicas, heartbeat_interval, liveness, fault_drop, fault_seed,
           verbose):
    """Run a broker in the foreground. Prints 'listening: URL' when bound."""
    _logging(verbose)
    from gradbus.broker.server import BrokerServer
    try:
        srv = BrokerServer(host, port, backend_port=backend_port, events_port=events_port,
                           partitions=partitions, batch_window=batch_window,
                           shard_credit=shard_credit, max_pending_bytes=max_pending_mb << 20,
                           replicas=replicas, heartbeat_interval=heartbeat_interval,
                           liveness=liveness, fault_drop=fault_drop, fault_seed=fault_seed)
    except Exception as e:
        raise click.ClickException(f"cannot start broker: {e}")
    _on_signals(srv.stop)
    click.echo(f"listening: {srv.url}", nl=True)
    sys.stdout.flush()
    srv.run()


@config.config_option
@main.command()
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
@click.option("-v", "--verbose", count=True)
def shard(broker_url, shard_id, weights_codec, nan_policy, fault_apply_delay, heartbeat_interval,
          liveness, verbose):
    """Run a shard in the foreground; it needs only the broker's client URL."""
    _logging(verbose)
    from gradbus.shards.server import ShardServer
    try:
        srv = ShardServer(broker_url, shard_id, weights_codec=weights_codec, nan_policy=nan_policy,
                          apply_delay=fault_apply_delay, heartbeat_interval=heartbeat_interval,
                          liveness=liveness)
    except GradbusError as e:
        raise click.ClickException(str(e))
    _on_signals(srv.stop)
    try:
        srv.run()
    except GradbusError as e:
        raise click.ClickException(str(e))


@config.config_option
@main.command()
@click.option("--shards", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--port", default=5555, show_default=True, type=click.IntRange(0, 65535),
              help="Client port (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--partitions", default=DEFAULT_PARTITIONS, show_default=True,
              type=click.IntRange(1, 65535))
@replicas_option
def up(shards, port, host, partitions, replicas):
    """Run a local cluster (broker + shards) in the foreground until Ctrl-C or SIGTERM."""
    from gradbus.cluster import LocalCluster
    stop = threading.Event()
    _on_signals(stop.set)
    forward = config.forward_args(click.get_current_context())   # children read the same file
    if replicas > shards:
        raise click.BadParameter(f"{replicas} replicas need at least as many shards "
                                 f"(--shards {shards})", param_hint="--replicas")
    cluster = LocalCluster(shards, port=port, host=host, partitions=partitions, quiet=False,
                           replicas=replicas, broker_args=forward, shard_args=forward)
    try:
        cluster.start()
    except GradbusError as e:
        raise click.ClickException(str(e))
    try:
        click.echo(f"ready: {cluster.url}")
        sys.stdout.flush()
        while not stop.wait(0.5):
            dead = [n for n, p in cluster.shard_procs.items() if p.poll() is not None]
            if cluster.broker_proc.poll() is not None:
                click.echo("broker exited; stopping", err=True)
                break
            for n in dead:
                click.echo(f"{n} exited with {cluster.shard_procs[n].returncode}", err=True)
                cluster.shard_procs.pop(n)
    finally:
        cluster.stop()
        click.echo("stopped")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@config.config_option
@main.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--timeout", default=5.0, show_default=True, type=float)
def status(broker_url, as_json, timeout):
    """Shards, partitions, workers, tensor versions and counters of a running cluster."""
    from gradbus import admin
    try:
        st = admin.status(broker_url, timeout)
    except GradbusError as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(st, indent=2, sort_keys=True))
        return
    c = st["counters"]
    click.echo(f"broker   {broker_url}  up {st['uptime_s']:.0f}s  partitions "
               f"{st['partitions_assigned']}/{st['partitions']} assigned"
               + (f"  DOWN {len(st['partitions_down'])}" if st["partitions_down"] else ""))
    click.echo(f"pushes   received {c.get('pushes_received', 0)}  applied "
               f"{c.get('pushes_applied', 0)}  batches {c.get('batches', 0)}  duplicates "
               f"{c.get('duplicates', 0)}  errors {sum(st['errors'].values())}")
    click.echo("")
    click.echo(f"{'SHARD':<16}{'STATE':<8}{'PARTITIONS':>11}{'BYTES':>12}{'APPLIED':>10}"
               f"{'INFLIGHT':>10}{'SEEN':>8}")
    for s in st["shards"]:
        click.echo(f"{s['id']:<16}{'alive' if s['alive'] else 'DEAD':<8}{s['partitions']:>11}"
                   f"{_fmt_bytes(s['bytes']):>12}{s['info'].get('pushes_applied', 0):>10}"
                   f"{s['inflight']:>10}{s['last_seen_s']:>7.1f}s")
    click.echo("")
    click.echo(f"{'WORKER':<34}{'PUSHES':>10}{'SEEN':>8}")
    for w in st["workers"]:
        click.echo(f"{w['id']:<34}{w['pushes']:>10}{w['last_seen_s']:>7.1f}s")
    click.echo("")
    click.echo(f"{'TENSOR':<24}{'DTYPE':<9}{'SHAPE':<18}{'BLOCKS':>7}{'VERSION':>9}  OPTIMIZER")
    for t in st["tensors"]:
        click.echo(f"{t['name']:<24}{t['dtype']:<9}{str(tuple(t['shape'])):<18}{t['blocks']:>7}"
                   f"{t['version']:>9}  {t['optimizer']}")


@config.config_option
@main.command()
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 16))
@click.option("--shards", default=2, show_default=True, type=click.IntRange(1, 16))
@click.option("--epochs", default=None, type=click.IntRange(1, 1000),
              help="Epochs per worker (default: the model's default).")
@click.option("--codec", default="raw", show_default=True, help="Gradient codec chain.")
@click.option("--broker", "broker_url", default=None,
              help="Train against this running cluster instead of starting one.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on the last line.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--error-feedback/--no-error-feedback", default=True, show_default=True,
              help="Keep what a lossy codec did not send and add it to the next gradient.")
@click.option("--accumulate", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="Sum this many local steps per push.")
@click.option("--optimizer", type=click.Choice(["adam", "momentum"]), default="adam",
              show_default=True, help="Server-side optimizer (the baseline always uses adam).")
def demo(workers, shards, epochs, codec, broker_url, as_json, seed, error_feedback, accumulate,
         optimizer):
    """Train an MLP on the handwritten digits with asynchronous workers through gradbus."""
    try:
        from gradbus import demo as demo_mod
    except ImportError as e:
        raise click.ClickException(f"the demo needs scikit-learn: pip install 'gradbus[demo]' ({e})")
    try:
        summary = demo_mod.run(workers=workers, shards=shards, epochs=epochs, codec=codec,
                               broker_url=broker_url, seed=seed, echo=click.echo,
                               error_feedback=error_feedback, accumulate=accumulate,
                               optimizer=optimizer)
    except GradbusError as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        click.echo(demo_mod.format_summary(summary))


@config.config_option
@main.command("worker", hidden=True)
@broker_option
@click.option("--index", default=0, type=int)
@click.option("--workers", default=1, type=int)
@click.option("--epochs", default=None, type=int)
@click.option("--codec", default="raw")
@click.option("--seed", default=0, type=int)
@click.option("--error-feedback/--no-error-feedback", default=True)
@click.option("--accumulate", default=1, type=click.IntRange(1, 1000))
@click.option("--optimizer", type=click.Choice(["adam", "momentum"]), default="adam")
def worker_cmd(broker_url, index, workers, epochs, codec, seed, error_feedback, accumulate,
               optimizer):
    """Run one demo worker (used by `gradbus demo`; start one by hand to add a worker)."""
    from gradbus import demo as demo_mod
    demo_mod.worker_main(broker_url, index, workers, epochs, codec, seed, error_feedback,
                         accumulate, optimizer)


main.add_command(config.config_group)

__all__ = ["main"]
