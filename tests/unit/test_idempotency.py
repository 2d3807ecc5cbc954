"""The idempotency layer's pure parts: which answers are kept, what a key may be, what tells
two requests apart, and a kept attempt's round trip through its packing."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from gateway.idempotency import Attempt, _fingerprint, idempotency_key, keepable


@pytest.mark.parametrize(
    ("status", "kept"),
    [
        (200, True),
        (201, True),
        (400, True),
        (404, True),
        (422, True),
        (408, False),
        (409, False),
        (425, False),
        (429, False),
        (499, False),
        (500, False),
        (503, False),
        (504, False),
    ],
)
def test_only_final_answers_are_kept_for_retries(status: int, kept: bool) -> None:
    assert keepable(status) is kept


@pytest.mark.parametrize("raw", [b"", b"x" * 256, b"tab\there", "é".encode("latin-1")])
def test_a_key_is_1_to_255_printable_ascii_characters(raw: bytes) -> None:
    with pytest.raises(InvalidRequest, match="Idempotency-Key"):
        idempotency_key(raw)
    assert idempotency_key(b"x" * 255) == "x" * 255


def test_requests_differ_by_method_path_query_or_body() -> None:
    scope = {"method": "POST", "path": "/v1/embeddings", "query_string": b""}
    base = _fingerprint(scope, b"{}")
    assert base == _fingerprint(dict(scope), b"{}")
    assert base != _fingerprint(scope, b"{ }")
    assert base != _fingerprint({**scope, "path": "/v1/completions"}, b"{}")
    assert base != _fingerprint({**scope, "query_string": b"a=1"}, b"{}")


def test_a_kept_attempt_comes_back_byte_for_byte() -> None:
    kept = Attempt("fp", False, 200, ((b"content-type", b"application/json"),), b"\x00{}")
    assert Attempt.unpack(kept.pack()) == kept
    assert Attempt.unpack(Attempt("fp", True).pack()).running


def test_a_process_knows_its_own_age() -> None:
    """What a worker records as its cold start: this process started before the test, less
    than a day ago, and its age grows."""
    import time

    from common.clock import process_age_s

    first = process_age_s()
    time.sleep(0.02)
    assert 0 < first < process_age_s() < 86_400
