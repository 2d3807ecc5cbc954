"""Schemathesis against the live gateway's own OpenAPI spec: no request it allows gets a 5xx.

The random-JSON fuzz next door ignores the schema; this one reads `/openapi.json` from the
running gateway and generates requests that follow it (and ones that break it), so every
route and every field the gateway advertises is exercised the way a client would. The fleet
is real and whole: a real redis-server, and workers of all three kinds (an embedding model,
a causal LM, a cross-encoder), each route's requests aimed at a model of its kind, so a
generation or rerank body reaches its worker instead of stopping at the model-kind check.

Schemathesis' `pytest.from_fixture` breaks on pytest 9 (it rewrites `node._nodeid`), so the
schema is loaded inside the test and each operation's Hypothesis strategy is driven here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, seed, settings
from schemathesis.checks import not_a_server_error

from tests.conftest import Processes, RedisServer, wait_ready

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

EXAMPLES_PER_OPERATION = 50
SEED = 20261207
# One valid body per kind's route, run before the drawn ones: whether the draws include a
# valid body (a chat message with a role and content) depends on more than the seed, so the
# check that each kind's worker was reached rests on these, not on luck.
VALID = {
    "/v1/embeddings": {"input": "a"},
    "/v1/completions": {"prompt": "a", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
}


# the model each route's fuzzed requests name (the rest name none, or keep what they drew)
KIND_OF_ROUTE = {
    "/v1/embeddings": "noop",
    "/embed": "noop",
    "/v1/completions": "lm",
    "/v1/chat/completions": "lm",
    "/tokenize": "lm",
    "/detokenize": "lm",
    "/v1/rerank": "reranker",
    "/rerank": "reranker",
    "/v2/rerank": "reranker",
    "/classify": "reranker",
    "/predict": "reranker",
}


@pytest.fixture(scope="module")
def gateway_url(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    from worker.encode.tiny_classifier import write_tiny_classifier
    from worker.generate.tiny_model import TinyShape, write_tiny_model

    root = tmp_path_factory.mktemp("schema")
    reranker = write_tiny_classifier(root / "reranker")
    # a context of 96 tokens: every generation the fuzz draws ends in a few dozen steps
    lm = write_tiny_model(root / "lm", TinyShape(max_positions=96))
    procs = Processes(root)
    common = {"redis_url": module_redis.url, "prefix": "mbfuzz"}
    try:
        procs.start("worker", model="noop", max_wait_ms=0, **common)
        procs.start("worker", model=lm, served_model_name="lm", **common)
        procs.start("worker", model=reranker, served_model_name="reranker", **common)
        gateway = procs.start("gateway", model="noop", **common)
        wait_ready(gateway, models=3)
        yield gateway.base_url
    finally:
        procs.stop_all()


def _aimed(case: schemathesis.Case) -> None:
    """Name a model of the route's kind in a JSON body that is a map (a drawn name is almost
    never served: a 404 before any worker)."""
    kind = KIND_OF_ROUTE.get(case.operation.path)
    if kind is not None and isinstance(case.body, dict):
        case.body["model"] = kind


def _fuzz(operation: schemathesis.APIOperation, url: str) -> None:
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    # The same examples every run, in any process: CI is reproducible, not a lottery.
    # (`derandomize` hashed the strategy's description, which differed with what the process
    # had run before, so a route's valid bodies came or went with the test order.)
    @seed(SEED)
    @given(case=operation.as_strategy())
    def call(case: schemathesis.Case) -> None:
        _aimed(case)
        response = case.call(base_url=url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])

    valid = VALID.get(operation.path) if operation.method.upper() == "POST" else None
    if valid is not None:
        call = example(case=operation.Case(body=dict(valid), media_type="application/json"))(call)
    call()


# One test drives every operation the spec lists (about 40) × 50 examples through one fleet,
# and its setup starts four processes: about a minute alone on 2 cores, more beside another
# test, so the default 60 s would cut it off mid-request (it did, on CI).
@pytest.mark.timeout(240)
def test_requests_the_openapi_spec_describes_never_get_a_5xx(gateway_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    routes = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/embeddings", "GET /v1/models", "GET /readyz"} <= routes, routes
    assert {"POST /v1/chat/completions", "POST /v1/rerank"} <= routes, routes
    for operation in operations:
        _fuzz(operation, gateway_url)
    # the fuzz reached each kind's worker, not only the checks in front of it
    answered = _answered(gateway_url)
    for route in ("/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/rerank"):
        assert answered.get(route, 0) > 0, (route, answered)


def _answered(url: str) -> dict[str, float]:
    """200s per route, from the gateway's own counter."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("microbatch_requests_total{") and 'status="200"' in line:
            route = re.search(r'route="([^"]+)"', line)
            if route:
                out[route.group(1)] = out.get(route.group(1), 0) + float(line.rsplit(" ", 1)[1])
    return out
