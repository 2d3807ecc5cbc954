"""A batch's lines, as pure functions: the input file checked, and result lines shaped.

An input line is OpenAI's `{"custom_id", "method": "POST", "url", "body"}`. A file with any
bad line fails its batch at validation with every problem listed (as OpenAI's `errors`),
before a line is queued. Result lines are OpenAI's too: `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, answered lines in the output file and the
rest in the error file, in input order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

ENDPOINTS = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/rerank")
MAX_ERRORS = 100  # a failed batch lists this many problems at most
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class Line:
    index: int  # 0-based, in the file's order
    custom_id: str
    body: bytes  # the request body as the route reads it
    model: str | None


@dataclass(frozen=True, slots=True)
class Problem:
    code: str
    message: str
    line: int | None = None  # 1-based, as OpenAI numbers them
    param: str | None = None

    def object(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def read_lines(
    data: bytes, endpoint: str, max_lines: int, model_problem: Callable[[str | None], str | None]
) -> tuple[list[Line], list[Problem]]:
    """Every line of `data` checked; `model_problem(name)` says what is wrong with a line's
    model (None: it serves `endpoint`). Blank lines are skipped, as JSONL readers do."""
    lines: list[Line] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(problems) >= max_lines:
            problems.append(Problem("too_many_lines", f"a batch holds at most {max_lines} lines"))
            break
        line, problem = _read_line(raw, number, endpoint, len(lines), model_problem)
        if problem is None and line is not None and line.custom_id in seen:
            problem = Problem(
                "duplicate_custom_id", f"custom_id {line.custom_id!r} is used twice", number
            )
        if problem is not None:
            problems.append(problem)
        elif line is not None:
            seen.add(line.custom_id)
            lines.append(line)
    if not lines and not problems:
        problems.append(Problem("empty_file", "the input file holds no requests"))
    return lines, problems[:MAX_ERRORS]


def _read_line(
    raw: bytes,
    number: int,
    endpoint: str,
    index: int,
    model_problem: Callable[[str | None], str | None],
) -> tuple[Line | None, Problem | None]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, Problem("invalid_json_line", f"line is not JSON: {exc}", number)
    if not isinstance(obj, dict):
        return None, Problem("invalid_json_line", "line is not a JSON object", number)
    custom_id, body = obj.get("custom_id"), obj.get("body")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        message = f"custom_id must be a string of 1..{MAX_CUSTOM_ID} characters"
        return None, Problem("invalid_custom_id", message, number, "custom_id")
    if obj.get("method") != "POST":
        return None, Problem("invalid_method", "method must be POST", number, "method")
    if obj.get("url") != endpoint:
        message = f"url {obj.get('url')!r} is not the batch's endpoint {endpoint!r}"
        return None, Problem("mismatched_endpoint", message, number, "url")
    if not isinstance(body, dict):
        return None, Problem("invalid_body", "body must be a JSON object", number, "body")
    if body.get("stream"):
        message = "a batch line cannot stream; leave out stream"
        return None, Problem("invalid_body", message, number, "body.stream")
    model = body.get("model")
    wrong = "model must be a string" if not (model is None or isinstance(model, str)) else None
    wrong = wrong or model_problem(model)
    if wrong is not None:
        return None, Problem("invalid_model", wrong, number, "body.model")
    return Line(index, custom_id, orjson.dumps(body), model), None


def result_line(
    batch_id: str, line: Line, status: int, request_id: str, body: bytes
) -> tuple[bool, bytes]:
    """A line's answer as its output line: (answered, line). A 2xx goes to the output file,
    any other status to the error file, each with the route's own body: spliced in as the
    JSON it already is (a line's result is never parsed and written again), or, were it
    not a JSON object, carried as an error's message."""
    if not body.lstrip().startswith(b"{"):
        text = body.decode("utf-8", "replace")
        body = orjson.dumps({"error": {"message": text, "type": "server_error"}})
    head = orjson.dumps({"id": f"{batch_id}_req_{line.index}", "custom_id": line.custom_id})
    response = orjson.dumps({"status_code": status, "request_id": request_id})
    out = b"".join(
        (head[:-1], b',"response":', response[:-1], b',"body":', body, b'},"error":null}')
    )
    return 200 <= status < 300, out


def unfinished_line(batch_id: str, line: Line, code: str, message: str) -> bytes:
    """A line that never ran (`batch_expired`, `batch_cancelled`): an error, no response."""
    out = {
        "id": f"{batch_id}_req_{line.index}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(out)


def assemble(
    lines: Iterable[Line], results: Mapping[str, bytes], answered: Mapping[str, bool]
) -> tuple[bytes, bytes]:
    """(output file, error file): each line's result in input order, by whether it was
    answered; lines without a result are left out (the caller writes theirs first)."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for line in lines:
        result = results.get(line.custom_id)
        if result is not None:
            (output if answered.get(line.custom_id) else errors).append(result)
    return _jsonl(output), _jsonl(errors)


def _jsonl(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)
