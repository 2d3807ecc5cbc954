"""Tenants from a file, through a real gateway: their keys (plain or as digests) open the
API beside `api_keys`, each tenant's models, priorities and longest timeout hold, the file is
read again when it changes, a malformed version is refused and the last good one kept, and a
gateway started on a bad file refuses to start, naming the tenant and the field."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.settings import Settings
from tests.conftest import ROOT, RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess

BETA = "sha256:" + hashlib.sha256(b"sk-beta").hexdigest()
TENANTS = {
    "tenants": {
        "acme": {
            "api_keys": ["sk-acme"],
            "models": ["noop"],
            "priorities": ["interactive", "batch"],
            "max_timeout_ms": 20000,
        },
        "beta": {"api_keys": [BETA], "models": ["another"], "weight": 2},
    }
}


@contextlib.contextmanager
def _serving(
    redis_url: str, prefix: str, key: str, tracer: object = None, **gateway: object
) -> Iterator[str]:
    """A gateway (these settings) and a `noop` worker on one Redis: the gateway's URL, once
    `key` is answered."""
    deployment = InProcess()
    common = {"redis_url": redis_url, "prefix": prefix, "read_block_ms": 100}
    try:
        port = free_port()
        settings = Settings(**common, port=port, gateway_id=f"{prefix}-{port}", **gateway)
        url = deployment.start_gateway(settings, tracer)
        deployment.start_worker(Settings(**common, model="noop"))
        wait_until(
            lambda: _embed(url, key).status_code,
            60,
            "the noop model served",
            until=lambda status: status == 200,
        )
        yield url
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def served(module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    with _serving(
        module_redis.url, "mbten", "sk-legacy", tenants=path, api_keys=["sk-legacy"]
    ) as url:
        yield url, path


def _embed(url: str, key: str | None, model: str = "noop", **headers: str) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{url}/v1/embeddings", json={"model": model, "input": "a"}, headers={**sent, **headers}
    )


def test_tenants_keys_open_the_api_beside_api_keys(served) -> None:
    url, _ = served
    assert _embed(url, "sk-acme").status_code == 200
    assert _embed(url, "sk-legacy").status_code == 200  # api_keys: tenants with no limits
    assert _embed(url, "sk-nobody").status_code == 401
    assert _embed(url, None).status_code == 401


def test_each_tenants_models_priorities_and_timeout_hold(served) -> None:
    url, _ = served
    refused = _embed(url, "sk-beta")  # its key given as a digest; noop is not among its models
    assert refused.status_code == 403 and "'beta' may not use model 'noop'" in refused.text
    assert _embed(url, "sk-acme", **{"X-Microbatch-Priority": "interactive"}).status_code == 200
    background = _embed(url, "sk-acme", **{"X-Microbatch-Priority": "background"})
    assert background.status_code == 403 and "interactive, batch" in background.text
    long = _embed(url, "sk-acme", **{"X-Microbatch-Timeout-Ms": "25000"})
    assert long.status_code == 400 and "max_timeout_ms" in long.text
    assert _embed(url, "sk-acme", **{"X-Microbatch-Timeout-Ms": "15000"}).status_code == 200


def test_the_file_is_read_again_and_a_malformed_version_keeps_the_last_good(served) -> None:
    url, path = served
    grown = json.loads(json.dumps(TENANTS))
    grown["tenants"]["gamma"] = {"api_keys": ["sk-gamma"]}
    path.write_text(json.dumps(grown))
    wait_until(
        lambda: _embed(url, "sk-gamma").status_code,
        30,
        "the new tenant's key accepted",
        until=lambda status: status == 200,
    )
    refused = _reloads(url, "refused")
    path.write_text('{"tenants": {"gamma": {"api_keys": ["sk-gamma"], "weight": -1}}}')
    wait_until(
        lambda: _reloads(url, "refused"),
        30,
        "the malformed file refused",
        until=lambda n: n > refused,
    )
    assert _embed(url, "sk-acme").status_code == 200  # the last good file still in force
    assert _embed(url, "sk-gamma").status_code == 200
    path.write_text(json.dumps(TENANTS))  # gamma revoked
    wait_until(
        lambda: _embed(url, "sk-gamma").status_code,
        30,
        "the revoked key refused",
        until=lambda status: status == 401,
    )


def test_a_gateway_on_a_bad_tenants_file_refuses_to_start(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  acme:\n    api_keys: [k]\n    tokens_per_minute: -5\n")
    ran = subprocess.run(
        [sys.executable, "-m", "common.cli", "gateway", "--redis-url", "redis://127.0.0.1:1",
         "--tenants", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode != 0
    said = " ".join((ran.stdout + ran.stderr).split())
    assert "tenants.acme.tokens_per_minute" in said.replace("│", "").replace("  ", " ")


@pytest.fixture(scope="module")
def tenants_only(module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    """A gateway whose only keys are its tenants' (no `api_keys`): auth is on all the same."""
    path = tmp_path_factory.mktemp("tenants-only") / "tenants.json"
    two = {"acme": {"api_keys": ["sk-acme"]}, "gamma": {"api_keys": ["sk-gamma"]}}
    path.write_text(json.dumps({"tenants": two}))
    with _serving(module_redis.url, "mbonly", "sk-acme", tenants=path) as url:
        yield url


