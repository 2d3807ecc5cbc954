"""The one settings object: every CLI option and `MICROBATCH_<NAME>` variable, validated once."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from common.message_checks import MAX_ENTRY_ROWS

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def _split_commas(value: object) -> object:
    """Accept `128,256,512` from the environment or the CLI as well as a real list."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _check_cluster_url(url: str | None) -> None:
    """A cluster needs a node to start from, and has only database 0."""
    if url is None:
        raise ValueError("redis_cluster needs a redis_url naming any node of the cluster")
    db = urlsplit(url).path.strip("/")
    if db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {db} (redis_url path)")


MAX_MODEL_ALIASES = 4  # a ModelInfo carries them as a list, at most four on the wire


class Settings(BaseSettings):
    """Built once at start-up and passed down; nothing else reads the environment."""

    model_config = SettingsConfigDict(env_prefix="MICROBATCH_", frozen=True, extra="forbid")

    # Where the streams live: None runs the embedded in-process store (serve only).
    redis_url: str | None = None
    # redis_url names any node of a Redis Cluster; every key of a model shares one hash slot.
    redis_cluster: bool = False
    prefix: str = "mb"
    redis_socket_timeout_s: float = 5.0

    # Gateway
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    rate_limit_per_key: float = Field(default=0.0, ge=0)  # requests/s per API key; 0 = off
    rate_limit_burst: int = Field(default=20, gt=0)
    request_timeout_ms: int = Field(default=30_000, gt=0)
    max_queue_depth: int = Field(default=4096, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    max_inputs_per_request: int = Field(default=2048, gt=0)
    # Rows one queue entry carries: a request's rows of one bucket travel in entries of at
    # most this many, so a bulk request costs a few Redis commands and still spreads over
    # several workers' batches.
    max_entry_rows: int = Field(default=256, gt=0, le=MAX_ENTRY_ROWS)
    # Texts shorter than this are tokenized inline: a thread hop costs more than they do.
    inline_tokenize_chars: int = Field(default=2048, ge=0)
    gateway_id: str | None = None
    reply_maxlen: int = Field(default=10_000, gt=0)
    # Gateway processes on one port (SO_REUSEPORT), each its own event loop and reply stream.
    processes: int = Field(default=1, ge=1)

    # Worker
    model: str = DEFAULT_MODEL
    # The names clients use for `model` (the first registers it, the rest are aliases, at
    # most MAX_MODEL_ALIASES); empty: the `model` value itself, a folder path included.
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list)
    buckets: Annotated[list[int], NoDecode] = Field(default_factory=lambda: [128, 256, 512])
    max_batch_size: int = Field(default=16, gt=0)
    max_batch_tokens: int = Field(default=16_384, gt=0)
    # A number of ms, or "auto": wait only while waiting raises throughput (see batching.py).
    max_wait_ms: float | Literal["auto"] = "auto"
    latency_slo_ms: float = Field(default=100.0, gt=0)  # auto waits at most a quarter of it
    max_padding_ratio: float = Field(default=0.5, gt=0, le=1)  # before a cost model is fitted
    starvation_ms: float = Field(default=500.0, gt=0)  # batch traffic passed over this long
    sort_window: int = Field(default=64, gt=0)  # at most held to sort by length (embed/window.py)
    claim_idle_ms: int = Field(default=30_000, gt=0)
    max_batch_ms: int = Field(default=120_000, gt=0)  # longer and the worker counts as hung
    max_deliveries: int = Field(default=3, gt=0)
    read_block_ms: int = Field(default=1000, gt=0)
    heartbeat_interval_ms: int = Field(default=1000, gt=0)
    worker_stale_ms: int = Field(default=5000, gt=0)
    worker_id: str | None = None
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # worker's /metrics
    # Where a worker writes PyTorch profiler traces of a few batches (worker/profiling.py).
    profile_dir: str | None = None
    # Embedding batches computing at once, each on its share of the cores ("auto": one per
    # core up to 4 cores, else one per 4; 1 on a GPU, with ONNX, for generation and noop).
    compute_streams: int | Literal["auto"] = "auto"
    # Threads per batch; None: the cores split over the streams, and a lone batch with
    # nothing else queued gets them all. A number fixes it for every batch.
    torch_threads: int | None = Field(default=None, gt=0)
    device: str = "cpu"
    # Encoder execution: torch, or ONNX Runtime on a graph exported once into onnx_cache_dir,
    # or auto: both loaded, each bucket on the one that ran its shapes faster at load.
    backend: Literal["torch", "onnx", "auto"] = "torch"
    # torch backend: run the encoder as a TorchScript trace (the whole forward in C++, free
    # of the GIL), checked against eager at load; eager where tracing fails or disagrees.
    torchscript: bool = True
    # Weights and compute of encoders and classifiers (torch backend). float32 answers exactly
    # as transformers does; bfloat16 halves the weights and, on a GPU or a CPU with AMX, runs
    # several times faster, with answers within about 1e-2: the operator's choice, never ours.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    onnx_cache_dir: str = "~/.cache/microbatch/onnx"
    # int8 dynamic quantisation of the exported graph's weights (onnx backend; torch's own
    # is deprecated): faster on CPU, slightly less exact; the test suite bounds the loss.
    quantize: Literal["none", "int8"] = "none"
    # Generation (causal LMs): continuous batching limits
    max_running_seqs: int = Field(default=32, gt=0)  # sequences decoding together
    # Prefill + decode tokens in one step: a CPU prefills a few hundred tokens a second, so
    # a larger step stalls every running sequence for seconds.
    max_step_tokens: int = Field(default=512, gt=0)
    kv_cache_tokens: int = Field(default=32_768, gt=0)  # the paged KV pool, in positions
    kv_block_size: int = Field(default=16, gt=0)  # positions per KV cache block
    prefix_caching: bool = True  # keep full blocks named by their prefix for reuse
    chunked_prefill: bool = True  # long prompts prefill over several steps, beside decodes
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e4m3"] = "auto"  # auto: the model's
    # Generation: gateways send a prompt to the worker caching its prefix (its own stream)
    # unless it holds more than `affinity_max_imbalance` sequences over the least loaded
    cache_aware_routing: bool = True
    affinity_max_imbalance: int = Field(default=4, ge=0)
    cancel_poll_ms: int = Field(default=100, gt=0)  # how often workers look for cancellations
    # Embedding models: serve `dimensions` (matryoshka: the first d dimensions, renormalized)
    # below the model's own; None: only where its config.json declares matryoshka training
    # (`matryoshka_dimensions` or `is_matryoshka`). A model not trained so gives poor vectors.
    matryoshka: bool | None = None
    # The sentence-transformers prompt (config_sentence_transformers.json `prompts`) put before
    # every input that names none; None: the model's own `default_prompt_name`, if any.
    default_prompt_name: str | None = None
    noop_dim: int = Field(default=384, gt=0)
    noop_compute_ms: float = Field(default=0.0, ge=0)  # simulated time per batch, noop model
    # Fault-test seams of the noop model: a row with this token fails; a batch with it crashes.
    noop_fail_token: int | None = None
    noop_crash_token: int | None = None

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "text"] = "auto"  # auto: text on a terminal, else JSON

    @field_validator("buckets", "api_keys", "served_model_name", mode="before")
    @classmethod
    def _parse_lists(cls, value: object) -> object:
        return _split_commas(value)

    @field_validator("max_wait_ms", "compute_streams")
    @classmethod
    def _auto_or_at_least(cls, value: float | str, info: ValidationInfo) -> float | str:
        name = str(info.field_name)
        least = {"max_wait_ms": 0, "compute_streams": 1}[name]
        if not isinstance(value, str) and value < least:
            raise ValueError(f"{name} must be >= {least} or 'auto'")
        return value

    @field_validator("buckets")
    @classmethod
    def _buckets_ascending(cls, value: list[int]) -> list[int]:
        if not value or any(b <= 0 for b in value) or sorted(set(value)) != value:
            raise ValueError("buckets must be positive token lengths in strictly ascending order")
        return value

    @model_validator(mode="after")
    def _limits_consistent(self) -> Settings:
        if self.read_block_ms >= self.redis_socket_timeout_s * 1000:
            # redis-py raises TimeoutError when BLOCK outlasts the socket timeout (#2807).
            raise ValueError("read_block_ms must stay below redis_socket_timeout_s")
        if self.redis_cluster:
            _check_cluster_url(self.redis_url)
        if self.quantize == "int8" and self.backend != "onnx":
            raise ValueError("quantize int8 needs backend onnx")
        if self.dtype != "float32" and self.backend != "torch":
            # the exported graph is float32: a half-precision ask would be silently ignored
            raise ValueError(f"dtype {self.dtype} needs backend torch (onnx runs float32)")
        if self.backend != "torch" and self.device != "cpu":
            # the ONNX runner uses CPUExecutionProvider only: on a GPU, torch serves
            raise ValueError(f"backend {self.backend} runs on the CPU; use backend torch")
        if len(self.served_model_name) > 1 + MAX_MODEL_ALIASES:
            raise ValueError(f"served_model_name takes at most {1 + MAX_MODEL_ALIASES} names")
        if self.max_batch_tokens < self.buckets[-1]:
            raise ValueError("max_batch_tokens must hold at least one entry of the largest bucket")
        return self

    @property
    def served_name(self) -> str:
        """The name the worker registers its model under, and the gateway's default model."""
        return self.served_model_name[0] if self.served_model_name else self.model

    @property
    def max_tokens(self) -> int:
        """The longest input any worker accepts: the largest bucket."""
        return self.buckets[-1]

    @property
    def redis_url_redacted(self) -> str:
        """The Redis URL with any password masked, for messages and logs."""
        if self.redis_url is None:
            return "embedded"
        parts = urlsplit(self.redis_url)
        if parts.password is None:
            return self.redis_url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def process_id(self, role: str) -> str:
        """A name unique per process and host: consumer names and reply streams hang on it."""
        explicit = self.gateway_id if role == "gateway" else self.worker_id
        return explicit or f"{socket.gethostname()}-{os.getpid()}"
