"""The ``gradbus`` command: broker, shard, up, demo, status."""
from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import threading

import click

from gradbus import config
from gradbus.codecs import net, timing
from gradbus.codecs.errors import GradbusError
from gradbus.broker.core import SHARD_CREDIT
from gradbus.codecs.partition import DEFAULT_PARTITIONS

broker_option = click.option(
    "--broker", "broker_url", default=net.default_broker, show_default="$GRADBUS_BROKER or "
    + net.DEFAULT_BROKER, help="The broker's client URL.")


replicas_option = click.option(
    "--replicas", default=1, show_default=True, type=click.IntRange(1, 16),
    help="Copies of every partition: a primary and replicas-1 hot standbys on other shards.")


def metrics_options(f):
    f = click.option("--metrics-host", default="127.0.0.1", show_default=True,
                     help="Address the metrics endpoint binds (0.0.0.0 in containers).")(f)
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
                        help="Serve Prometheus metrics at http://HOST:PORT/metrics "
                             "(0: a free port; unset: off).")(f)


def _exporter(port, host, name):
    if port is None:
        return None
    from gradbus.metrics import MetricsExporter
    try:
        return MetricsExporter(port, host, name)
    except OSError as e:
        raise click.ClickException(f"cannot serve metrics on {host}:{port}: {e}")


def heartbeat_options(f):
    f = click.option("--liveness", default=timing.LIVENESS, show_default=True,
                     type=click.IntRange(2, 100),
                     help="Heartbeat intervals of silence before a peer is declared dead.")(f)
    return click.option("--heartbeat-interval", default=timing.HEARTBEAT_INTERVAL,
                        show_default=True, type=click.FloatRange(0.01, 60),
                        help="Seconds between heartbeats (broker and shards must agree).")(f)


def curve_options(role: str):
    """CURVE options for a ``role`` ("broker", "shard" or "client"); the command receives
    ``curve``: a :class:`~gradbus.codecs.security.Curve`, or None with CURVE off. The broker
    takes its key pair and an allow directory, every other role its key pair and the broker's
    public key. Each option reads its ``[security]`` setting's variable, with or without
    ``--config``."""
    def option(flag: str, key: str, path: click.Path, metavar: str, help: str):
        return click.option(flag, type=path, default=None, metavar=metavar, help=help,
                            envvar=config.BY_KEY[key].envvars, show_envvar=True)

    def decorate(f):
        @functools.wraps(f)
        def run(*args, curve_secret=None, curve_server_key=None, curve_allow=None, **kw):
            return f(*args, curve=_curve(role, curve_secret, curve_server_key, curve_allow),
                     **kw)
        if role == "broker":
            run = option("--curve-allow", "security.curve_allow", click.Path(file_okay=False),
                         "DIR", "With --curve-secret: directory of the public key files "
                                "(NAME.key) of the shards and clients the broker admits.")(run)
        else:
            run = option("--curve-server-key", "security.curve_server_key",
                         click.Path(dir_okay=False), "FILE",
                         "The broker's CURVE public key file (NAME.key).")(run)
        return option("--curve-secret", "security.curve_secret", click.Path(dir_okay=False),
                      "FILE", "This process's CURVE secret key file (NAME.key_secret; unset: "
                              "CURVE off).")(run)
    return decorate


def _curve(role: str, secret, server_key, allow):
    from gradbus.codecs import security
    other, flag = (allow, "--curve-allow DIR") if role == "broker" else \
        (server_key, "--curve-server-key FILE")
    if secret is None:
        if other is not None:
            raise click.UsageError(f"{flag.split()[0]} needs --curve-secret FILE")
        return None
    if other is None:
        raise click.UsageError(f"--curve-secret needs {flag}")
    try:
        return security.Curve.from_files(secret, server_key, allow)
    except GradbusError as e:
        raise click.UsageError(str(e)) from None


