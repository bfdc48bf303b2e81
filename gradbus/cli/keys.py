"""`gradbus keys`: CURVE key files."""
from __future__ import annotations

import click

from gradbus.codecs.errors import GradbusError


@click.group()
def keys() -> None:
    """CURVE key files (CurveZMQ authentication and encryption)."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="gradbus", show_default=True,
              help="File name: writes DIRECTORY/NAME.key and DIRECTORY/NAME.key_secret.")
@click.option("--force", is_flag=True, help="Replace existing files of that name.")
@click.option("--role", "roles", multiple=True, type=click.Choice(["shard", "client", "operator"]),
              help="What the key may do once in the broker's allow directory (repeat for "
                   "several); written in NAME.key. Without it the file names no roles and "
                   "the broker gives it every role.")
def keys_generate(directory, name, force, roles):
    """Write a CURVE key pair in pyzmq's format: NAME.key (public: give it to the broker's
    allow directory, or to clients for the broker's key) and NAME.key_secret (mode 0600)."""
    from gradbus.codecs import security
    try:
        public, secret = security.generate(directory, name, force, roles=roles or None)
    except (GradbusError, OSError) as e:
        raise click.ClickException(str(e))
    click.echo(f"public key: {public}" + (f" (roles: {' '.join(roles)})" if roles else ""))
    click.echo(f"secret key: {secret} (mode 0600)")
