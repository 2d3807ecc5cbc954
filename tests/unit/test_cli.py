"""The CLI: every setting is an option, and the gateway role never imports torch."""

from __future__ import annotations

import re
import subprocess
import sys

from typer.testing import CliRunner

from common.cli import app

PROBE = """
import sys
from common.cli import app
try:
    app(["gateway", "--help"])
except SystemExit:
    pass
print("torch" in sys.modules, "transformers" in sys.modules)
"""


def test_gateway_help_does_not_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_every_documented_command_is_there() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("serve", "gateway", "worker"):
        assert command in result.output


def test_an_unknown_setting_is_refused_by_name() -> None:
    result = CliRunner().invoke(app, ["worker", "--redis-url", "redis://x", "--no-such-thing", "1"])
    assert result.exit_code != 0
    assert "unknown setting --no-such-thing" in result.output


def test_gateway_and_worker_refuse_to_run_without_redis() -> None:
    result = CliRunner().invoke(app, ["gateway"])
    assert result.exit_code != 0
    assert "needs --redis-url" in result.output


def test_an_invalid_setting_value_is_refused_at_start() -> None:
    result = CliRunner().invoke(
        app, ["worker", "--redis-url", "redis://x", "--max-batch-size", "0"]
    )
    assert result.exit_code != 0
    assert "max_batch_size" in result.output


def test_serve_refuses_several_gateway_processes_over_the_embedded_store() -> None:
    result = CliRunner().invoke(app, ["serve", "--processes", "2"])
    assert result.exit_code != 0
    assert "needs --redis-url" in result.output


def test_a_gateway_open_to_the_network_without_api_keys_is_refused_naming_the_fix() -> None:
    refused = CliRunner().invoke(app, ["gateway", "--redis-url", "redis://x", "--host", "0.0.0.0"])
    assert refused.exit_code != 0
    assert "no api_keys" in refused.output and "allow_unauthenticated" in refused.output


def test_loopback_and_keys_and_an_explicit_allowance_each_pass_the_bind_check() -> None:
    from common.cli.exposure import open_bind_refusal
    from common.settings import Settings

    assert open_bind_refusal(Settings(host="127.0.0.1")) is None
    assert open_bind_refusal(Settings(host="::1")) is None
    assert open_bind_refusal(Settings(host="0.0.0.0", api_keys=["k"])) is None
    assert open_bind_refusal(Settings(host="0.0.0.0", allow_unauthenticated=True)) is None
    assert open_bind_refusal(Settings(host="0.0.0.0")) is not None
    assert open_bind_refusal(Settings(host="gateway.internal")) is not None


def test_a_settings_error_names_the_field_and_never_echoes_a_secret() -> None:
    """A model-level check's error once printed every setting given, API keys included."""

    def said(result) -> str:  # the words, without the box rich draws around them
        return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())

    env = {"MICROBATCH_API_KEYS": "sk-very-secret", "MICROBATCH_MAX_BATCH_TOKENS": "1"}
    bad = CliRunner().invoke(app, ["worker", "--redis-url", "redis://:hunter2@x"], env=env)
    assert bad.exit_code != 0
    assert "max_batch_tokens must hold" in said(bad)
    assert "sk-very" not in bad.output and "hunter2" not in bad.output
    env = {"MICROBATCH_PORT": "99999"}
    port = CliRunner().invoke(app, ["worker", "--redis-url", "redis://x"], env=env)
    assert "port: Input should be less than or equal to 65535" in said(port)