def _logging(verbose: int) -> None:
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _server_process() -> None:
    """A broker or shard process keeps the memory it frees (gradbus/memory.py)."""
    from gradbus import memory
    if not memory.keep_freed_memory():
        logging.getLogger("gradbus").debug("malloc thresholds left as they are")


def _on_signals(stop) -> None:
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


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
@click.option("--shard-credit", default=SHARD_CREDIT, show_default=True, type=click.IntRange(1, 1024),
              help="Batches in flight to one shard.")
@click.option("--max-pending-mb", default=512, show_default=True, type=click.IntRange(1),
              help="Queued tensor MiB above which the broker stops reading clients.")
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
@click.option("--expect-shards", type=click.IntRange(1), default=None,
              help="After a restart or restore: once this many shards registered, stop "
                   "waiting for others to bring partitions back.")
@click.option("-v", "--verbose", count=True)
def broker(host, port, backend_port, events_port, partitions, batch_window, shard_credit,
           max_pending_mb, replicas, heartbeat_interval, liveness, fault_drop, fault_seed,
           verbose, curve, metrics_port, metrics_host, log_dir, log_fsync, replay_log,
           replay_until, expect_shards):
    """Run a broker in the foreground. Prints 'listening: URL' when bound (and 'metrics: URL'
    with --metrics-port)."""
    _logging(verbose)
    _server_process()
    from gradbus.broker.server import BrokerServer
    exporter = _exporter(metrics_port, metrics_host, "broker-metrics")
    from gradbus.broker import log as ulog
    log_kw = {}
    try:
        if replay_log:
            log_kw.update(replay=ulog.LogIndex(replay_log),
                          replay_until=_parse_time(replay_until, "--replay-until"))
        if log_dir:
            log_kw["log"] = ulog.UpdateLog(log_dir, log_fsync)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"update log: {e}")
    try:
        srv = BrokerServer(host, port, backend_port=backend_port, events_port=events_port,
                           partitions=partitions, batch_window=batch_window,
                           shard_credit=shard_credit, max_pending_bytes=max_pending_mb << 20,
                           replicas=replicas, heartbeat_interval=heartbeat_interval,
                           liveness=liveness, fault_drop=fault_drop, fault_seed=fault_seed,
                           curve=curve, on_metrics=exporter.update if exporter else None,
                           expect_shards=expect_shards, **log_kw)
    except Exception as e:
        if exporter:
            exporter.close()
        raise click.ClickException(f"cannot start broker: {e}")
    _on_signals(srv.stop)
    click.echo(f"listening: {srv.url}", nl=True)
    if exporter:
        srv.core.metrics_url = exporter.url
        click.echo(f"metrics: {exporter.url}")
    sys.stdout.flush()
    try:
        srv.run()
    finally:
        if exporter:
            exporter.close()
        if log_kw.get("log"):
            log_kw["log"].close()



@config.config_option
@main.group(invoke_without_command=True)
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
@click.option("--restore", "restore_path", type=click.Path(exists=True, file_okay=False),
              default=None, help="Load this checkpoint directory before registering.")
@curve_options("shard")
@metrics_options
@click.option("-v", "--verbose", count=True)
@click.pass_context
def shard(ctx, broker_url, shard_id, weights_codec, nan_policy, fault_apply_delay,
          heartbeat_interval, liveness, data_dir, checkpoint_interval, checkpoint_keep,
          restore_path, verbose, curve, metrics_port, metrics_host):
    """Run a shard in the foreground; it needs only the broker's client URL.
    (`gradbus shard drain ID` moves everything off a running shard instead.)"""
    if ctx.invoked_subcommand is not None:
        return
    _logging(verbose)
    _server_process()
    from gradbus.shards.server import ShardServer
    srv = ShardServer(broker_url, shard_id, weights_codec=weights_codec, nan_policy=nan_policy,
                      apply_delay=fault_apply_delay, heartbeat_interval=heartbeat_interval,
                      liveness=liveness, data_dir=data_dir,
                      checkpoint_interval=checkpoint_interval,
                      checkpoint_keep=checkpoint_keep, restore=restore_path, curve=curve)
    exporter = _exporter(metrics_port, metrics_host, f"{srv.shard_id}-metrics")
    if exporter:
        srv.on_metrics, srv.metrics_url = exporter.update, exporter.url
        click.echo(f"metrics: {exporter.url}")
        sys.stdout.flush()
    _on_signals(srv.stop)
    try:
        srv.run()
    finally:
        if exporter:
            exporter.close()


