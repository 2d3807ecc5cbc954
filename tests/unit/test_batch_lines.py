"""A batch's input checked and its results shaped, without Redis or HTTP."""

from __future__ import annotations

import re

import orjson
import pytest

from common.errors import InvalidRequest
from gateway.batch_lines import Line, assemble, read_lines, result_line, unfinished_line
from gateway.batch_records import batch_object
from gateway.batch_run import Window
from gateway.routes.objects import after_cursor

EMBED = "/v1/embeddings"
ID_RULE = "custom_id must be a string of 1..512 characters"


def line(i: int, **over: object) -> bytes:
    body = {"custom_id": f"c{i}", "method": "POST", "url": EMBED, "body": {"input": "x"}}
    return orjson.dumps({**body, **over})


def known(model: str | None) -> str | None:
    return None if model in (None, "m") else f"model {model!r} is not served here"


def test_good_lines_are_read_in_order_with_their_bodies_and_blank_lines_skipped() -> None:
    data = line(0) + b"\n\n" + line(1, body={"input": "y", "model": "m"}) + b"\n"
    lines, problems = read_lines(data, EMBED, 10, known)
    assert problems == []
    assert [(x.index, x.custom_id, x.model) for x in lines] == [(0, "c0", None), (1, "c1", "m")]
    assert orjson.loads(lines[1].body) == {"input": "y", "model": "m"}


@pytest.mark.parametrize(
    ("raw", "code", "says", "param"),
    [
        (b"{nope", "invalid_json_line", "line is not JSON: .+", None),
        (b"[1, 2]", "invalid_json_line", "line is not a JSON object", None),
        (line(0, custom_id=""), "invalid_custom_id", ID_RULE, "custom_id"),
        (line(0, custom_id=7), "invalid_custom_id", ID_RULE, "custom_id"),
        (line(0, custom_id="x" * 513), "invalid_custom_id", ID_RULE, "custom_id"),
        (line(0, method="GET"), "invalid_method", "method must be POST", "method"),
        (
            line(0, url="/v1/completions"),
            "mismatched_endpoint",
            "url '/v1/completions' is not the batch's endpoint '/v1/embeddings'",
            "url",
        ),
        (line(0, body="text"), "invalid_body", "body must be a JSON object", "body"),
        (
            line(0, body={"input": "x", "stream": True}),
            "invalid_body",
            "a batch line cannot stream; leave out stream",
            "body.stream",
        ),
        (
            line(0, body={"input": "x", "model": 3}),
            "invalid_model",
            "model must be a string",
            "body.model",
        ),
        (
            line(0, body={"input": "x", "model": "other"}),
            "invalid_model",
            "model 'other' is not served here",
            "body.model",
        ),
    ],
)
def test_each_bad_line_is_a_problem_naming_its_code_line_and_why(
    raw: bytes, code: str, says: str, param: str | None
) -> None:
    lines, problems = read_lines(line(9) + b"\n" + raw, EMBED, 10, known)
    assert [(p.code, p.line) for p in problems] == [(code, 2)]
    assert problems[0].object() == {
        "code": code,
        "message": problems[0].message,
        "param": param,
        "line": 2,
    }
    assert re.fullmatch(says, problems[0].message)  # the whole message: clients read it
    assert [x.custom_id for x in lines] == ["c9"]


def test_custom_ids_of_one_and_of_512_characters_are_taken() -> None:
    data = line(0, custom_id="a") + b"\n" + line(1, custom_id="b" * 512)
    lines, problems = read_lines(data, EMBED, 10, known)
    assert problems == [] and [len(x.custom_id) for x in lines] == [1, 512]


def test_bad_lines_count_toward_the_line_limit_too() -> None:
    data = b"\n".join([b"{bad", b"{bad", line(0), line(1)])
    _, problems = read_lines(data, EMBED, 3, known)
    assert [p.code for p in problems] == [
        "invalid_json_line",
        "invalid_json_line",
        "too_many_lines",
    ]
    assert problems[-1].message == "a batch holds at most 3 lines"


def test_a_custom_id_used_twice_is_a_problem_at_its_second_use() -> None:
    _, problems = read_lines(line(0) + b"\n" + line(1) + b"\n" + line(0), EMBED, 10, known)
    assert [(p.code, p.line) for p in problems] == [("duplicate_custom_id", 3)]
    assert problems[0].message == "custom_id 'c0' is used twice"


def test_a_file_longer_than_the_limit_and_an_empty_file_are_problems() -> None:
    data = b"\n".join(line(i) for i in range(4))
    _, problems = read_lines(data, EMBED, 3, known)
    assert [p.code for p in problems] == ["too_many_lines"]
    (empty,) = read_lines(b"\n \n", EMBED, 3, known)[1]
    assert (empty.code, empty.message) == ("empty_file", "the input file holds no requests")


