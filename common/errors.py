"""The exception tree; each error knows its HTTP status and OpenAI error `type` and `code`.

    MicrobatchError                500  base; `code` may be narrowed per instance
    ├── InvalidRequest             400  a field is wrong (param names it)
    │   ├── InvalidBody            422  the body is not JSON, or not the route's schema
    │   ├── InputTooLong           413  over the token or body limit (message gives both numbers)
    │   ├── ContextLengthExceeded  400  prompt + max_tokens over the model's context (says both)
    │   ├── RouteNotFound          404  no such path
    │   └── MethodNotAllowed       405  the path exists, the method does not
    ├── Unauthorized               401  missing or wrong API key
    ├── PermissionDenied           403  this key may not ask for that (interactive priority)
    ├── ModelNotFound              404  no worker has registered that model
    ├── ObjectNotFound             404  no such file, batch or response (for this key)
    ├── Conflict                   409  the object's state forbids it (cancel a finished batch)
    ├── RateLimited                429  this API key is over its rate (Retry-After)
    ├── ClientGone                 499  the client left before its answer (nginx's code)
    ├── InternalError              500  a bug in microbatch, never the client's fault
    ├── InferenceFailed            500  the worker failed on this input (only this input)
    ├── WorkerFailed               502  a worker died mid-stream; what was streamed is partial
    ├── ServiceUnavailable         503  Redis unreachable or no live worker (Retry-After)
    │   └── Overloaded             503  queue over max_queue_depth (Retry-After)
    └── DeadlineExceeded           504  the answer did not come before the deadline

Lower-layer errors (redis, torch, tokenizers) are mapped to these at the module edges; an
error a worker sends back as a reply becomes one of these in `error_from_reply`, the only
place a reply turns into an exception. `openai_type` is the one status → OpenAI type table.
"""

from __future__ import annotations

from typing import Any

# OpenAI's error `type` per HTTP status; statuses not listed are server errors
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout",
}


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class MicrobatchError(Exception):
    status: int = 500
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers or {}  # more the answer carries (a quota's rate-limit state)
        if code is not None:
            self.code = code  # a narrower reason than the class's own (e.g. "wrong_model")

    @property
    def type(self) -> str:
        return openai_type(self.status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(MicrobatchError):
    status, code = 400, "invalid_request"


class InvalidBody(InvalidRequest):
    status = 422


class InputTooLong(InvalidRequest):
    status, code = 413, "input_too_long"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class RouteNotFound(InvalidRequest):
    status, code = 404, "not_found"


class MethodNotAllowed(InvalidRequest):
    status, code = 405, "method_not_allowed"


class Unauthorized(MicrobatchError):
    status, code = 401, "invalid_api_key"


class PermissionDenied(MicrobatchError):
    status, code = 403, "permission_denied"


class ModelNotFound(MicrobatchError):
    status, code = 404, "model_not_found"


class ObjectNotFound(MicrobatchError):
    status, code = 404, "not_found"


class Conflict(MicrobatchError):
    status, code = 409, "conflict"


class RateLimited(MicrobatchError):
    status, code = 429, "rate_limited"


class ClientGone(MicrobatchError):
    """The client closed the connection before its answer was ready."""

    status, code = 499, "client_closed_request"


class InternalError(MicrobatchError):
    status, code = 500, "internal_error"


class InferenceFailed(MicrobatchError):
    status, code = 500, "inference_failed"


class WorkerFailed(MicrobatchError):
    status, code = 502, "worker_failed"


class ServiceUnavailable(MicrobatchError):
    status, code = 503, "unavailable"


class Overloaded(ServiceUnavailable):
    code = "overloaded"


class DeadlineExceeded(MicrobatchError):
    status, code = 504, "deadline_exceeded"


# The class a worker's error reply becomes, by its status; 400 by its code where one is known
_BY_STATUS: dict[int, type[MicrobatchError]] = {
    400: InvalidRequest,
    413: InputTooLong,
    500: InferenceFailed,
    502: WorkerFailed,
    503: ServiceUnavailable,
    504: DeadlineExceeded,
}
_BY_CODE: dict[str, type[MicrobatchError]] = {
    "context_length_exceeded": ContextLengthExceeded,
    "internal_error": InternalError,
}


def error_from_reply(status: int, code: str, message: str) -> MicrobatchError:
    """The exception an error reply from a worker stands for, with the reply's own code."""
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status, InternalError)
    return cls(message, code=code)


def error_for_http_status(status: int, message: str) -> MicrobatchError:
    """The error for a status the HTTP framework raised itself (unknown path or method)."""
    if status == 404:
        return RouteNotFound(message)
    if status == 405:
        return MethodNotAllowed(message)
    return InvalidRequest(message, code="http_error") if status < 500 else InternalError(message)
