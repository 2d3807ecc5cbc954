"""The error tree: one class per status the gateway answers, one type table, one conversion."""

from __future__ import annotations

import pytest

from common import errors
from common.errors import (
    ClientGone,
    ContextLengthExceeded,
    DeadlineExceeded,
    InferenceFailed,
    InputTooLong,
    InternalError,
    InvalidBody,
    InvalidRequest,
    MethodNotAllowed,
    MicrobatchError,
    ModelNotFound,
    Overloaded,
    RateLimited,
    RouteNotFound,
    ServiceUnavailable,
    Unauthorized,
    WorkerFailed,
    error_for_http_status,
    error_from_reply,
)

ANSWERED = {400, 401, 404, 405, 413, 422, 429, 499, 500, 502, 503, 504}


def _tree() -> list[type[MicrobatchError]]:
    found, todo = [], [MicrobatchError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_status_the_gateway_answers_is_a_class_of_the_tree() -> None:
    assert {cls.status for cls in _tree()} >= ANSWERED


@pytest.mark.parametrize(
    ("cls", "status", "kind"),
    [
        (InvalidRequest, 400, "invalid_request_error"),
        (InvalidBody, 422, "invalid_request_error"),
        (InputTooLong, 413, "invalid_request_error"),
        (ContextLengthExceeded, 400, "invalid_request_error"),
        (RouteNotFound, 404, "invalid_request_error"),
        (MethodNotAllowed, 405, "invalid_request_error"),
        (Unauthorized, 401, "authentication_error"),
        (ModelNotFound, 404, "invalid_request_error"),
        (RateLimited, 429, "rate_limit_error"),
        (ClientGone, 499, "client_closed_request"),
        (InternalError, 500, "server_error"),
        (InferenceFailed, 500, "server_error"),
        (WorkerFailed, 502, "server_error"),
        (ServiceUnavailable, 503, "service_unavailable"),
        (Overloaded, 503, "service_unavailable"),
        (DeadlineExceeded, 504, "timeout"),
    ],
)
def test_each_error_knows_its_status_and_openai_type(
    cls: type[MicrobatchError], status: int, kind: str
) -> None:
    err = cls("what went wrong", param="input")
    assert (err.status, err.type) == (status, kind)
    assert err.body() == {
        "error": {"message": "what went wrong", "type": kind, "param": "input", "code": err.code}
    }


def test_a_narrower_code_is_given_at_construction_not_by_mutation() -> None:
    err = Overloaded("queue too deep", retry_after_s=2.0, code="deadline_unreachable")
    assert (err.status, err.code, err.retry_after_s) == (503, "deadline_unreachable", 2.0)
    assert Overloaded("x").code == "overloaded"  # the class keeps its own


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (400, "wrong_model", InvalidRequest),
        (400, "context_length_exceeded", ContextLengthExceeded),
        (413, "input_too_long", InputTooLong),
        (500, "inference_failed", InferenceFailed),
        (500, "dead_lettered", InferenceFailed),
        (504, "deadline_exceeded", DeadlineExceeded),
    ],
)
def test_a_workers_error_reply_becomes_its_class_with_its_own_code(
    status: int, code: str, cls: type[MicrobatchError]
) -> None:
    err = error_from_reply(status, code, "the worker's message")
    assert type(err) is cls
    assert (err.status, err.code, err.message) == (status, code, "the worker's message")


def test_http_framework_statuses_map_to_classes() -> None:
    assert type(error_for_http_status(404, "Not Found")) is RouteNotFound
    assert type(error_for_http_status(405, "Method Not Allowed")) is MethodNotAllowed
    other = error_for_http_status(400, "bad")
    assert (other.status, other.code) == (400, "http_error")


def test_statuses_without_a_row_fall_back_by_class_of_status() -> None:
    assert errors.openai_type(418) == "invalid_request_error"
    assert errors.openai_type(507) == "server_error"
