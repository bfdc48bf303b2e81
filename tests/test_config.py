"""The cluster config file: schema, precedence (default < file < env < flag), errors, examples."""
from __future__ import annotations

import json
import os
import pathlib
import selectors
import signal
import subprocess
import sys
import time

import click
import pytest
from click.core import ParameterSource
from click.testing import CliRunner

from gradbus import config
from gradbus.broker.core import SHARD_CREDIT
from gradbus.cli import main
from gradbus.cluster import end_processes, free_ports
from gradbus.codecs.errors import GradbusError
from gradbus.config import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docker" / "gradbus.toml"
DOCS = ROOT / "docs" / "configuration.md"
COMMANDS = ["broker", "shard", "up", "status", "demo", "worker"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No GRADBUS_* variable from the surrounding environment leaks into a test."""
    for name in list(os.environ):
        if name.startswith("GRADBUS_"):
            monkeypatch.delenv(name)


def _write(tmp_path, text: str, name: str = "gradbus.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _show(*args: str) -> dict:
    r = CliRunner().invoke(main, ["config", "show", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["settings"]


def _parse(command: str, *args: str) -> click.Context:
    """Parse ``gradbus COMMAND ARGS`` exactly as the command would, without running it."""
    cmd = main.get_command(None, command)
    return cmd.make_context(command, list(args))


def _fails(args: list[str]) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    return r.output


# -- schema -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_takes_config(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "--config FILE" in r.output and "GRADBUS_CONFIG" in r.output


def test_schema_agrees_with_the_cli_options():
    assert len(config.BY_KEY) == len(config.SETTINGS)
    names = [e for s in config.SETTINGS for e in s.envvars]
    assert len(names) == len(set(names))
    for s in config.SETTINGS:
        assert s.section in config.SECTIONS and s.help
        if s.default is not None:
            assert config.convert(s, s.default, "default") == s.default
        for feed in s.feeds:
            command, opt = feed.split(" ")
            params = {o: p for p in main.get_command(None, command).params for o in p.opts}
            option = params[opt]
            default = option.default() if callable(option.default) else option.default
            assert default == s.default, feed
            assert option.envvar == s.envvars, feed
            if isinstance(option.type, (click.IntRange, click.FloatRange)):
                assert option.type.to_info_dict() == s.type.to_info_dict(), feed


def test_config_option_needs_the_command():
    with pytest.raises(TypeError, match="above"):
        config.config_option(lambda: None)
    cmd = click.Command("broker", params=[click.Option(["--host"])])
    with pytest.raises(TypeError, match="broker.port feeds broker --port"):
        config.config_option(cmd)


# -- precedence -------------------------------------------------------------------------------

def test_defaults_everywhere_without_file_or_env():
    settings = _show()
    assert set(settings) == set(config.BY_KEY)
    for key, s in config.BY_KEY.items():
        assert settings[key]["source"] == "default" and settings[key]["origin"] is None, key
        assert settings[key]["value"] == s.default, key


def test_precedence_through_config_show(tmp_path, monkeypatch):
    f = _write(tmp_path, "[broker]\nport = 6001\npartitions = 64\nbatch_window = 0.25\n"
                         "liveness = 9\n[shard]\nnan_policy = 'allow'\n")
    full = os.path.abspath(f)
    s = _show("--config", f)
    assert (s["broker.port"]["value"], s["broker.port"]["source"]) == (6001, "file")
    assert s["broker.port"]["origin"] == full
    assert s["broker.liveness"]["value"] == 9 and s["shard.nan_policy"]["value"] == "allow"
    assert s["broker.shard_credit"]["source"] == "default"

    monkeypatch.setenv("GRADBUS_BROKER_PORT", "6002")
    monkeypatch.setenv("GRADBUS_BROKER_LIVENESS", "7")
    s = _show("--config", f)
    assert (s["broker.port"]["value"], s["broker.port"]["source"]) == (6002, "env")
    assert s["broker.port"]["origin"] == "GRADBUS_BROKER_PORT"
    assert (s["broker.liveness"]["value"], s["broker.liveness"]["source"]) == (7, "env")
    assert s["broker.partitions"]["source"] == "file"

    # With a command and its flags, config show reports what that command parses.
    s = _show("--config", f, "broker", "--port", "6003", "--shard-credit", "8")
    assert (s["broker.port"]["value"], s["broker.port"]["source"]) == (6003, "flag")
    assert s["broker.port"]["origin"] == "--port"
    assert (s["broker.shard_credit"]["value"], s["broker.shard_credit"]["source"]) == (8, "flag")
    assert (s["broker.partitions"]["value"], s["broker.partitions"]["source"]) == (64, "file")
    assert (s["broker.batch_window"]["value"], s["broker.batch_window"]["source"]) == (0.25, "file")
    assert s["broker.liveness"]["source"] == "env"
    assert (s["broker.events_port"]["value"], s["broker.events_port"]["source"]) == (0, "default")
    # The flag on the command wins; the file still applies to settings the command lacks.
    assert s["shard.nan_policy"]["source"] == "file"


def test_precedence_through_a_real_command(tmp_path, monkeypatch):
    f = _write(tmp_path, "[broker]\nport = 6001\npartitions = 64\n")

    with _parse("broker") as ctx:
        assert ctx.params["port"] == 5555
        assert ctx.get_parameter_source("port") == ParameterSource.DEFAULT

    with _parse("broker", "--config", f) as ctx:
        assert (ctx.params["port"], ctx.params["partitions"]) == (6001, 64)
        assert ctx.get_parameter_source("port") == ParameterSource.DEFAULT_MAP
        assert ctx.params["shard_credit"] == SHARD_CREDIT

    monkeypatch.setenv("GRADBUS_BROKER_PORT", "6002")
    with _parse("broker", "--config", f) as ctx:
        assert (ctx.params["port"], ctx.params["partitions"]) == (6002, 64)
        assert ctx.get_parameter_source("port") == ParameterSource.ENVIRONMENT

    with _parse("broker", "--port", "6003", "--config", f) as ctx:
        assert (ctx.params["port"], ctx.params["partitions"]) == (6003, 64)
        assert ctx.get_parameter_source("port") == ParameterSource.COMMANDLINE

    # `up` reads the same broker settings.
    with _parse("up", "--config", f) as ctx:
        assert (ctx.params["port"], ctx.params["partitions"]) == (6002, 64)


def test_config_show_and_the_command_agree(tmp_path, monkeypatch):
    f = _write(tmp_path, "[broker]\nhost = '0.0.0.0'\nbatch_window = 0.5\n"
                         "[shard]\nweights_codec = 'delta|bf16'\n")
    monkeypatch.setenv("GRADBUS_BROKER_MAX_PENDING_MB", "64")
    shown = _show("--config", f)
    for command in ("broker", "shard"):
        with _parse(command, "--config", f) as ctx:
            for key, s in config.BY_KEY.items():
                for opt in s.options_for(command):
                    name = next(p.name for p in ctx.command.params if opt in p.opts)
                    assert ctx.params[name] == shown[key]["value"], key


def test_client_url_variables(tmp_path, monkeypatch):
    f = _write(tmp_path, "[client]\nbroker = 'tcp://from-file:1'\n")
    with _parse("status", "--config", f) as ctx:
        assert ctx.params["broker_url"] == "tcp://from-file:1"
    monkeypatch.setenv("GRADBUS_BROKER", "tcp://legacy:2")
    with _parse("status", "--config", f) as ctx:
        assert ctx.params["broker_url"] == "tcp://legacy:2"
    assert _show("--config", f)["client.broker"]["origin"] == "GRADBUS_BROKER"
    monkeypatch.setenv("GRADBUS_CLIENT_BROKER", "tcp://new:3")
    with _parse("shard", "--config", f) as ctx:
        assert ctx.params["broker_url"] == "tcp://new:3"
    with _parse("status", "--config", f, "--broker", "tcp://flag:4") as ctx:
        assert ctx.params["broker_url"] == "tcp://flag:4"
    # The demo starts its own cluster unless --broker is given: the file does not change that.
    with _parse("demo", "--config", f) as ctx:
        assert ctx.params["broker_url"] is None


def test_gradbus_config_variable_names_the_file(tmp_path, monkeypatch):
    a = _write(tmp_path, "[broker]\nport = 6001\n", "a.toml")
    b = _write(tmp_path, "[broker]\nport = 6002\n", "b.toml")
    monkeypatch.setenv("GRADBUS_CONFIG", a)
    with _parse("broker") as ctx:
        assert ctx.params["port"] == 6001
    with _parse("broker", "--config", b) as ctx:
        assert ctx.params["port"] == 6002
    r = CliRunner().invoke(main, ["config", "show"])
    assert r.exit_code == 0 and f"# config file: {a} (from GRADBUS_CONFIG)" in r.output
    assert "port = 6001" in r.output and f"# file {a}" in r.output


def test_show_text_is_toml_with_the_same_values(tmp_path, monkeypatch):
    f = _write(tmp_path, "[broker]\nport = 6001\n[security]\ncurve_allow = 'keys'\n")
    monkeypatch.setenv("GRADBUS_SHARD_WEIGHTS_CODEC", "bf16")
    r = CliRunner().invoke(main, ["config", "show", "--config", f, "broker", "--host", "::1"])
    assert r.exit_code == 0, r.output
    assert "# flag --host" in r.output and "# env GRADBUS_SHARD_WEIGHTS_CODEC" in r.output
    assert "no command reads it yet" in r.output        # e.g. shard.data_dir
    values = config.parse(tomllib.loads(r.output), "shown")
    assert values["broker.port"] == 6001 and values["broker.host"] == "::1"
    assert values["shard.weights_codec"] == "bf16"
    assert values["security.curve_allow"] == str(tmp_path / "keys")
    assert "security.curve_secret" not in values         # unset: shown as a comment


def test_relative_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "etc").mkdir()
    f = _write(tmp_path / "etc", "[shard]\ndata_dir = '../data'\n[security]\n"
                                 "curve_secret = '/abs/k.key_secret'\n")
    cfg = config.load(f)
    assert cfg.values["shard.data_dir"] == str(tmp_path / "data")
    assert cfg.values["security.curve_secret"] == "/abs/k.key_secret"


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("[broker]\nprot = 1\n", "unknown key broker.prot; did you mean broker.port?"),
    ("[broker]\nwindow = 1\n", "unknown key broker.window; did you mean client.window?"),
    ("[client]\nwindow_byte = 1\n", "unknown key client.window_byte; did you mean client.window_bytes?"),
    ("[brokr]\nport = 1\n", "unknown section [brokr]; did you mean [broker]?"),
    ("liveness = 3\n", "unknown key 'liveness' outside a section; did you mean broker.liveness?"),
    ("[broker.extra]\nx = 1\n", "unknown key broker.extra"),
])
def test_unknown_keys_are_named(tmp_path, text, message):
    f = _write(tmp_path, text)
    out = _fails(["broker", "--config", f])
    assert f"{f}: {message}" in out


@pytest.mark.parametrize("text, message", [
    ("[broker]\nport = 70000\n", "broker.port = 70000: 70000 is not in the range 0<=x<=65535"),
    ("[broker]\nport = '5555'\n", "broker.port: expected an integer, got '5555' (a string)"),
    ("[broker]\npartitions = true\n", "broker.partitions: expected an integer, got True"),
    ("[broker]\nbatch_window = 2\n", "broker.batch_window = 2:"),
    ("[broker]\nheartbeat_interval = 0\n", "broker.heartbeat_interval = 0:"),
    ("[shard]\nnan_policy = 'drop'\n", "shard.nan_policy = 'drop': 'drop' is not one of 'refuse', 'allow'"),
    ("[shard]\nweights_codec = 'gzip'\n", "shard.weights_codec = 'gzip': unknown codec"),
    ("[client]\nbroker = 'http://x'\n", "client.broker = 'http://x': broker URL must look like tcp://HOST:PORT"),
    ("[security]\ncurve_allow = 5\n", "security.curve_allow: expected a string, got 5 (an integer)"),
    ("[metrics]\nport = 1.5\n", "metrics.port: expected an integer, got 1.5 (a number)"),
])
def test_bad_values_are_named(tmp_path, text, message):
    f = _write(tmp_path, text)
    for args in (["broker", "--config", f], ["config", "check", f]):
        assert message in _fails(args)


def test_a_float_setting_takes_an_integer(tmp_path):
    f = _write(tmp_path, "[shard]\ncheckpoint_interval = 30\n")
    assert config.load(f).values["shard.checkpoint_interval"] == 30.0


def test_bad_toml_and_missing_files_name_the_file(tmp_path, monkeypatch):
    f = _write(tmp_path, "[broker\nport = 1\n")
    assert f"{f}: not valid TOML" in _fails(["status", "--config", f])
    assert "does not exist" in _fails(["status", "--config", str(tmp_path / "nope.toml")])
    monkeypatch.setenv("GRADBUS_CONFIG", str(tmp_path / "nope.toml"))
    assert "nope.toml" in _fails(["status"])


def test_bad_environment_values_are_named(monkeypatch):
    monkeypatch.setenv("GRADBUS_BROKER_LIVENESS", "often")
    out = _fails(["config", "show"])
    assert "$GRADBUS_BROKER_LIVENESS: broker.liveness = 'often'" in out
    monkeypatch.delenv("GRADBUS_BROKER_LIVENESS")
    monkeypatch.setenv("GRADBUS_BROKER_PORT", "99999")
    with pytest.raises(click.BadParameter) as e:
        _parse("broker")
    assert "GRADBUS_BROKER_PORT" in e.value.format_message()


def test_config_show_needs_a_command_that_reads_the_config():
    assert "no command 'nope'" in _fails(["config", "show", "nope"])
    assert "no command 'config'" in _fails(["config", "show", "config"])


# -- the example and the docs -----------------------------------------------------------------

def test_example_file_is_valid_and_lists_every_setting():
    r = CliRunner().invoke(main, ["config", "check", str(EXAMPLE)])
    assert r.exit_code == 0 and r.output.startswith("ok: "), r.output
    cfg = config.load(str(EXAMPLE))
    text = EXAMPLE.read_text()
    for key, s in config.BY_KEY.items():
        assert key in cfg.values or f"# {s.name} = " in text, key
    assert cfg.values["client.broker"] == "tcp://broker:5555"
    with _parse("broker", "--config", str(EXAMPLE)) as ctx:
        assert (ctx.params["host"], ctx.params["backend_port"]) == ("0.0.0.0", 5556)


def test_docs_list_every_setting():
    text = DOCS.read_text()
    for section in config.SECTIONS:
        body = text.split(f"### [{section}]", 1)[1].split("\n### ", 1)[0]
        for s in (s for s in config.SETTINGS if s.section == section):
            row = next((line for line in body.splitlines() if line.startswith(f"| `{s.name}` |")),
                       None)
            assert row is not None, s.key
            assert all(f"`{e}`" in row for e in s.envvars), s.key
            assert all(f"`{f}`" in row for f in s.feeds) if s.feeds else "none yet" in row, s.key


# -- real commands ----------------------------------------------------------------------------

def test_up_hands_the_file_to_its_children(tmp_path, monkeypatch):
    f = _write(tmp_path, "[broker]\nport = 6001\nhost = '127.0.0.2'\npartitions = 8\n"
                         "replicas = 2\n")
    seen = {}

    class FakeCluster:
        def __init__(self, shards, **kw):
            seen.update(kw, shards=shards)

        def start(self):
            raise GradbusError("not starting in this test")

        def stop(self):
            pass

    monkeypatch.setattr("gradbus.cluster.LocalCluster", FakeCluster)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        r = CliRunner().invoke(main, ["up", "--config", f, "--shards", "3"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert r.exit_code == 1 and "not starting in this test" in r.output
    assert (seen["port"], seen["host"], seen["partitions"], seen["shards"]) == \
        (6001, "127.0.0.2", 8, 3)
    forward = ["--config", os.path.abspath(f), "--shm"]   # up's own --shm/--no-shm for both
    assert seen["shard_args"] == seen["broker_args"] == forward
    assert seen["replicas"] == 2      # from the file


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line from the broker within {timeout}s")
            if sel.select(left):
                return proc.stdout.readline().strip()


def test_broker_binds_the_port_from_the_file(tmp_path):
    port = free_ports(1)[0]
    f = _write(tmp_path, f"[broker]\nhost = '127.0.0.1'\nport = {port}\npartitions = 16\n"
                         f"[client]\nbroker = 'tcp://127.0.0.1:{port}'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADBUS_")}
    proc = subprocess.Popen([sys.executable, "-m", "gradbus", "broker", "--config", f],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert _readline(proc, 30) == f"listening: tcp://127.0.0.1:{port}"
        # An ops command finds it through the same file's [client] broker.
        r = CliRunner().invoke(main, ["status", "--config", f, "--json", "--timeout", "10"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["partitions"] == 16
    finally:
        end_processes([proc], grace=10.0)
