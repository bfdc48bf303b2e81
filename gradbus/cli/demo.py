"""The demos: `gradbus demo` (an MLP on handwritten digits), `gradbus demo ctr` (a
click-through-rate model on embedding tables), and the hidden per-worker commands they start
(`worker`, `ctr-worker`)."""
from __future__ import annotations

import json

import click

from gradbus import config
from gradbus.cli.options import broker_option, metrics_options


@config.config_option
@click.group(invoke_without_command=True)
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
@click.command("ctr-worker", hidden=True)
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
@click.command("worker", hidden=True)
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
