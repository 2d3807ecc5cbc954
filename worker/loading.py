"""`load_model`: the model `settings.model` names, loaded as its kind and backend run it.

An encoder becomes an embedding runner (torch, ONNX Runtime, both with `auto`, or `noop`); a
sequence classifier (a cross-encoder) a classifier runner (torch); a causal LM a generation
engine. Blocking: reads files and weights, off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.protocol import ModelKind
from common.settings import Settings
from worker.cores import quota_threads
from worker.encode.runners.base import Runner
from worker.encode.runners.noop import NoopRunner
from worker.encode.runners.torch_runner import TorchRunner
from worker.models import NOOP_MODEL, ModelFiles, describe

if TYPE_CHECKING:
    from worker.generate.engine import GenerationEngine
    from worker.generate.vllm_engine import VllmEngine


@dataclass(frozen=True, slots=True)
class LoadedModel:
    files: ModelFiles
    runner: Runner | GenerationEngine | VllmEngine
    max_tokens: int  # an encoder's limit capped by the largest bucket; a causal LM's context
    kind: ModelKind = ModelKind.EMBEDDING
    dtype: str = "float32"  # what it computes in: `settings.dtype` with `auto` resolved


def load_model(settings: Settings) -> LoadedModel:
    """Blocking: reads files and weights. Call it off the event loop."""
    files = describe(settings.model)
    if files.causal_lm and settings.model != NOOP_MODEL and settings.engine == "vllm":
        from worker.generate.vllm_engine import VllmEngine

        dtype = _dtype(settings, causal_lm=True)
        vllm = VllmEngine.start(settings, files, dtype)
        return LoadedModel(files, vllm, vllm.context, ModelKind.CAUSAL_LM, dtype)
    if files.causal_lm and settings.model != NOOP_MODEL:
        from worker.generate.engine import GenerationEngine

        dtype = _dtype(settings, causal_lm=True)
        engine = GenerationEngine(
            files.path,
            device=settings.device,
            threads=_threads(settings),
            kv_tokens=settings.kv_cache_tokens,
            block_size=settings.kv_block_size,
            prefix_caching=settings.prefix_caching,
            dtype=dtype,
            kv_dtype=settings.kv_cache_dtype,
        )
        return LoadedModel(files, engine, engine.context, ModelKind.CAUSAL_LM, dtype)
    if files.classifier and settings.model != NOOP_MODEL:
        return LoadedModel(
            files,
            classifier_runner(settings, files),
            min(files.max_tokens, settings.max_tokens),
            ModelKind.CLASSIFIER,
            _dtype(settings, causal_lm=False),
        )
    if settings.model == NOOP_MODEL:
        runner: Runner = NoopRunner(settings.noop_dim, settings.noop_compute_ms)
    else:
        runner = encoder_runner(settings, files)
    dtype = "float32" if settings.model == NOOP_MODEL else _dtype(settings, causal_lm=False)
    return LoadedModel(files, runner, min(files.max_tokens, settings.max_tokens), dtype=dtype)


def _dtype(settings: Settings, *, causal_lm: bool) -> str:
    from worker.precision import host_hardware, serving_dtype

    return serving_dtype(
        settings.dtype, causal_lm=causal_lm, device=settings.device, hardware=host_hardware()
    )


def encoder_runner(settings: Settings, files: ModelFiles) -> Runner:
    """The encoder as `settings.backend` runs it: torch, ONNX Runtime, or both (`auto`)."""
    if settings.backend == "torch":
        return _torch_runner(settings, files)
    if settings.backend == "onnx":
        return _onnx_runner(settings, files)
    from worker.encode.parallelism import Parallelism
    from worker.encode.runners.hybrid_runner import Calibration, HybridRunner

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


def classifier_runner(settings: Settings, files: ModelFiles) -> Runner:
    """A classifier runs on torch, as a checked trace where `torchscript` (`auto` only
    chooses speed, never the answer); backend onnx is refused, never silently served as
    something else."""
    if settings.backend == "onnx":
        raise RuntimeError(
            f"{files.name} is a sequence classifier; backend onnx serves embedding models "
            "only: run it with --backend torch"
        )
    from worker.encode.runners.classifier_runner import ClassifierRunner

    return ClassifierRunner(
        files,
        device=settings.device,
        threads=_threads(settings),
        dtype=_dtype(settings, causal_lm=False),
        torchscript=settings.torchscript,
    )


def _threads(settings: Settings) -> int | None:
    """`torch_threads`, or where unset and a container's CPU quota allows fewer threads than
    the cores it sees, that many (see worker.cores); else torch's default."""
    return settings.torch_threads or quota_threads()


def _torch_runner(settings: Settings, files: ModelFiles) -> TorchRunner:
    return TorchRunner(
        files,
        device=settings.device,
        threads=_threads(settings),
        torchscript=settings.torchscript,
        dtype=_dtype(settings, causal_lm=False),
    )


def _onnx_runner(settings: Settings, files: ModelFiles) -> Runner:
    from importlib.util import find_spec
    from pathlib import Path

    from worker.encode.runners.onnx_runner import OnnxRunner

    missing = [m for m in ("onnxruntime", "onnx", "onnxscript") if find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"backend {settings.backend} needs {', '.join(missing)}: "
            "pip install 'microbatch[onnx]', or run with --backend torch"
        )

    cache = Path(settings.onnx_cache_dir).expanduser()
    int8 = settings.quantize == "int8"
    return OnnxRunner(files, cache_dir=cache, threads=_threads(settings), int8=int8)
