"""Logging set-up: one JSON object per line, or readable text, with the request id when known.

Call sites pass context as `extra={...}`; every extra field lands in the JSON line (or after
the message as key=value), so a request can be followed by its `request_id` from the gateway
through the worker's batch line, and, traced, to its trace by `trace_id` and `span_id`.
`auto` picks text for a terminal and JSON for anything else (a container's log collector, a
file), which is what each reader expects.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from opentelemetry.trace import format_span_id, format_trace_id, get_current_span

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """`12:43:28 INFO  microbatch.worker: message  request_id=… status=…` for a person."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)  # the traceback, if any, follows this line
        extras = [
            f"{key}={value}"
            for key, value in vars(record).items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        return f"{text}  {' '.join(extras)}" if extras else text


class TraceIds(logging.Filter):
    """A line about a request (it has a `request_id`) carries the `trace_id` and `span_id`
    of the recorded span current where it is logged (the gateway's server span); a line
    that names them itself (a worker's, about an entry) keeps its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None or hasattr(record, "trace_id"):
            return True
        context = get_current_span().get_span_context()
        if context.is_valid and context.trace_flags.sampled:
            record.trace_id = format_trace_id(context.trace_id)
            record.span_id = format_span_id(context.span_id)
        return True


def resolve_format(fmt: str, stream: object = None) -> str:
    """`auto`: text on a terminal, JSON elsewhere."""
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "text" if callable(isatty) and isatty() else "json"


def setup_logging(level: str, fmt: str = "auto") -> None:
    handler = logging.StreamHandler()
    if resolve_format(fmt, handler.stream) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    handler.addFilter(TraceIds())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
