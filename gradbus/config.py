"""The cluster config file: one TOML file every ``gradbus`` command accepts with ``--config``.

The schema below is data: each :class:`Setting` names its section and key, its type (a click
parameter type: conversion, range and choice checks), its default, a help line and the command
options it supplies (``feeds``). A setting resolves, lowest to highest precedence:

    built-in default < config file < environment variable < command-line flag

Click does the resolution for a command: the eager ``--config`` option (added by
:func:`config_option`) loads the file into ``ctx.default_map``, each fed option gets the
setting's environment variables as ``envvar``, and click takes a flag over a variable over the
default map over the option's default. ``gradbus config show`` reports the same resolution.

Wiring a new flag to a setting is one entry in that setting's ``feeds``: ``"COMMAND --option"``.
A setting with no ``feeds`` is still validated and shown, but no command reads it yet.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Mapping

import click

from gradbus.broker.settings import SHARD_CREDIT
from gradbus.codecs import net, timing, wire
from gradbus.codecs.errors import GradbusError
from gradbus.codecs.partition import DEFAULT_PARTITIONS
from gradbus.workers.client import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

CONFIG_ENVVAR = "GRADBUS_CONFIG"
ENV_PREFIX = "GRADBUS_"
_META_KEY = "gradbus.config"


class ConfigError(click.ClickException):
    """A config file, variable or value that cannot be used; the message names the key."""

    exit_code = 2


class _Checked(click.ParamType):
    """A string checked by a function that raises on a bad value."""

    def __init__(self, name: str, check):
        self.name = name
        self._check = check

    def convert(self, value, param, ctx):
        try:
            self._check(value)
        except (GradbusError, ValueError) as e:
            self.fail(str(e.args[0]) if e.args else str(e), param, ctx)
        return value


class _SpinUs(click.ParamType):
    """Microseconds a loop polls after work: ``"auto"`` (from the host's cores, see
    :mod:`gradbus.codecs.cores`) or a whole number 0..100000 (0: never)."""

    name = "auto|us"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return "auto"
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = -1
        if isinstance(value, (bool, float)) or not 0 <= n <= 100_000:
            self.fail(f"{value!r} is not 'auto' nor a whole number of microseconds in "
                      "0..100000", param, ctx)
        return n


SPIN_US = _SpinUs()


def spin_seconds(value) -> float | None:
    """A :data:`SPIN_US` value as the servers take it: seconds, or None for ``"auto"``."""
    return None if value == "auto" else value / 1e6
BROKER_URL = _Checked("url", net.broker_urls)     # one, or a broker pair's two
WEIGHTS_CODEC = _Checked("codec", wire.split_weights_codec)
PORT = click.IntRange(0, 65535)
PATH = click.Path(dir_okay=True, file_okay=True)


@dataclasses.dataclass(frozen=True)
class Setting:
    section: str
    name: str
    type: click.ParamType
    default: object
    help: str
    #: Command options this setting supplies, as "COMMAND --option".
    feeds: tuple[str, ...] = ()
    #: Older variable names still read, after the setting's own.
    env_aliases: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def envvar(self) -> str:
        return f"{ENV_PREFIX}{self.section}_{self.name}".upper()

    @property
    def envvars(self) -> list[str]:
        return [self.envvar, *self.env_aliases]

    @property
    def is_path(self) -> bool:
        return isinstance(self.type, click.Path)

    def options_for(self, command: str) -> list[str]:
        """The option strings (``--port``) this setting supplies on ``command``."""
        return [f.split(" ", 1)[1] for f in self.feeds if f.split(" ", 1)[0] == command]


SECTIONS = {
    "broker": "The broker: its sockets, partitions, batching, flow control and heartbeats.",
    "shard": "Shard processes: weight publishing, gradient checks, checkpoints.",
    "client": "Clients (workers, shards, ops commands): the broker to reach and credit windows.",
    "security": "CurveZMQ key files.",
    "metrics": "Prometheus metrics endpoints.",
    "shm": "The same-host data path: tensor bytes through shared memory between processes "
           "of one user on one host.",
}

SETTINGS: tuple[Setting, ...] = (
    # [broker]
    Setting("broker", "host", click.STRING, "127.0.0.1", "Address the broker binds.",
            feeds=("broker --host", "up --host")),
    Setting("broker", "port", PORT, 5555, "Client port (0: a free one).",
            feeds=("broker --port", "up --port")),
    Setting("broker", "backend_port", PORT, 0,
            "Shard port (0: a free one; shards learn it from the client port).",
            feeds=("broker --backend-port",)),
    Setting("broker", "events_port", PORT, 0, "Events (weights) port (0: a free one).",
            feeds=("broker --events-port",)),
    Setting("broker", "partitions", click.IntRange(1, 65535), DEFAULT_PARTITIONS,
            "Partition count, fixed for the cluster's life.",
            feeds=("broker --partitions", "up --partitions")),
    Setting("broker", "batch_window", click.FloatRange(0, 1), 0.0,
            "Seconds to wait gathering pushes into a batch (0: batch what arrived together).",
            feeds=("broker --batch-window",)),
    Setting("broker", "spin_us", SPIN_US, "auto",
            "Microseconds the broker's loop polls without sleeping after a turn with messages "
            "(0: it sleeps at once; auto: 200 where the host has cores to spare, else 0); "
            "shortens a round trip where a core is spare, burns it.",
            feeds=("broker --spin-us",)),
    Setting("broker", "shard_credit", click.IntRange(1, 1024), SHARD_CREDIT,
            "Batches in flight to one shard.", feeds=("broker --shard-credit",)),
    Setting("broker", "max_pending_mb", click.IntRange(1), 512,
            "Tensor MiB the broker holds (queued, and in flight to shards) at most; a push past "
            "it is refused with BUSY and sent again.",
            feeds=("broker --max-pending-mb",)),
    Setting("broker", "replicas", click.IntRange(1, 16), 1,
            "Copies of every partition: a primary and replicas-1 hot standbys on other shards.",
            feeds=("broker --replicas", "up --replicas")),
    Setting("broker", "heartbeat_interval", click.FloatRange(0.01, 60),
            timing.HEARTBEAT_INTERVAL,
            "Seconds between heartbeats, both ways (broker and shards must agree).",
            feeds=("broker --heartbeat-interval", "shard --heartbeat-interval")),
    Setting("broker", "liveness", click.IntRange(2, 100), timing.LIVENESS,
            "Heartbeat intervals of silence before a peer is declared dead.",
            feeds=("broker --liveness", "shard --liveness")),
    # [shard]
    Setting("shard", "weights_codec", WEIGHTS_CODEC, "raw",
            "Codec chain for republished weights, e.g. raw, bf16, delta|bf16.",
            feeds=("shard --weights-codec",)),
    Setting("shard", "nan_policy", click.Choice(["refuse", "allow"]), "refuse",
            "What to do with a gradient holding NaN or Inf.", feeds=("shard --nan-policy",)),
    Setting("shard", "data_dir", PATH, None,
            "Checkpoint directory (unset: no checkpoints).", feeds=("shard --data-dir",)),
    Setting("shard", "checkpoint_interval", click.FloatRange(0), 60.0,
            "Seconds between checkpoints with a data directory (0: only on request and at a "
            "clean stop).", feeds=("shard --checkpoint-interval",)),
    Setting("shard", "checkpoint_keep", click.IntRange(1), 3,
            "Checkpoints kept per shard.", feeds=("shard --checkpoint-keep",)),
    # [client]
    Setting("client", "broker", BROKER_URL, net.DEFAULT_BROKER,
            "The broker's client URL (a broker pair: both, comma-separated).",
            feeds=("shard --broker", "status --broker", "top --broker", "worker --broker"),
            env_aliases=("GRADBUS_BROKER",)),
    Setting("client", "window", click.IntRange(1), DEFAULT_WINDOW,
            "Unacknowledged pushes per client."),
    Setting("client", "window_bytes", click.IntRange(1), DEFAULT_WINDOW_BYTES,
            "Bytes of unacknowledged pushes per client (one larger push may go alone)."),
    # [security]
    Setting("security", "curve_secret", PATH, None,
            "This process's CURVE secret key file, NAME.key_secret (unset: CURVE off).",
            feeds=("broker --curve-secret", "shard --curve-secret", "status --curve-secret",
                   "top --curve-secret")),
    Setting("security", "curve_server_key", PATH, None,
            "The broker's CURVE public key file, NAME.key, for shards and clients.",
            feeds=("shard --curve-server-key", "status --curve-server-key",
                   "top --curve-server-key")),
    Setting("security", "curve_allow", PATH, None,
            "Directory of the public key files (NAME.key) of the shards and clients the "
            "broker admits.", feeds=("broker --curve-allow",)),
    # [metrics]
    Setting("shm", "enabled", click.BOOL, True,
            "Offer (broker), take up (shard) shared memory for tensor bytes with peers on this "
            "host; clients read $GRADBUS_SHM.",
            feeds=("broker --shm", "shard --shm", "up --shm"), env_aliases=("GRADBUS_SHM",)),
    Setting("metrics", "port", PORT, None,
            "The broker's Prometheus metrics port (0: a free one; unset: off); with up, the "
            "first of the cluster's ports.", feeds=("broker --metrics-port", "up --metrics-port")),
    Setting("metrics", "shard_port", PORT, None,
            "A shard's Prometheus metrics port (0: a free one; unset: off).",
            feeds=("shard --metrics-port",)),
    Setting("metrics", "host", click.STRING, "127.0.0.1",
            "Address the metrics endpoints bind.", feeds=("broker --metrics-host",
                                                          "shard --metrics-host")),
)

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


# -- loading and validating ---------------------------------------------------------------

def _describe(t: click.ParamType) -> str:
    if isinstance(t, click.types.BoolParamType):
        return "true or false"
    if isinstance(t, click.types.IntParamType):
        return "an integer"
    if isinstance(t, click.types.FloatParamType):
        return "a number"
    if isinstance(t, click.Choice):
        return "one of " + ", ".join(repr(c) for c in t.choices)
    return "a string"


def _toml_kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(v), type(v).__name__)


def _right_type(t: click.ParamType, v) -> bool:
    if isinstance(t, click.types.BoolParamType):
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if isinstance(t, click.types.IntParamType):
        return isinstance(v, int)
    if isinstance(t, click.types.FloatParamType):
        return isinstance(v, (int, float))
    return isinstance(v, str)


def convert(setting: Setting, value, where: str, text: bool = False):
    """Check and convert one value; ``where`` says where it came from, for the error.
    ``text``: the value is a string to parse (an environment variable), not a TOML value."""
    if not text and not _right_type(setting.type, value):
        raise ConfigError(f"{where}: {setting.key}: expected {_describe(setting.type)}, "
                          f"got {value!r} ({_toml_kind(value)})")
    try:
        return setting.type.convert(value, None, None)
    except click.BadParameter as e:
        raise ConfigError(f"{where}: {setting.key} = {value!r}: {e.message}") from None


def _closest(name: str, keys) -> str | None:
    """The key in ``keys`` whose last part is closest to ``name``, if any is close."""
    by_name = {k.rsplit(".", 1)[-1]: k for k in reversed(list(keys))}
    close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.6)
    return by_name[close[0]] if close else None


def _unknown_key(where: str, section: str | None, name: str) -> ConfigError:
    """Unknown ``section.name`` (``section`` None: a key outside any section). Suggests the
    same name in another section, else the closest name in this section, else in any."""
    same_name = [s.key for s in SETTINGS if s.name == name]
    near = same_name[0] if same_name else (
        _closest(name, [s.key for s in SETTINGS if s.section == section])
        or _closest(name, BY_KEY))
    what = f"unknown key {section}.{name}" if section else \
        f"unknown key {name!r} outside a section"
    return ConfigError(f"{where}: {what}" + (f"; did you mean {near}?" if near else ""))


@dataclasses.dataclass
class Config:
    """What a config file set: ``values`` maps ``section.key`` to a checked value."""

    path: str | None = None
    values: dict = dataclasses.field(default_factory=dict)

    def default_map(self, command: click.Command) -> dict:
        """The file's values for ``command``'s options, keyed by parameter name."""
        params = _options(command)
        return {params[opt].name: value for key, value in self.values.items()
                for opt in BY_KEY[key].options_for(command.name) if opt in params}


def parse(data: Mapping, where: str, base_dir: str = ".") -> dict:
    """Validate a parsed TOML document; relative paths resolve against ``base_dir``."""
    values = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise _unknown_key(where, None, section)
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, list(SECTIONS), n=1, cutoff=0.6)
            raise ConfigError(f"{where}: unknown section [{section}]"
                              + (f"; did you mean [{close[0]}]?" if close else ""))
        for name, value in table.items():
            setting = BY_KEY.get(f"{section}.{name}")
            if setting is None:
                raise _unknown_key(where, section, name)
            value = convert(setting, value, where)
            if setting.is_path:
                value = os.path.normpath(os.path.join(base_dir, os.path.expanduser(value)))
            values[setting.key] = value
    return values


def load(path: str) -> Config:
    """Read and validate a config file; every problem is a :class:`ConfigError`."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    full = os.path.abspath(path)
    return Config(full, parse(data, path, os.path.dirname(full)))