@shard.command("drain")
@click.argument("shard_id")
@broker_option
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the shard holds nothing and has stopped, showing progress.")
@click.option("--timeout", default=600.0, show_default=True, type=float)
@click.option("--json", "as_json", is_flag=True, help="Print the result (and the moves) as JSON.")
@curve_options("client")
def shard_drain(shard_id, broker_url, wait, timeout, as_json, curve):
    """Move every partition off SHARD_ID (to the shards holding fewest bytes); the shard stops
    once it holds nothing."""
    from gradbus import admin
    _moving(broker_url, curve, wait, timeout, as_json,
            lambda: admin.drain(broker_url, shard_id, curve=curve),
            lambda res: f"draining {shard_id}: {res['partitions']} partitions to move",
            until_gone=shard_id)


@main.command()
@broker_option
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the moves are done, showing progress.")
@click.option("--timeout", default=600.0, show_default=True, type=float)
@click.option("--json", "as_json", is_flag=True, help="Print the result (and the moves) as JSON.")
@curve_options("client")
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
    import time
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
                    click.echo(f"  moved partition {m['p']:>5} {m['from']} -> {m['to']}  "
                               f"{_fmt_bytes(m['bytes'])} in {m['seconds']:.3f}s")
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


@config.config_option
@main.command()
@click.option("--shards", default=2, show_default=True, type=click.IntRange(1, 64))
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
def up(shards, port, host, partitions, replicas, curve_dir, metrics_port):
    """Run a local cluster (broker + shards) in the foreground until Ctrl-C or SIGTERM."""
    from gradbus.cluster import LocalCluster
    stop = threading.Event()
    _on_signals(stop.set)
    forward = config.forward_args(click.get_current_context())   # children read the same file
    if replicas > shards:
        raise click.BadParameter(f"{replicas} replicas need at least as many shards "
                                 f"(--shards {shards})", param_hint="--replicas")
    try:
        cluster = LocalCluster(shards, port=port, host=host, partitions=partitions, quiet=False,
                               replicas=replicas, broker_args=forward, shard_args=forward,
                               curve_dir=curve_dir, metrics_port=metrics_port)
    except (GradbusError, OSError) as e:
        raise click.ClickException(str(e))
    _run_cluster(cluster, stop)


def _run_cluster(cluster, stop: threading.Event) -> None:
    """Start a local cluster, say 'ready: URL', and keep it until a signal or its broker ends."""
    cluster.start()
    try:
        click.echo(f"ready: {cluster.url}")
        if getattr(cluster, "keys", None) is not None:
            click.echo(f"curve: clients use --curve-secret {cluster.keys.path('client', True)} "
                       f"--curve-server-key {cluster.keys.path('broker')}")
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


