"""The exception tree; each error knows its HTTP status and OpenAI error `type` and `code`.

    MicrobatchError
    ├── InvalidRequest         400  a field is wrong (param names it)
    │   ├── InputTooLong       413  over the token or body limit (message gives both numbers)
    │   └── ContextLengthExceeded 400  prompt + max_tokens over the model's context (says both)
    ├── Unauthorized           401  missing or wrong API key
    ├── ModelNotFound          404  no worker has registered that model
    ├── RateLimited            429  this API key is over its rate (Retry-After)
    ├── ServiceUnavailable     503  Redis unreachable or no live worker (Retry-After)
    │   └── Overloaded         503  queue over max_queue_depth (Retry-After)
    ├── DeadlineExceeded       504  the answer did not come before the deadline
    └── InferenceFailed        500  the worker failed on this input (only this input)

Lower-layer errors (redis, torch, tokenizers) are mapped to these at the module edges.
"""

from __future__ import annotations

from typing import Any


class MicrobatchError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

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
    status, type, code = 400, "invalid_request_error", "invalid_request"


class InputTooLong(InvalidRequest):
    status, code = 413, "input_too_long"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(MicrobatchError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class ModelNotFound(MicrobatchError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class RateLimited(MicrobatchError):
    status, type, code = 429, "rate_limit_error", "rate_limited"


class ServiceUnavailable(MicrobatchError):
    status, type, code = 503, "service_unavailable", "unavailable"


class Overloaded(ServiceUnavailable):
    code = "overloaded"


class DeadlineExceeded(MicrobatchError):
    status, type, code = 504, "timeout", "deadline_exceeded"


class InferenceFailed(MicrobatchError):
    status, type, code = 500, "server_error", "inference_failed"
