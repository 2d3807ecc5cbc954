"""`python -m common.cli`: the `microbatch` command."""

from common.cli.app import app

app()
