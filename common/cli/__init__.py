"""The `microbatch` command line: roles, operator commands, load generation and rendering."""

from common.cli.app import app

__all__ = ["app"]
