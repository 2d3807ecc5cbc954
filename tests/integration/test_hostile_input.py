"""Hostile and random input: always a 2xx or a 4xx with a JSON error, never a 5xx or a hang."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Processes, RedisServer, wait_ready

pytestmark = pytest.mark.process  # a module-scoped deployment of processes


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer, tmp_path_factory) -> Iterator[str]:
    """A gateway and a worker as deployed: separate processes over a real redis-server
    (its own key prefix), not the embedded store."""
    procs = Processes(tmp_path_factory.mktemp("hostile"))
    common = {"redis_url": redis_server.url, "model": "noop", "prefix": "mbhostile"}
    try:
        procs.start("worker", max_wait_ms=0, **common)
        gateway = procs.start("gateway", **common)
        wait_ready(gateway)
        yield gateway.base_url
    finally:
        procs.stop_all()


def post(url: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/embeddings",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )


def assert_clean(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"input": json_values},
        optional={
            "model": json_values,
            "encoding_format": json_values,
            "truncate": json_values,
            "dimensions": json_values,
            "user": json_values,
        },
    ),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies)
def test_random_json_bodies_never_get_a_5xx(gateway: str, body: object) -> None:
    assert_clean(post(gateway, json.dumps(body).encode()))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=200))
def test_random_bytes_never_get_a_5xx(gateway: str, raw: bytes) -> None:
    assert_clean(post(gateway, raw))


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b'{"input": "\xff\xfe not utf-8"}', 422),
        (b'{"input": "\\ud800 lone surrogate"}', 422),
        (b'{"input": "nul \\u0000 byte and \\u0007 bell"}', 200),
        (b'{"input": [[1e400]]}', 422),
        (b'{"input": [[100000000000000000000000000000]]}', 422),
        (b'{"input": [[-1]]}', 422),
        (b"[" * 100_000 + b"]" * 100_000, 422),
        (b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", 422),
        (json.dumps({"input": "x" * 100_000}).encode(), 200),  # one 100 KB "word"
        (json.dumps({"input": ["a"] * 3000}).encode(), 400),  # over max_inputs_per_request
    ],
)
def test_hostile_bodies_get_a_defined_answer(gateway: str, content: bytes, status: int) -> None:
    response = post(gateway, content)
    assert response.status_code == status, response.text
    assert_clean(response)


def test_the_gateway_still_serves_after_all_that(gateway: str) -> None:
    assert httpx.post(f"{gateway}/v1/embeddings", json={"input": "still fine"}).status_code == 200


@pytest.mark.parametrize(
    ("header", "value"),
    [
        # b"\xb2" is "²" as the server decodes headers (latin-1): a Unicode digit, for which
        # str.isdigit() holds and int() raises
        ("X-Microbatch-Timeout-Ms", b"\xb2"),
        ("X-Microbatch-Timeout-Ms", "٣٠٠٠".encode()),  # Arabic-Indic digits, as UTF-8
        ("X-Microbatch-Timeout-Ms", b"0"),
        ("X-Microbatch-Priority", b"urgent"),
        ("X-Request-ID", b"has space"),
    ],
)
def test_a_malformed_header_is_a_400_naming_it_before_the_body_is_read(
    gateway: str, header: str, value: bytes
) -> None:
    """Every header is checked at the edge, before the body: even a body that is not JSON
    gets the header's 400, not the body's."""
    response = httpx.post(
        f"{gateway}/v1/embeddings",
        content=b"not json",
        headers={"content-type": "application/json", header: value},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert header in response.json()["error"]["message"]