def test_a_tenants_file_alone_closes_every_route_to_a_caller_without_a_key(
    tenants_only,
) -> None:
    """The models, the metrics (tenants' names among them) and the API docs are behind the
    tenants' keys as the API is, not open because `api_keys` is empty."""
    url = tenants_only
    for path in ("/v1/models", "/v1/models/noop", "/metrics"):

        def get(key: str | None, path: str = path) -> httpx.Response:
            return httpx.get(
                f"{url}{path}", headers={"Authorization": f"Bearer {key}"} if key else {}
            )

        assert get(None).status_code == 401 and get("sk-x").status_code == 401, path
        assert get("sk-acme").is_success, path
    assert httpx.get(f"{url}/docs").status_code == 404  # docs with keys: only if public_docs


def test_a_kept_idempotent_answer_is_replayed_to_its_own_key_alone(tenants_only) -> None:
    """Another tenant sending the same Idempotency-Key and body is answered afresh, and a
    caller without a valid key is refused, never handed the kept answer."""
    url = tenants_only

    def send(key: str | None) -> httpx.Response:
        return _embed(url, key, **{"Idempotency-Key": "order-17"})

    assert send("sk-acme").status_code == 200
    again = send("sk-acme")
    assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
    for stranger in (None, "sk-nobody"):
        assert send(stranger).status_code == 401
    other = send("sk-gamma")
    assert other.status_code == 200 and "idempotent-replayed" not in other.headers


def _reloads(url: str, outcome: str) -> float:
    """The gateway's count of tenants files read again with this outcome."""
    for line in httpx.get(
        f"{url}/metrics", headers={"Authorization": "Bearer sk-legacy"}
    ).text.splitlines():
        if line.startswith(f'microbatch_tenants_reloads_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_tenant_s_quota_check_is_a_span_of_its_request(
    module_redis: RedisServer, tmp_path: Path
) -> None:
    """Traced, a tenant's request shows its quota check as a child of the server span (the
    check enters no tracing context when tracing is off)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"acme": {"api_keys": ["sk-acme"],
                                                     "tokens_per_minute": 600_000}}}))  # fmt: skip
    exported, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("microbatch")
    with _serving(module_redis.url, "mbspan", "sk-acme", tracer, tenants=path):
        spans = exported.get_finished_spans()
    (server, *_) = [s for s in reversed(spans) if s.kind is SpanKind.SERVER]
    children = {s.name for s in spans if s.parent and s.parent.span_id == server.context.span_id}
    assert "quota" in children, children
