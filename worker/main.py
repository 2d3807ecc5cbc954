"""`run_worker`: load the model, register it, consume until told to stop, drain, return."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import streams
from common.protocol import ModelInfo, encode
from common.settings import Settings
from common.store import Store, check_access, close_store, open_store
from worker.compute_threads import ComputeThreads
from worker.consume import Consumer
from worker.models import NOOP_MODEL, ModelFiles, describe
from worker.recovery import EntryLimits
from worker.runner import NoopRunner, Runner, TorchRunner

if TYPE_CHECKING:
    from worker.engine import GenerationEngine

log = logging.getLogger("microbatch.worker")

# A compute thread gives up the GIL during every torch operator and needs it back after:
# with Python's default 5 ms switch interval, an event loop busy with requests (the gateway,
# in `serve`) keeps it that long each time. Measured in `serve` on 2 cores, 32 clients,
# short texts: a batch computed ~1.5x faster at 0.1 ms than at 5 ms (or 1 ms).
GIL_SWITCH_INTERVAL_S = 0.0001


@dataclass(frozen=True, slots=True)
class LoadedModel:
    files: ModelFiles
    runner: Runner | GenerationEngine
    max_tokens: int  # an encoder's limit capped by the largest bucket; a causal LM's context
    kind: str = "embedding"  # or "causal-lm"


def load_model(settings: Settings) -> LoadedModel:
    """Blocking: reads files and weights. Call it off the event loop."""
    files = describe(settings.model)
    if files.causal_lm and settings.model != NOOP_MODEL:
        from worker.engine import GenerationEngine

        engine = GenerationEngine(
            files.path, device=settings.device, threads=settings.torch_threads
        )
        return LoadedModel(files, engine, engine.context, "causal-lm")
    if settings.model == NOOP_MODEL:
        runner: Runner = NoopRunner(
            settings.noop_dim,
            settings.noop_compute_ms,
            settings.noop_fail_token,
            settings.noop_crash_token,
        )
    else:
        runner = encoder_runner(settings, files)
    return LoadedModel(files, runner, min(files.max_tokens, settings.max_tokens))


def encoder_runner(settings: Settings, files: ModelFiles) -> Runner:
    """The encoder as `settings.backend` runs it: torch, ONNX Runtime, or both (`auto`)."""
    if settings.backend == "torch":
        return _torch_runner(settings, files)
    if settings.backend == "onnx":
        return _onnx_runner(settings, files)
    from worker.hybrid_runner import Calibration, HybridRunner
    from worker.parallelism import Parallelism

    parallel = Parallelism.from_settings(settings, concurrent_ok=HybridRunner.concurrent)
    at = Calibration(
        settings.buckets,
        files.vocab_size,
        files.max_tokens,
        lone_threads=parallel.threads_for([], more_held=False),
        batch_threads=parallel.threads_per_stream,
    )
    engines = {"torch": _torch_runner(settings, files), "onnx": _onnx_runner(settings, files)}
    return HybridRunner.calibrated(engines, at)


def _torch_runner(settings: Settings, files: ModelFiles) -> TorchRunner:
    return TorchRunner(
        files,
        device=settings.device,
        threads=settings.torch_threads,
        torchscript=settings.torchscript,
    )


def _onnx_runner(settings: Settings, files: ModelFiles) -> Runner:
    from importlib.util import find_spec
    from pathlib import Path

    from worker.onnx_runner import OnnxRunner

    missing = [m for m in ("onnxruntime", "onnx", "onnxscript") if find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"backend {settings.backend} needs {', '.join(missing)}: "
            "pip install 'microbatch[onnx]', or run with --backend torch"
        )

    cache = Path(settings.onnx_cache_dir).expanduser()
    int8 = settings.quantize == "int8"
    return OnnxRunner(files, cache_dir=cache, threads=settings.torch_threads, int8=int8)


async def register(store: Store, settings: Settings, model: LoadedModel) -> None:
    info = ModelInfo(
        name=settings.model,
        kind=model.kind,
        dim=model.files.dim if model.kind == "causal-lm" else model.runner.dim,
        max_tokens=model.max_tokens,
        vocab_size=model.files.vocab_size,
        tokenizer_sha256=model.files.tokenizer_sha256,
        chat_template=model.files.chat_template,
        bos_token=model.files.bos_token,
        eos_token=model.files.eos_token,
    )
    await streams.register_model(
        store,
        streams.Keys(settings.prefix),
        settings.model,
        encode(info),
        model.files.tokenizer_sha256,
        model.files.tokenizer_json,
    )


async def run_worker(settings: Settings, stop: asyncio.Event, store: Store | None = None) -> None:
    """Serve `settings.model` until `stop` is set; then finish what it holds and return."""
    own_store = store is None
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    store = open_store(settings) if store is None else store
    try:
        await check_access(store)
        # loaded on the thread that runs batches on every core (see compute_threads)
        compute = ComputeThreads()
        model = await asyncio.wrap_future(compute.first.submit(load_model, settings))
        limits = EntryLimits(
            model=settings.model,
            max_tokens=model.max_tokens,
            vocab_size=model.files.vocab_size,
            max_deliveries=settings.max_deliveries,
            generates=model.kind == "causal-lm",
        )
        name = settings.process_id("worker")
        again = lambda: register(store, settings, model)  # noqa: E731
        consumer: Consumer
        if model.kind == "causal-lm":
            from tokenizers import Tokenizer

            from worker.generation_loop import GenerationConsumer

            tokenizer = Tokenizer.from_str(model.files.tokenizer_json)
            consumer = GenerationConsumer(
                settings, store, model.runner, tokenizer, limits, name, again, compute
            )
        else:
            consumer = Consumer(settings, store, model.runner, limits, name, again, compute=compute)
        while not stop.is_set():
            try:
                await register(store, settings, model)
                break
            except Exception as exc:  # Redis not up yet: keep trying until stopped
                log.warning("registering %s failed (%s); retrying", settings.model, exc)
                await asyncio.sleep(0.5)
        log.info("worker %s serving %s", consumer.name, settings.model)
        await consumer.run(stop)
        if consumer.crashed:
            raise RuntimeError("a worker loop failed (logged above); exiting for a restart")
        log.info("worker %s drained after %d batches", consumer.name, consumer.batches_run)
    finally:
        if own_store:
            await close_store(store)