# -- resolving -----------------------------------------------------------------------------

@dataclasses.dataclass
class Resolved:
    setting: Setting
    value: object
    source: str          # "default", "file", "env" or "flag"
    origin: str | None   # the file's path, the variable's name or the flag; None for default

    def as_dict(self) -> dict:
        return {"value": self.value, "source": self.source, "origin": self.origin,
                "env": self.setting.envvars, "flags": list(self.setting.feeds),
                "help": self.setting.help}


def env_value(setting: Setting, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """``(name, raw value)`` of the first of the setting's variables that is set and not
    empty (the rule click applies to ``envvar``), or None."""
    for name in setting.envvars:
        if environ.get(name):
            return name, environ[name]
    return None


def resolve(cfg: Config, environ: Mapping[str, str] | None = None) -> dict[str, Resolved]:
    """Every setting's value and source without flags: env > file > default."""
    environ = os.environ if environ is None else environ
    out = {}
    for s in SETTINGS:
        env = env_value(s, environ)
        if env is not None:
            out[s.key] = Resolved(s, convert(s, env[1], f"${env[0]}", text=True), "env", env[0])
        elif s.key in cfg.values:
            out[s.key] = Resolved(s, cfg.values[s.key], "file", cfg.path)
        else:
            out[s.key] = Resolved(s, s.default, "default", None)
    return out


_CLICK_SOURCES = {
    click.core.ParameterSource.DEFAULT: "default",
    click.core.ParameterSource.DEFAULT_MAP: "file",
    click.core.ParameterSource.ENVIRONMENT: "env",
    click.core.ParameterSource.COMMANDLINE: "flag",
}


def resolve_for(ctx: click.Context, environ: Mapping[str, str] | None = None
                ) -> dict[str, Resolved]:
    """Like :func:`resolve`, with the settings ``ctx``'s command reads taken from what click
    parsed for it, so a flag given to the command shows as the source."""
    environ = os.environ if environ is None else environ
    cfg = loaded(ctx)
    out = resolve(cfg, environ)
    params = _options(ctx.command)
    for s in SETTINGS:
        for opt in s.options_for(ctx.command.name):
            param = params.get(opt)
            if param is None or param.name not in ctx.params:
                continue
            source = _CLICK_SOURCES.get(ctx.get_parameter_source(param.name), "default")
            origin = {"file": cfg.path, "flag": opt,
                      "env": (env_value(s, environ) or (None,))[0]}.get(source)
            out[s.key] = Resolved(s, ctx.params[param.name], source, origin)
    return out


# -- click integration ---------------------------------------------------------------------

def _options(command: click.Command) -> dict[str, click.Option]:
    """Option string (``--port``) -> the command's option."""
    return {o: p for p in command.params if isinstance(p, click.Option) for o in p.opts}


def _reads_config(command: click.Command) -> bool:
    return any(p.callback is _load_into_context for p in command.params)


def loaded(ctx: click.Context) -> Config:
    """The config the innermost command with ``--config`` loaded (an empty one if none)."""
    return ctx.meta.get(_META_KEY) or Config()


def forward_args(ctx: click.Context) -> list[str]:
    """``["--config", PATH]`` for child processes when a file was loaded, else ``[]``."""
    cfg = loaded(ctx)
    return ["--config", cfg.path] if cfg.path else []


def _load_into_context(ctx: click.Context, param: click.Parameter, value):
    cfg = load(value) if value else Config()
    ctx.meta[_META_KEY] = cfg
    mapping = cfg.default_map(ctx.command)
    if mapping:
        ctx.default_map = {**(ctx.default_map or {}), **mapping}
    return value


def config_option(cmd: click.Command) -> click.Command:
    """Give a command ``--config FILE`` (default ``$GRADBUS_CONFIG``) and wire the settings
    that feed its options: the file's values become their defaults and each gets the setting's
    environment variables. Put it above ``@group.command()``, so it sees every option."""
    if not isinstance(cmd, click.Command):
        raise TypeError("@config_option goes above @<group>.command(): it needs the command")
    options = _options(cmd)
    for s in SETTINGS:
        for opt in s.options_for(cmd.name):
            if opt not in options:
                raise TypeError(f"setting {s.key} feeds {cmd.name} {opt}, which has no such option")
            options[opt].envvar = s.envvars
            options[opt].show_envvar = True
    cmd.params.append(click.Option(
        ["--config", "config_file"], type=click.Path(exists=True, dir_okay=False),
        envvar=CONFIG_ENVVAR, show_envvar=True, is_eager=True, expose_value=False,
        callback=_load_into_context, metavar="FILE",
        help="Cluster config file (TOML). Flags and GRADBUS_<SECTION>_<KEY> variables "
             "override it."))
    return cmd


# -- `gradbus config` ----------------------------------------------------------------------

def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _named_by(ctx: click.Context) -> str:
    """How ``ctx``'s command was given its file (call once parsing is done)."""
    env = ctx.get_parameter_source("config_file") == click.core.ParameterSource.ENVIRONMENT
    return CONFIG_ENVVAR if env else "--config"


def format_text(resolved: dict[str, Resolved], cfg: Config, command: str | None,
                named_by: str) -> str:
    """The effective settings as TOML, each line's source in a comment."""
    lines = [f"# config file: {cfg.path} (from {named_by})" if cfg.path
             else "# config file: none"]
    if command:
        lines.append(f"# as read by: gradbus {command}")
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        for r in (r for r in resolved.values() if r.setting.section == section):
            source = r.source + (f" {r.origin}" if r.origin else "")
            if not r.setting.feeds:
                source += "; no command reads it yet"
            text = (f"{r.setting.name} = {_toml(r.value)}" if r.value is not None
                    else f"# {r.setting.name} = (unset)")
            lines.append(f"{text:<40} # {source}")
    return "\n".join(lines)


@click.group("config")
def config_group() -> None:
    """Show or check the cluster configuration."""


@config_option
@config_group.command("show", context_settings={"ignore_unknown_options": True,
                                                "allow_interspersed_args": False})
@click.option("--json", "as_json", is_flag=True, help="Print the settings as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[COMMAND [ARGS]...]")
@click.pass_context
def show(ctx: click.Context, as_json: bool, command: tuple[str, ...]) -> None:
    """Print every setting, its effective value and where it came from (default, file,
    env or flag). With COMMAND and its ARGS, show what that command would run with:
    `gradbus config show broker --port 6000`."""
    cfg, named_by, name = loaded(ctx), _named_by(ctx), None
    if command:
        name, args = command[0], list(command[1:])
        root = ctx.find_root()
        sub = root.command.get_command(root, name) if isinstance(root.command, click.Group) \
            else None
        if sub is None or isinstance(sub, click.Group) or not _reads_config(sub):
            raise click.UsageError(f"no command {name!r} that reads the config", ctx)
        # A file named by GRADBUS_CONFIG reaches the command by itself; one given to
        # `config show --config` is handed on unless the command's arguments name their own.
        if named_by == "--config" and cfg.path and \
                not any(a == "--config" or a.startswith("--config=") for a in args):
            args = ["--config", cfg.path, *args]
        with sub.make_context(name, args, parent=ctx) as sub_ctx:
            resolved = resolve_for(sub_ctx)
            cfg, named_by = loaded(sub_ctx), _named_by(sub_ctx)
    else:
        resolved = resolve(cfg)
    if as_json:
        click.echo(json.dumps({"config_file": cfg.path, "command": name,
                               "settings": {k: r.as_dict() for k, r in resolved.items()}},
                              indent=2))
    else:
        click.echo(format_text(resolved, cfg, name, named_by))


@config_group.command("check")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
def check(file: str) -> None:
    """Validate FILE (and the GRADBUS_<SECTION>_<KEY> variables); exit non-zero on an error."""
    cfg = load(file)
    resolve(cfg)
    click.echo(f"ok: {file} sets {len(cfg.values)} of {len(SETTINGS)} settings")


__all__ = ["SETTINGS", "SECTIONS", "Setting", "Config", "ConfigError", "config_option",
           "config_group", "load", "parse", "resolve", "resolve_for", "forward_args"]
