"""Settings come from MICROBATCH_* variables and options, validated once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.settings import Settings


def test_defaults_match_the_design() -> None:
    s = Settings(_env_file=None)
    assert (s.host, s.port, s.model) == ("127.0.0.1", 8000, "all-MiniLM-L6-v2")
    assert s.buckets == [128, 256, 512]
    assert (s.max_batch_size, s.max_batch_tokens, s.max_wait_ms) == (16, 16384, "auto")
    assert (s.request_timeout_ms, s.max_deliveries, s.api_keys) == (30000, 3, [])
    assert s.redis_url is None and s.embedded


def test_lists_parse_from_comma_separated_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MICROBATCH_BUCKETS", "64, 128,1024")
    monkeypatch.setenv("MICROBATCH_API_KEYS", "k1,k2")
    monkeypatch.setenv("MICROBATCH_MAX_BATCH_SIZE", "32")
    s = Settings()
    assert s.buckets == [64, 128, 1024]
    assert s.api_keys == ["k1", "k2"]
    assert s.max_batch_size == 32
    assert s.max_tokens == 1024


@pytest.mark.parametrize(
    "bad",
    [
        {"buckets": "256,128"},
        {"buckets": "0,128"},
        {"max_batch_size": 0},
        {"max_wait_ms": -1},
        {"read_block_ms": 6000},  # would outlast the socket timeout
        {"max_batch_tokens": 100},  # cannot hold one 512-token entry
        {"no_such_setting": 1},
        {"max_wait_ms": "soon"},
        {"quantize": "int8"},  # int8 is an onnx-backend option
        {"backend": "tensorrt"},
        {"backend": "auto", "quantize": "int8"},  # int8 only where onnx serves every batch
        {"backend": "auto", "device": "cuda"},  # ONNX Runtime runs here on the CPU only
        {"backend": "onnx", "device": "cuda:0"},
        {"dtype": "bfloat16", "backend": "onnx"},  # the exported graph is float32
        {"dtype": "float16", "backend": "auto"},
        {"dtype": "int4"},
        {"files_store": "s3"},  # no bucket to keep them in
        {"files_store": "gcs"},
        {"tensor_parallel_size": 2},  # the paged engine here runs a model on one device
        {"pipeline_parallel_size": 2},
        {"engine": "tgi"},
    ],
)
def test_inconsistent_settings_are_refused_at_start(bad: dict) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)


def test_settings_are_frozen() -> None:
    with pytest.raises(ValidationError):
        Settings().port = 1  # type: ignore[misc]


def test_the_redis_password_never_appears_in_the_printable_url() -> None:
    s = Settings(redis_url="redis://app:s3cret@db.internal:6380/2")
    assert "s3cret" not in s.redis_url_redacted
    assert s.redis_url_redacted == "redis://app:***@db.internal:6380/2"
    assert Settings(redis_url="redis://h:1/0").redis_url_redacted == "redis://h:1/0"


def test_redis_cluster_needs_a_node_url_on_database_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="redis_cluster needs a redis_url"):
        Settings(redis_cluster=True)
    with pytest.raises(ValidationError, match="only database 0"):
        Settings(redis_url="redis://node-a:7000/3", redis_cluster=True)
    monkeypatch.setenv("MICROBATCH_REDIS_CLUSTER", "true")
    monkeypatch.setenv("MICROBATCH_REDIS_URL", "redis://node-a:7000/0")
    assert Settings().redis_cluster


def test_a_yes_no_setting_given_alone_on_the_command_line_is_switched_on() -> None:
    import click
    import typer

    from common.cli.options import settings_from_context

    def parsed(*args: str) -> Settings:
        ctx = typer.Context(click.Command("worker"), allow_extra_args=True)
        ctx.args = list(args)
        return settings_from_context(ctx, redis_url="redis://node-a:7000")

    assert parsed("--redis-cluster").redis_cluster
    assert parsed("--redis-cluster", "--max-batch-size", "4").redis_cluster
    assert not parsed("--redis-cluster", "false").redis_cluster


def test_gateway_processes_default_to_one_and_must_be_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings(_env_file=None).processes == 1
    monkeypatch.setenv("MICROBATCH_PROCESSES", "4")
    assert Settings().processes == 4
    with pytest.raises(ValidationError, match="processes"):
        Settings(processes=0)


def test_each_gateway_process_gets_its_own_gateway_id_and_the_resolved_port() -> None:
    from common.cli.processes import child_settings

    given = Settings(redis_url="redis://h:1/0", processes=3, gateway_id="edge", port=0)
    children = [child_settings(given, i, 8123) for i in range(3)]
    assert [c.gateway_id for c in children] == ["edge-0", "edge-1", "edge-2"]
    assert {(c.port, c.processes) for c in children} == {(8123, 1)}
    # unset, each process names itself host + its own pid
    assert child_settings(Settings(processes=2), 0, 8123).gateway_id is None


def test_a_client_may_not_ask_for_a_deadline_past_the_operator_s_cap() -> None:
    from common.errors import InvalidRequest
    from gateway.request import timeout_ms_of

    assert timeout_ms_of("4000", 30_000, 4000) == 4000
    with pytest.raises(InvalidRequest, match=r"in 1\.\.4000"):
        timeout_ms_of("4001", 30_000, 4000)
    with pytest.raises(ValueError, match="request_timeout_ms must not exceed"):
        Settings(request_timeout_ms=60_000, max_request_timeout_ms=30_000)


def test_one_generation_request_starts_at_most_max_sequences_per_request() -> None:
    from common.errors import InvalidRequest
    from gateway.routes.generation import check_sequences

    check_sequences(16, 16, 256)
    with pytest.raises(InvalidRequest, match="256 prompts x 16 choices each are 4096 sequences"):
        check_sequences(256, 16, 256)


def test_one_generation_request_asks_for_at_most_max_tokens_per_request() -> None:
    from common.errors import InvalidRequest
    from gateway.routes.generation import check_tokens

    check_tokens(4096, 4096)
    with pytest.raises(InvalidRequest, match="asks for 4097 tokens") as refused:
        check_tokens(4097, 4096)
    assert refused.value.param == "max_tokens" and refused.value.status == 400
    with pytest.raises(ValueError, match="max_tokens_per_request must not exceed"):
        Settings(max_tokens_per_request=2000, max_queued_tokens=1000)


def test_a_stuck_entry_is_reclaimable_before_its_client_gives_up() -> None:
    assert Settings().claim_idle_ms < Settings().request_timeout_ms
    with pytest.raises(ValueError, match="claim_idle_ms must be below request_timeout_ms"):
        Settings(claim_idle_ms=30_000, request_timeout_ms=30_000)


def test_only_listed_keys_may_ask_for_interactive_priority() -> None:
    from common.errors import PermissionDenied
    from gateway.auth import check_interactive

    check_interactive(None, [])  # no API keys: nobody to tell apart
    check_interactive("fast", ["fast"])
    check_interactive("anyone", ["*"])
    for key, allowed in (("slow", ["fast"]), ("slow", [])):
        with pytest.raises(PermissionDenied, match="interactive_api_keys") as refused:
            check_interactive(key, allowed)
        assert refused.value.status == 403 and "slow" not in str(refused.value)
    assert Settings(interactive_api_keys="a, b").interactive_api_keys == ["a", "b"]


def test_a_prompt_scored_token_by_token_has_a_length_cap() -> None:
    import numpy as np

    from common.errors import InvalidRequest
    from gateway.routes.generation import check_scored_prompts

    check_scored_prompts([np.zeros(8192), np.zeros(3)], 8192)
    with pytest.raises(InvalidRequest, match="this prompt has 8193 tokens") as refused:
        check_scored_prompts([np.zeros(3), np.zeros(8193)], 8192)
    assert refused.value.param == "echo" and refused.value.status == 400
