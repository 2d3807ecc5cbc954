"""Two per-request shortcuts that must behave as what they replace: a metric child looked up
through a cache, and a response's headers added without Starlette's per-name rebuild."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter

from common.metrics import Children
from gateway.quota import encoded
from gateway.request import add_headers


def test_a_cached_child_is_the_metric_s_own_child_for_those_labels() -> None:
    counter = Counter("c_total", "c", ["tenant", "status"], registry=CollectorRegistry())
    by = Children(counter)
    by("t1", "200").inc()
    by("t1", "200").inc(2)
    by("t2", "429").inc()
    assert by("t1", "200") is counter.labels("t1", "200")
    assert counter.labels("t1", "200")._value.get() == 3
    assert counter.labels("t2", "429")._value.get() == 1


def test_added_headers_are_those_update_would_leave() -> None:
    headers = {"X-Request-ID": "r1", "x-ratelimit-limit-requests": "60", "content-type": "a/b"}
    fast, slow = JSONResponse({"a": 1}), JSONResponse({"a": 1})
    add_headers(fast, encoded(headers))
    slow.headers.update(headers)
    assert sorted(fast.raw_headers) == sorted(slow.raw_headers)
    assert fast.headers["content-type"] == "a/b"  # a name already there is replaced, once
    assert [k for k, _ in fast.raw_headers].count(b"content-type") == 1
    assert fast.headers["x-request-id"] == "r1"


def test_one_name_twice_in_other_cases_is_set_once_as_update_does() -> None:
    fast, slow = JSONResponse({}), JSONResponse({})
    twice = {"X-Request-ID": "first", "x-request-id": "second"}
    add_headers(fast, encoded(twice))
    slow.headers.update(twice)
    assert fast.headers.getlist("x-request-id") == slow.headers.getlist("x-request-id")


def test_headers_all_new_are_appended_in_order_as_update_would() -> None:
    quota = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59"}
    fast, slow = JSONResponse({"a": 1}), JSONResponse({"a": 1})
    add_headers(fast, encoded(quota))
    slow.headers.update(quota)
    assert fast.raw_headers == slow.raw_headers
