"""Settings that cannot work together, refused at start with what to change.

Each check is one combination the code would otherwise run wrongly or silently ignore; the
settings object calls `inconsistency` once, after every field is read.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit

GATEWAY_BEAT_MS = 5000  # how often a gateway beats (its reply reader's keep-alive)
MAX_MODEL_ALIASES = 4  # a ModelInfo carries them as a list, at most four on the wire


class Checked(Protocol):
    """The settings these checks read (the settings object, which imports this module),
    read-only, so narrower types (a Literal for a str) still match."""

    @property
    def read_block_ms(self) -> int: ...

    @property
    def redis_socket_timeout_s(self) -> float: ...

    @property
    def redis_cluster(self) -> bool: ...

    @property
    def redis_url(self) -> str | None: ...

    @property
    def quantize(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def served_model_name(self) -> list[str]: ...

    @property
    def max_batch_tokens(self) -> int: ...

    @property
    def buckets(self) -> list[int]: ...

    @property
    def request_timeout_ms(self) -> int: ...

    @property
    def files_store(self) -> str: ...

    @property
    def files_s3_bucket(self) -> str: ...

    @property
    def max_request_timeout_ms(self) -> int: ...

    @property
    def gateway_stale_ms(self) -> int: ...

    @property
    def claim_idle_ms(self) -> int: ...

    @property
    def max_tokens_per_request(self) -> int: ...

    @property
    def max_queued_tokens(self) -> int: ...

    @property
    def engine(self) -> str: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def pipeline_parallel_size(self) -> int: ...


def _check_cluster_url(url: str | None) -> None:
    """A cluster needs a node to start from, and has only database 0."""
    if url is None:
        raise ValueError("redis_cluster needs a redis_url naming any node of the cluster")
    db = urlsplit(url).path.strip("/")
    if db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {db} (redis_url path)")


def inconsistency(s: Checked) -> str | None:
    """The first combination of `s` that cannot work, said as what to change; or None."""
    if s.redis_cluster:
        _check_cluster_url(s.redis_url)
    for broken, message in _rules(s):
        if broken:
            return message
    return None


def _rules(s: Checked) -> list[tuple[bool, str]]:
    """Each combination that cannot work, with what to change."""
    return [
        *_engine_rules(s),
        # redis-py raises TimeoutError when BLOCK outlasts the socket timeout (#2807).
        (
            s.read_block_ms >= s.redis_socket_timeout_s * 1000,
            "read_block_ms must stay below redis_socket_timeout_s",
        ),
        (
            len(s.served_model_name) > 1 + MAX_MODEL_ALIASES,
            f"served_model_name takes at most {1 + MAX_MODEL_ALIASES} names",
        ),
        (
            s.max_batch_tokens < s.buckets[-1],
            "max_batch_tokens must hold at least one entry of the largest bucket",
        ),
        (
            s.files_store == "s3" and not s.files_s3_bucket,
            "files_store s3 needs files_s3_bucket",
        ),
        (
            s.request_timeout_ms > s.max_request_timeout_ms,
            "request_timeout_ms must not exceed max_request_timeout_ms",
        ),
        # a stuck entry would reach a peer only after its client had given up (issue 34)
        (
            s.claim_idle_ms >= s.request_timeout_ms,
            "claim_idle_ms must be below request_timeout_ms",
        ),
        (
            s.max_tokens_per_request > s.max_queued_tokens,
            "max_tokens_per_request must not exceed max_queued_tokens (it could never queue)",
        ),
        (
            s.gateway_stale_ms < GATEWAY_BEAT_MS * 2,
            f"gateway_stale_ms must be at least {GATEWAY_BEAT_MS * 2} (gateways beat every 5 s)",
        ),
    ]


def _engine_rules(s: Checked) -> list[tuple[bool, str]]:
    """The engines' combinations that cannot work: an option no engine would honour."""
    return [
        (s.quantize == "int8" and s.backend != "onnx", "quantize int8 needs backend onnx"),
        # the exported graph is float32: a half-precision ask would be silently ignored
        (
            s.dtype in ("bfloat16", "float16") and s.backend != "torch",
            f"dtype {s.dtype} needs backend torch (onnx runs float32)",
        ),
        # the ONNX runner uses CPUExecutionProvider only: on a GPU, torch serves
        (
            s.backend != "torch" and s.device != "cpu",
            f"backend {s.backend} runs on the CPU; use backend torch",
        ),
        # the paged engine here runs a model on one device: a split would be silently ignored
        (
            s.engine != "vllm" and (s.tensor_parallel_size > 1 or s.pipeline_parallel_size > 1),
            "tensor_parallel_size and pipeline_parallel_size need engine vllm",
        ),
    ]
