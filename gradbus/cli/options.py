"""What the commands share: click options (broker URL, replicas, heartbeats, metrics, CURVE),
logging, signal handlers and time parsing."""
from __future__ import annotations

import functools
import logging
import signal
import sys

import click

from gradbus import config
from gradbus.codecs import net, timing
from gradbus.codecs.errors import GradbusError

broker_option = click.option(
    "--broker", "broker_url", default=net.default_broker, show_default="$GRADBUS_BROKER or "
    + net.DEFAULT_BROKER, help="The broker's client URL (a broker pair: both, "
    "comma-separated).")


replicas_option = click.option(
    "--replicas", default=1, show_default=True, type=click.IntRange(1, 16),
    help="Copies of every partition: a primary and replicas-1 hot standbys on other shards.")


def metrics_options(f):
    f = click.option("--metrics-host", default="127.0.0.1", show_default=True,
                     help="Address the metrics endpoint binds (0.0.0.0 in containers).")(f)
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
                        help="Serve Prometheus metrics at http://HOST:PORT/metrics "
                             "(0: a free port; unset: off).")(f)


def exporter(port, host, name):
    """A Prometheus endpoint on ``host:port`` (None when ``port`` is None)."""
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


def setup_logging(verbose: int) -> None:
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def server_process() -> None:
    """A broker or shard process keeps the memory it frees (gradbus/memory.py)."""
    from gradbus import memory
    if not memory.keep_freed_memory():
        logging.getLogger("gradbus").debug("malloc thresholds left as they are")


def on_signals(stop) -> None:
    """Call ``stop()`` on SIGTERM and SIGINT. A process inherits its parent's blocked signals
    across exec: both are unblocked, or a parent that held them blocked when it started this
    one would leave it deaf to the stop."""
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def parse_time(value: str | None, hint: str = "--at") -> float | None:
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