def test_problems_are_listed_up_to_a_hundred() -> None:
    data = b"\n".join(b"{bad" for _ in range(150))
    assert len(read_lines(data, EMBED, 1000, known)[1]) == 100


def test_a_result_line_carries_the_routes_answer_and_is_answered_only_for_a_2xx() -> None:
    entry = Line(3, "c3", b"{}", None)
    ok, out = result_line("batch_x", entry, 200, "rid", b'{"object": "list"}')
    assert ok and orjson.loads(out) == {
        "id": "batch_x_req_3",
        "custom_id": "c3",
        "response": {"status_code": 200, "request_id": "rid", "body": {"object": "list"}},
        "error": None,
    }
    failed, out = result_line("batch_x", entry, 422, "rid", b'{"error": {}}')
    assert not failed and orjson.loads(out)["response"]["status_code"] == 422
    _, out = result_line("batch_x", entry, 500, "rid", b"not json")
    assert orjson.loads(out)["response"]["body"] == {
        "error": {"message": "not json", "type": "server_error"}  # OpenAI's error object
    }


def test_only_a_2xx_status_is_answered() -> None:
    entry = Line(0, "c0", b"{}", None)
    answered = {s: result_line("b", entry, s, "rid", b"{}")[0] for s in (199, 200, 299, 300)}
    assert answered == {199: False, 200: True, 299: True, 300: False}


def test_a_json_body_after_whitespace_is_spliced_and_bad_utf8_text_is_replaced() -> None:
    entry = Line(0, "c0", b"{}", None)
    _, out = result_line("b", entry, 200, "rid", b'\n {"object": "list"}')
    assert orjson.loads(out)["response"]["body"] == {"object": "list"}
    _, out = result_line("b", entry, 502, "rid", b"bad \xff gateway")
    body = orjson.loads(out)["response"]["body"]
    assert body == {"error": {"message": "bad \ufffd gateway", "type": "server_error"}}


def test_files_are_assembled_in_input_order_by_outcome() -> None:
    lines = [Line(i, f"c{i}", b"{}", None) for i in range(4)]
    results = {f"c{i}": f"r{i}".encode() for i in (3, 0, 1)}
    answered = {"c0": True, "c1": False, "c3": True}
    output, errors = assemble(lines, results, answered)
    assert output == b"r0\nr3\n" and errors == b"r1\n"
    unfinished = orjson.loads(unfinished_line("batch_x", lines[2], "batch_expired", "late"))
    assert unfinished == {
        "id": "batch_x_req_2",
        "custom_id": "c2",
        "response": None,
        "error": {"code": "batch_expired", "message": "late"},
    }


def test_the_window_halves_on_refusal_and_grows_back_as_lines_are_answered() -> None:
    window = Window(64)
    assert window.size == 16
    window.refused()
    window.refused()
    assert window.size == 4
    for _ in range(1000):  # about 4 lines more per window's worth of answers
        window.answered()
    assert window.size == 64
    for _ in range(10):
        window.refused()
    assert window.size == 1


def test_cursor_pages_follow_after_and_say_whether_more_remain() -> None:
    ids = ["a", "b", "c", "d", "e"]
    assert after_cursor(ids, None, 2) == (["a", "b"], True)
    assert after_cursor(ids, "b", 2) == (["c", "d"], True)
    assert after_cursor(ids, "d", 2) == (["e"], False)
    with pytest.raises(InvalidRequest, match="after"):
        after_cursor(ids, "zz", 2)


def test_a_batch_reads_cancelling_until_its_driver_has_finished_it() -> None:
    record = {
        "id": "batch_x",
        "endpoint": EMBED,
        "input_file_id": "file-1",
        "completion_window": "24h",
        "status": "in_progress",
        "created_at": "10",
        "expires_at": "20",
        "cancelling_at": "12",
        "total": "5",
        "completed": "2",
        "failed": "1",
    }
    body = batch_object(record)
    assert body["status"] == "cancelling" and body["cancelling_at"] == 12
    assert body["request_counts"] == {"total": 5, "completed": 2, "failed": 1}
    assert body["errors"] is None and body["metadata"] is None and body["completed_at"] is None
    assert batch_object({**record, "status": "cancelled"})["status"] == "cancelled"


def test_background_is_a_priority_a_client_may_name() -> None:
    from common.protocol import PRIORITY_BACKGROUND, PRIORITY_BATCH
    from gateway.request import priority_of

    assert priority_of("background") == PRIORITY_BACKGROUND
    assert priority_of(None) == priority_of("BATCH") == PRIORITY_BATCH
    with pytest.raises(InvalidRequest, match="'interactive', 'batch' or 'background'"):
        priority_of("bulk")
