"""The `microbatch` typer app: the role commands and the operator commands on one app.

Every setting is an option: the named options, or any other setting as `--<name> VALUE`
(e.g. `--max-batch-size 32`).
"""

from __future__ import annotations

import typer

from common.cli import operate, roles

app = typer.Typer(
    name="microbatch",
    help="Micro-batching inference over Redis Streams.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
roles.register(app)
operate.register(app)
