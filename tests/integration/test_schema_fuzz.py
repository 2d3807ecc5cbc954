"""Schemathesis against the live gateway's own OpenAPI spec: no request it allows gets a 5xx.

The random-JSON fuzz next door ignores the schema; this one reads `/openapi.json` from the
running gateway and generates requests that follow it (and ones that break it), so every
route and every field the gateway advertises is exercised the way a client would.

Schemathesis' `pytest.from_fixture` breaks on pytest 9 (it rewrites `node._nodeid`), so the
schema is loaded inside the test and each operation's Hypothesis strategy is driven here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.conftest import Processes, wait_ready

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

EXAMPLES_PER_OPERATION = 50


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    procs = Processes(tmp_path_factory.mktemp("schema"))
    serve = procs.start("serve", model="noop", max_wait_ms=0)
    wait_ready(serve)
    yield serve.base_url
    procs.stop_all()


def _fuzz(operation: schemathesis.APIOperation, url: str) -> None:
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=operation.as_strategy())
    def call(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error])

    call()


def test_requests_the_openapi_spec_describes_never_get_a_5xx(gateway_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    routes = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/embeddings", "GET /v1/models", "GET /readyz"} <= routes, routes
    for operation in operations:
        _fuzz(operation, gateway_url)
