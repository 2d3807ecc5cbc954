"""`VllmEngine`: vLLM's async engine (`AsyncLLM`) for one causal LM, sized by the settings.

vLLM brings continuous batching, paged attention, prefix caching and its kernels; microbatch
keeps the rest (`vllm_loop`). Its size follows the same settings as the paged engine:
`kv_cache_tokens` becomes the bytes of KV cache vLLM reserves (left alone, vLLM's CPU backend
takes most of the host's memory), `max_running_seqs` and `max_step_tokens` its scheduler's
limits. Imported only by a worker with `engine vllm`: vLLM is an optional extra.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from common import metrics
from common.settings import Settings
from worker.generate.steps import Picked
from worker.generate.vllm_options import picks
from worker.models import ModelFiles, eos_ids_of

log = logging.getLogger("microbatch.worker")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


class Refused(ValueError):
    """vLLM refused a request's options: answered 400 with its reason."""


def kv_cache_bytes(config: dict, tokens: int, dtype: str) -> int:
    """Bytes of a KV cache holding `tokens` positions of the model `config` describes."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]
    return tokens * per_token


class VllmEngine:
    def __init__(self, llm: Any, context: int, vocab_size: int, eos_ids: set[int]) -> None:
        self._llm = llm
        self.context = context
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    @classmethod
    def start(cls, settings: Settings, files: ModelFiles, dtype: str) -> VllmEngine:
        """Blocking: starts vLLM's engine process and loads the weights there."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM's processes inherit it: they die with this one (worker/generate/vllm_plugin.py)
        os.environ["MICROBATCH_ENGINE"] = "vllm"
        config = json.loads((files.path / "config.json").read_text())
        kv_dtype = dtype if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
        context = int(config["max_position_embeddings"])
        args = AsyncEngineArgs(
            model=str(files.path),
            dtype=dtype,
            kv_cache_dtype=settings.kv_cache_dtype,
            kv_cache_memory_bytes=kv_cache_bytes(config, settings.kv_cache_tokens, kv_dtype),
            max_model_len=context,
            max_num_seqs=settings.max_running_seqs,
            # whole prompts in one step need a step as long as the context
            max_num_batched_tokens=settings.max_step_tokens
            if settings.chunked_prefill
            else max(settings.max_step_tokens, context),
            enable_chunked_prefill=settings.chunked_prefill,
            enable_prefix_caching=settings.prefix_caching,
            tensor_parallel_size=settings.tensor_parallel_size,
            pipeline_parallel_size=settings.pipeline_parallel_size,
            structured_outputs_config={"backend": "guidance"},
            disable_log_stats=False,
        )
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stats_for(settings.served_name)])
        log.info("vLLM engine started: %s in %s, KV %s", files.path, dtype, settings.kv_cache_dtype)
        return cls(llm, context, int(config["vocab_size"]), _eos_ids(files.path, config))

    async def generate(
        self, tokens: list[int], options: dict[str, Any], request_id: str
    ) -> AsyncIterator[tuple[list[Picked], bool]]:
        """Each delta vLLM streams, as the tokens it adds, and whether it was the last.
        Leaving the iteration early (the sequence ended here, or its task was cancelled)
        aborts the request in vLLM. `Refused` when vLLM rejects the options."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        options = dict(options)
        schema = options.pop("structured_json", None)
        k, prompt_k = options["logprobs"], options["prompt_logprobs"]
        try:
            params = SamplingParams(
                **options,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=StructuredOutputsParams(json=schema) if schema else None,
            )
        except (VLLMValidationError, ValueError) as exc:
            raise Refused(str(exc)) from exc
        outputs = self._llm.generate({"prompt_token_ids": tokens}, params, request_id)
        prompt: list[Any] = []  # the prompt's scores, as they come, until its first token
        first = True
        try:
            async for out in outputs:
                if out.prompt_logprobs:
                    prompt.extend(out.prompt_logprobs)
                completion = out.outputs[0]
                if not completion.token_ids and not out.finished:
                    continue
                yield (
                    picks(
                        completion.token_ids,
                        completion.logprobs,
                        -1 if k is None else k,
                        first=first,
                        cached=out.num_cached_tokens or 0,
                        prompt=(tokens, prompt) if first and prompt_k is not None else None,
                        prompt_k=-1 if prompt_k is None else prompt_k,
                    ),
                    out.finished,
                )
                first = False
        except VLLMValidationError as exc:  # raised as the request is added: its options
            raise Refused(str(exc)) from exc
        finally:
            await outputs.aclose()

    def shutdown(self) -> None:
        self._llm.shutdown()


def _eos_ids(path: Any, config: dict) -> set[int]:
    """The model's end-of-sequence ids, as the paged engine reads them: the generation
    config's and the model config's."""
    generation = path / "generation_config.json"
    sources = [json.loads(generation.read_text())] if generation.exists() else []
    return eos_ids_of(source.get("eos_token_id") for source in [*sources, config])


def _stats_for(model: str) -> Any:
    """A vLLM stat logger class that moves its scheduler's figures into microbatch's
    metrics (KV cache use, prefix cache queries and hits, preemptions)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Stats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any) -> None:
            if scheduler_stats is None:
                return
            metrics.kv_cache_usage_ratio.labels(model).set(scheduler_stats.kv_cache_usage)
            cache = scheduler_stats.prefix_cache_stats
            if cache.queries:
                metrics.prefix_cache_queried_tokens_total.labels(model).inc(cache.queries)
            if cache.hits:
                metrics.prefix_cache_hit_tokens_total.labels(model).inc(cache.hits)
            preempted = getattr(iteration_stats, "num_preempted_reqs", 0) or 0
            if preempted:
                metrics.preemptions_total.labels(model).inc(preempted)

        def log_engine_initialized(self) -> None:
            pass

    return Stats
