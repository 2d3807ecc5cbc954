"""`run_worker`: load the model, register it, consume until told to stop, drain, return.

The worker's composition root: it builds the intake, the loop for the model's kind (embedding
or generation) and the consumer that runs them, and nothing imports it but the CLI.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable

from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from common import gc_tuning, streams
from common.backoff import Backoff, until_ok
from common.clock import process_age_s
from common.protocol import ModelInfo, ModelKind, encode
from common.settings import Settings
from common.store import Store, check_access, close_store, open_store
from worker.compute_threads import ComputeThreads
from worker.consumer import Consumer, RunningLoop, compose
from worker.loading import LoadedModel, load_model
from worker.profiling import BatchProfiler
from worker.triage import EntryLimits
from worker.wiring import Wiring

log = logging.getLogger("microbatch.worker")

# A compute thread gives up the GIL during every torch operator and needs it back after:
# with Python's default 5 ms switch interval, an event loop busy with requests (the gateway,
# in `serve`) keeps it that long each time. Measured in `serve` on 2 cores, 32 clients,
# short texts: a batch computed ~1.5x faster at 0.1 ms than at 5 ms (or 1 ms).
GIL_SWITCH_INTERVAL_S = 0.0001


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("microbatch")
    except PackageNotFoundError:
        return "unknown"


async def register(store: Store, settings: Settings, model: LoadedModel) -> None:
    info = ModelInfo(
        name=settings.served_name,
        kind=str(model.kind),
        dim=model.files.dim if model.kind == ModelKind.CAUSAL_LM else model.runner.dim,
        max_tokens=model.max_tokens,
        vocab_size=model.files.vocab_size,
        tokenizer_sha256=model.files.tokenizer_sha256,
        chat_template=model.files.chat_template,
        bos_token=model.files.bos_token,
        eos_token=model.files.eos_token,
        aliases=settings.served_model_name[1:],
        fingerprint=model.files.fingerprint(
            f"microbatch {_version()} {settings.backend} {model.dtype}"
        ),
        labels=list(model.files.labels) if model.kind == ModelKind.CLASSIFIER else [],
        activation=model.files.activation if model.kind == ModelKind.CLASSIFIER else "",
        **embedding_options(settings, model),
    )
    await streams.register_model(
        store,
        streams.Keys(settings.prefix),
        settings.served_name,
        encode(info),
        model.files.tokenizer_sha256,
        model.files.tokenizer_json,
    )


def embedding_options(settings: Settings, model: LoadedModel) -> dict:
    """What an embedding model lets a request choose: dimensions, normalization, prompts."""
    if model.kind != ModelKind.EMBEDDING:
        return {}
    files = model.files
    prompts = dict(files.prompts)
    default = (
        files.default_prompt_name
        if settings.default_prompt_name is None
        else settings.default_prompt_name
    )
    if default and default not in prompts:
        raise ValueError(
            f"default_prompt_name {default!r} is not among the model's prompts {sorted(prompts)}"
        )
    matryoshka = files.matryoshka if settings.matryoshka is None else settings.matryoshka
    return {
        "normalized": files.pooling.normalize,
        "matryoshka": matryoshka,
        "matryoshka_dims": list(files.matryoshka_dims) if matryoshka else [],
        "prompts": prompts,
        "default_prompt": default,
    }


def build_consumer(
    settings: Settings,
    store: Store,
    model: LoadedModel,
    compute: ComputeThreads,
    tracer: Tracer | None = None,
) -> Consumer:
    """The worker's parts around the loop for the model's kind, composed."""
    limits = EntryLimits(
        model=settings.served_name,
        max_tokens=model.max_tokens,
        vocab_size=model.files.vocab_size,
        max_deliveries=settings.max_deliveries,
        generates=model.kind == ModelKind.CAUSAL_LM,
    )
    name = settings.process_id("worker")
    profiler = batch_profiler(settings, name)
    make_loop: Callable[[Wiring], RunningLoop]
    if model.kind == ModelKind.CAUSAL_LM:
        from tokenizers import Tokenizer

        from worker.generate.loop import GenerationLoop

        tokenizer = Tokenizer.from_str(model.files.tokenizer_json)
        engine = model.runner

        def make_loop(wiring: Wiring) -> RunningLoop:
            if settings.engine == "vllm":
                from worker.generate.vllm_loop import VllmLoop

                return VllmLoop(settings, wiring, engine, tokenizer)  # type: ignore[arg-type]
            return GenerationLoop(
                settings,
                wiring,
                engine,  # type: ignore[arg-type]
                tokenizer,
                compute,
                profiler=profiler,  # type: ignore[arg-type]
            )
    else:
        from worker.encode.loop import EmbedLoop

        def make_loop(wiring: Wiring) -> RunningLoop:
            return EmbedLoop(settings, wiring, model.runner, compute, profiler=profiler)  # type: ignore[arg-type]

    registering = functools.partial(register, store, settings, model)
    return compose(settings, store, limits, name, make_loop, registering, compute, tracer=tracer)


def batch_profiler(settings: Settings, name: str) -> BatchProfiler | None:
    """Where `profile_dir` is set, what traces this worker's first batches after a warm-up."""
    if settings.profile_dir is None:
        return None
    log.info("profiling a few batches into %s", settings.profile_dir)
    return BatchProfiler(settings.profile_dir, name, device=settings.device)


async def _record_cold_start(store: Store, settings: Settings) -> None:
    """How long this worker took from its process's start to serving: what a gateway lets a
    request to a model with no live worker wait for (scale from zero)."""
    started_ms = round(process_age_s() * 1000)
    try:
        keys = streams.Keys(settings.prefix)
        await streams.record_cold_start(store, keys, settings.served_name, started_ms)
    except RedisError as exc:  # the next start measures again; serving matters more
        log.warning("could not record this worker's cold start (%d ms): %s", started_ms, exc)
    else:
        log.info("worker ready %d ms after its process started", started_ms)


async def run_worker(
    settings: Settings,
    stop: asyncio.Event,
    store: Store | None = None,
    load: Callable[[Settings], LoadedModel] = load_model,
    tracer: Tracer | None = None,
) -> None:
    """Serve `settings.model` until `stop` is set; then finish what it holds and return.
    `load` makes the model: the real loader, or a test's scripted one (a fault seam kept
    out of the settings, so no deployment can switch it on); `tracer` traces each entry
    and batch (None: off)."""
    own_store = store is None
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    store = open_store(settings) if store is None else store
    try:
        await check_access(store)
        # loaded on the thread that runs batches on every core (see compute_threads)
        compute = ComputeThreads()
        model = await asyncio.wrap_future(compute.first.submit(load, settings))
        consumer = build_consumer(settings, store, model, compute, tracer)
        gc_tuning.freeze_startup_heap()  # the model's Python objects leave every later scan
        # Only an outage is worth retrying; a configuration error (a `default_prompt_name`
        # the model lacks) raises at once, so the process exits with its message.
        await until_ok(
            lambda: register(store, settings, model),
            stop,
            log,
            f"registering {settings.served_name}",
            backoff=Backoff(first_s=0.5, cap_s=0.5),
        )
        await _record_cold_start(store, settings)
        log.info(
            "worker %s serving %s as %s in %s",
            *(consumer.name, settings.model, settings.served_name, model.dtype),
        )
        await consumer.run(stop)
        if consumer.crashed is not None:
            raise RuntimeError("a worker task failed (logged above); exiting for a restart")
        log.info("worker %s drained after %d batches", consumer.name, consumer.loop.batches_run)
    finally:
        if own_store:
            await close_store(store)
