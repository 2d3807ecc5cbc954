"""The gateway's settings: a part of `common.settings.Settings`, declared apart for length.

Nothing builds this class alone: `Settings` inherits it, so one object still holds every
CLI option and `MICROBATCH_<NAME>` variable, validated once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, NoDecode

from common.message_checks import MAX_ENTRY_ROWS


class GatewaySettings(BaseSettings):
    # Each `description` is the setting's row in docs/settings.md (common/settings_doc.py).

    host: str = Field(
        default="127.0.0.1",
        description="gateway bind address (a worker's `metrics_port` listens on it too)",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="gateway port")
    admin_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="also serve `/metrics`, `/healthz` and `/readyz` on this port (and only "
        "them); `/metrics` then leaves the API port",
    )
    public_docs: bool = Field(
        default=False,
        description="serve `/docs` and `/openapi.json` even with keys set (`api_keys` or a "
        "tenants file; without keys they are always served)",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="let a gateway listen beyond loopback with no `api_keys` (logged at every "
        "start); without it such a start is refused",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="accepted `Authorization: Bearer` keys; empty = no auth"
    )
    tenants: Path | None = Field(
        default=None,
        description="a tenants file (JSON or YAML): API keys grouped by tenant, each with the "
        "models and priorities it may use and its limits (docs/operations.md#tenants); read "
        "again when it changes, a malformed version refused and the last good one kept",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        default="auto",
        description="how a chat's `auto` tool calls are read from the text: `hermes` "
        "(`<tool_call>`), `llama3_json`, `mistral` (`[TOOL_CALLS]`); `auto` = from the "
        "model's chat template",
    )
    quota_on_redis_error: Literal["open", "closed"] = Field(
        default="open",
        description="when Redis cannot answer a tenant's quota check: `open` admits the "
        "request (counted in `microbatch_quota_checks_total`), `closed` refuses it 503",
    )
    rate_limit_per_key: float = Field(
        default=0.0,
        ge=0,
        description="per-key token bucket: requests/s sustained, 429 over it; 0 = off",
    )
    rate_limit_burst: int = Field(
        default=20, gt=0, description="per-key token bucket: requests at once"
    )
    request_timeout_ms: int = Field(
        default=30_000, gt=0, description="default deadline (`X-Microbatch-Timeout-Ms` overrides)"
    )
    max_request_timeout_ms: int = Field(
        default=600_000,
        gt=0,
        description="the longest deadline a client may ask for with `X-Microbatch-Timeout-Ms` "
        "(a generation may hold a worker that long); longer is a 400",
    )
    drain_timeout_s: int = Field(
        default=30,
        gt=0,
        description="how long a stopping gateway lets requests in flight (SSE streams too) "
        "finish before it cuts them; to lose none, at least `max_request_timeout_ms`",
    )
    max_sequences_per_request: int = Field(
        default=256,
        gt=0,
        description="sequences one generation request may start (prompts x `best_of` or "
        "`n`); more is a 400, so one request cannot take a model's whole queue",
    )
    max_tokens_per_request: int = Field(
        default=262_144,
        gt=0,
        description="tokens one generation request may ask for: prompt + `max_tokens`, over "
        "every sequence it starts; more is a 400",
    )
    max_scored_prompt_tokens: int = Field(
        default=8192,
        gt=0,
        description="the longest prompt whose own tokens may be scored (`echo` with "
        "`logprobs`); longer is a 400",
    )
    max_queued_tokens: int = Field(
        default=2_097_152,
        gt=0,
        description="per generation model: prompt + `max_tokens` its backlog may hold; above "
        "it, 503 with `Retry-After`",
    )
    interactive_api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="with `api_keys` set, the keys that may send `X-Microbatch-Priority: "
        "interactive` (others get 403); `*` = every key",
    )
    cold_start_ms: int | None = Field(
        default=None,
        gt=0,
        description="a model with no live worker (it stopped, or scaled to zero) still takes "
        "requests whose deadline allows a worker this long to start, until a worker has "
        "measured its own start; none = refuse them (503) until then",
    )
    max_queue_depth: int = Field(
        default=4096, gt=0, description="per model: above it, 503 with `Retry-After`"
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="request body limit; 413 above it, chunked bodies too",
    )
    max_inputs_per_request: int = Field(
        default=2048, gt=0, description="inputs in one embeddings request"
    )
    max_entry_rows: int = Field(
        default=256,
        gt=0,
        le=MAX_ENTRY_ROWS,
        description=f"rows one queue entry carries (at most {MAX_ENTRY_ROWS}): a request's "
        "inputs of one length bucket travel together, split evenly into entries of at most "
        "this many, so a bulk request costs a few Redis commands and still spreads over "
        "several workers; larger requests are tokenized a block of this many texts at a time, "
        "each block queued as it is ready",
    )
    # A thread hop costs more than tokenizing a short text does.
    inline_tokenize_chars: int = Field(
        default=2048,
        ge=0,
        description="shorter texts are tokenized inline, longer ones on a thread",
    )
    gateway_id: str | None = Field(
        default=None,
        description="reply-stream name; unique per process",
        json_schema_extra={"default_doc": "host + pid"},
    )
    reply_maxlen: int = Field(
        default=10_000,
        gt=0,
        description="workers' safety bound on a reply stream's length (approximate); its "
        "gateway deletes each reply once read, so a stream holds only unread replies",
    )
    processes: int = Field(
        default=1,
        ge=1,
        description="gateway processes on one port (`gateway` and `serve`; SO_REUSEPORT), "
        "each its own event loop and reply stream, "
        "see [operations.md](operations.md#gateway-processes)",
    )