def _parse_time(value: str | None, hint: str = "--at") -> float | None:
    """Unix seconds, or an ISO 8601 date-time (local time unless it names a zone)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    import datetime
    try:
        return datetime.datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither unix seconds nor an ISO 8601 time",
                                 param_hint=hint) from None


@main.command()
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
              help="Where the restored shards write new checkpoints (default: --from).")
@click.option("--log", "log_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="The broker's update log (--log-dir): replay it on top of the checkpoints "
                   "up to --at, so the state is exact to the update.")
@click.option("--dry-run", is_flag=True, help="Print what would be restored and exit.")
def restore(source, at, port, host, partitions, replicas, data_dir, log_dir, dry_run):
    """Start a local cluster from checkpoints: one shard per checkpointed shard id, each loading
    its newest checkpoint at or before --at, in the foreground until Ctrl-C or SIGTERM."""
    from gradbus.cluster import LocalCluster
    from gradbus.shards import checkpoint
    when = _parse_time(at)
    chosen = {}
    ids = checkpoint.shards_in(source) or (["shard-0"] if log_dir else [])
    for sid in ids:
        ck = checkpoint.newest(source, sid, when)
        if ck is not None:
            chosen[sid] = ck
    if not chosen and not log_dir:
        raise click.ClickException(f"no checkpoint in {source}"
                                   + (f" taken at or before {at}" if at else ""))
    import datetime
    for sid in ids:
        ck = chosen.get(sid)
        if ck is None:
            click.echo(f"{sid:<16} {'(no checkpoint: starts empty)':<23}")
            continue
        stamp = datetime.datetime.fromtimestamp(ck.time).isoformat(timespec="milliseconds")
        click.echo(f"{sid:<16} {stamp}  {len(ck.partitions):>4} partitions  {ck.path}")
    if log_dir:
        click.echo(f"replaying the update log {log_dir}"
                   + (f" up to {at}" if at else " to its end"))
    if dry_run:
        return
    stop = threading.Event()
    _on_signals(stop.set)
    ddir = data_dir or source
    replay = ["--replay-log", log_dir, "--expect-shards", str(len(ids))] + (
        ["--replay-until", repr(when)] if when else []) if log_dir else []
    cluster = LocalCluster(len(ids), port=port, host=host, partitions=partitions, quiet=False,
                           replicas=replicas, shard_ids=ids, broker_args=replay,
                           shard_extra={sid: ["--data-dir", ddir] + (
                               ["--restore", chosen[sid].path] if sid in chosen else [])
                               for sid in ids})
    _run_cluster(cluster, stop)


@main.command("checkpoint")
@broker_option
@curve_options("client")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--timeout", default=60.0, show_default=True, type=float)
def checkpoint_cmd(broker_url, as_json, timeout, curve):
    """Have every shard write a checkpoint now; prints where each went."""
    from gradbus import admin
    replies = admin.checkpoint(broker_url, timeout, curve=curve)
    if as_json:
        click.echo(json.dumps(replies, indent=2, sort_keys=True))
    else:
        click.echo(f"{'SHARD':<16}{'PARTITIONS':>11}  PATH")
        for r in replies:
            click.echo(f"{r['shard']:<16}{r.get('partitions', 0):>11}  "
                       + (r.get("path") or f"FAILED: {r.get('error')}"))
    if any(r.get("error") for r in replies):
        sys.exit(1)


@main.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@click.option("--all", "show_all", is_flag=True, help="Also list partitions holding nothing.")
@click.option("--timeout", default=5.0, show_default=True, type=float)
@curve_options("client")
def partitions(broker_url, as_json, show_all, timeout, curve):
    """The partition table: primary, standbys, epoch and seq of every placed partition."""
    from gradbus import admin
    t = admin.partitions(broker_url, timeout, curve=curve)
    rows = [{"p": p, "primary": o, "standbys": t["standbys"][p], "syncing": t["syncing"][p],
             "epoch": t["epochs"][p], "seq": t["seqs"][p], "down": p in t["down"],
             "bytes": t["bytes"][p], "updates_per_s": t["rates"][p]}
            for p, o in enumerate(t["owners"]) if o or show_all]
    if as_json:
        click.echo(json.dumps({"version": t["version"], "partitions": rows}, indent=2))
        return
    click.echo(f"{'PARTITION':>9}  {'PRIMARY':<16}{'STANDBYS':<28}{'EPOCH':>6}{'SEQ':>10}"
               f"{'BYTES':>10}{'UPD/S':>8}  STATE")
    for r in rows:
        state = "DOWN" if r["down"] else ("syncing " + ",".join(r["syncing"]) if r["syncing"]
                                          else "ok")
        click.echo(f"{r['p']:>9}  {r['primary'] or '-':<16}{','.join(r['standbys']) or '-':<28}"
                   f"{r['epoch']:>6}{r['seq']:>10}{_fmt_bytes(r['bytes']):>10}"
                   f"{r['updates_per_s']:>8.1f}  {state}")


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
@curve_options("client")
def status(broker_url, as_json, timeout, curve):
    """Shards, partitions, workers, tensor versions and counters of a running cluster."""
    from gradbus import admin
    st = admin.status(broker_url, timeout, curve=curve)
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
    click.echo(f"replicas {st['replicas']}  under-replicated {st['under_replicated']}  failovers "
               f"{c.get('failovers', 0)}  moves {c.get('moves', 0)}"
               + (f" ({len(st['moves_in_progress'])} under way)" if st["moves_in_progress"]
                  else "") + (f"  draining {','.join(st['draining'])}" if st["draining"] else ""))
    click.echo("")
    click.echo(f"{'SHARD':<16}{'STATE':<8}{'PRIMARY':>8}{'STANDBY':>8}{'SYNCING':>8}{'BYTES':>12}"
               f"{'APPLIED':>10}{'INFLIGHT':>10}{'SEEN':>8}")
    for s in st["shards"]:
        click.echo(f"{s['id']:<16}{'alive' if s['alive'] else 'DEAD':<8}{s['primary']:>8}"
                   f"{s['standby']:>8}{s['syncing']:>8}"
                   f"{_fmt_bytes(s['bytes']):>12}{s['info'].get('pushes_applied', 0):>10}"
                   f"{s['inflight']:>10}{s['last_seen_s']:>7.1f}s")
    click.echo("")
    click.echo(f"{'WORKER':<34}{'PUSHES':>10}{'RATE/S':>8}{'STALENESS':>10}{'REFUSED':>9}"
               f"{'SEEN':>8}")
    for w in st["workers"]:
        stale = w.get("staleness")
        click.echo(f"{w['id']:<34}{w['pushes']:>10}{w.get('pushes_per_s', 0):>8.1f}"
                   f"{'-' if stale is None else f'{stale:.1f}':>10}"
                   f"{sum(w.get('errors', {}).values()):>9}{w['last_seen_s']:>7.1f}s")
    click.echo("")
    click.echo(f"{'TENSOR':<24}{'DTYPE':<9}{'SHAPE':<18}{'BLOCKS':>7}{'VERSION':>9}  OPTIMIZER")
    for t in st["tensors"]:
        click.echo(f"{t['name']:<24}{t['dtype']:<9}{str(tuple(t['shape'])):<18}{t['blocks']:>7}"
                   f"{t['version']:>9}  {t['optimizer']}")
    if st.get("tables"):
        click.echo("")
        click.echo(f"{'TABLE':<24}{'DTYPE':<9}{'DIM':>6}{'ROWS':>12}{'BYTES':>12}{'VERSION':>10}"
                   f"  OPTIMIZER")
        for t in st["tables"]:
            click.echo(f"{t['name']:<24}{t['dtype']:<9}{t['dim']:>6}{t['rows']:>12}"
                       f"{_fmt_bytes(t['bytes']):>12}{t['version']:>10}  {t['optimizer']}")


@config.config_option
@main.command()
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


@config.config_option
@main.group(invoke_without_command=True)
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
              help="Keep what a lossy codec did not send and add it to the next gradient "
                   "(every lossy codec but plain bf16).")
@click.option("--accumulate", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="Sum this many local steps per push.")
@click.option("--optimizer", type=click.Choice(["adam", "momentum"]), default="adam",
              show_default=True, help="Server-side optimizer (the baseline always uses adam).")
@click.pass_context
def demo(ctx, workers, shards, epochs, codec, broker_url, as_json, seed, error_feedback,
         accumulate, optimizer):
    """Train an MLP on the handwritten digits with asynchronous workers through gradbus.

    `gradbus demo ctr` trains a click-through-rate model on embedding tables instead."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        from gradbus import demo as demo_mod
    except ImportError as e:
        raise click.ClickException(f"the demo needs scikit-learn: pip install 'gradbus[demo]' ({e})")
    summary = demo_mod.run(workers=workers, shards=shards, epochs=epochs, codec=codec,
                           broker_url=broker_url, seed=seed, echo=click.echo,
                           error_feedback=error_feedback, accumulate=accumulate,
                           optimizer=optimizer)
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        click.echo(demo_mod.format_summary(summary))


