"""Settings from the command line: named options, then `--<setting> VALUE` for any other."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pydantic import ValidationError

from common.settings import Settings

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
RedisUrl = Annotated[str | None, typer.Option(help="redis:// or rediss:// URL; omit for embedded")]
Host = Annotated[str | None, typer.Option(help="Gateway bind address")]
Port = Annotated[int | None, typer.Option(help="Gateway port")]
Model = Annotated[str | None, typer.Option(help="Model name, local folder or cached hub id")]
Processes = Annotated[
    int | None, typer.Option(help="Gateway processes on one port (SO_REUSEPORT); default 1")
]


def _is_flag(field: str, rest: list[str]) -> bool:
    """A yes/no setting given with no value after it."""
    return Settings.model_fields[field].annotation is bool and (
        not rest or rest[0].startswith("--")
    )


def settings_from_context(ctx: typer.Context, **named: Any) -> Settings:
    """Named options, then `--<setting> VALUE` extras, over MICROBATCH_* environment values."""
    values = {k: v for k, v in named.items() if v is not None}
    args = list(ctx.args)
    while args:
        flag = args.pop(0)
        if not flag.startswith("--"):
            raise typer.BadParameter(f"unexpected argument {flag!r}")
        name, _, value = flag[2:].partition("=")
        field = name.replace("-", "_")
        if field not in Settings.model_fields:
            raise typer.BadParameter(f"unknown setting --{name}")
        if not value and _is_flag(field, args):
            value = "true"  # `--redis-cluster` alone switches a yes/no setting on
        if not value:
            if not args:
                raise typer.BadParameter(f"{flag} needs a value")
            value = args.pop(0)
        values[field] = value
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise typer.BadParameter(settings_errors(exc)) from None


def settings_errors(exc: ValidationError) -> str:
    """What is wrong with the settings, naming each field, and never echoing a value: the
    input pydantic would print holds every setting given, API keys and Redis passwords too."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "invalid settings: " + "; ".join(lines)