@demo.command("ctr")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 16))
@click.option("--shards", default=2, show_default=True, type=click.IntRange(1, 16))
@click.option("--epochs", default=2, show_default=True, type=click.IntRange(1, 100))
@click.option("--train", "n_train", default=100_000, show_default=True,
              type=click.IntRange(1000, 10_000_000), help="Training examples (click logs).")
@click.option("--broker", "broker_url", default=None,
              help="Train against this running cluster instead of starting one.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on the last line.")
@click.option("--seed", default=0, show_default=True, type=int)
def demo_ctr(workers, shards, epochs, n_train, broker_url, as_json, seed):
    """Train a click-through-rate model (embedding tables and a small MLP) on click logs drawn
    from a planted model, and score it against the best achievable log loss and AUC."""
    from gradbus import demo_ctr as ctr
    summary = ctr.run(workers=workers, shards=shards, epochs=epochs, n_train=n_train,
                      broker_url=broker_url, seed=seed, echo=click.echo)
    click.echo(json.dumps(summary, sort_keys=True) if as_json else ctr.format_summary(summary))


@config.config_option
@main.command("ctr-worker", hidden=True)
@broker_option
@click.option("--index", default=0, type=int)
@click.option("--workers", default=1, type=int)
@click.option("--epochs", default=2, type=int)
@click.option("--train", "n_train", default=100_000, type=int)
@click.option("--seed", default=0, type=int)
def ctr_worker_cmd(broker_url, index, workers, epochs, n_train, seed):
    """Run one `gradbus demo ctr` worker (start one by hand to add a worker)."""
    from gradbus import demo_ctr as ctr
    ctr.worker_main(broker_url, index, workers, epochs, n_train, seed)


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
@metrics_options
def worker_cmd(broker_url, index, workers, epochs, codec, seed, error_feedback, accumulate,
               optimizer, metrics_port, metrics_host):
    """Run one demo worker (used by `gradbus demo`; start one by hand to add a worker)."""
    from gradbus import demo as demo_mod
    demo_mod.worker_main(broker_url, index, workers, epochs, codec, seed, error_feedback,
                         accumulate, optimizer, metrics=(metrics_port, metrics_host))


@main.group()
def keys() -> None:
    """CURVE key files (CurveZMQ authentication and encryption)."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="gradbus", show_default=True,
              help="File name: writes DIRECTORY/NAME.key and DIRECTORY/NAME.key_secret.")
@click.option("--force", is_flag=True, help="Replace existing files of that name.")
def keys_generate(directory, name, force):
    """Write a CURVE key pair in pyzmq's format: NAME.key (public: give it to the broker's
    allow directory, or to clients for the broker's key) and NAME.key_secret (mode 0600)."""
    from gradbus.codecs import security
    try:
        public, secret = security.generate(directory, name, force)
    except (GradbusError, OSError) as e:
        raise click.ClickException(str(e))
    click.echo(f"public key: {public}")
    click.echo(f"secret key: {secret} (mode 0600)")


main.add_command(config.config_group)

__all__ = ["main"]
