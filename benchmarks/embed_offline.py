"""Offline arms: the model alone, in this process, through the worker's own runner (`--backend`).

No HTTP, no queue, no waiting: what the hardware allows for a batching plan. Each plan is a
list of batches (indices into the workload); a batch is padded to its own longest member,
exactly as `worker.encode.collate` pads. Timed with `perf_counter` around each forward.

- limit: the whole workload sorted by length, cut into batches of at most `max_size` texts,
  `max_tokens` padded tokens and `max_ratio` padded/real tokens. No server can beat this
  with the same model code.
- ceiling: what a server could do with only `window` requests in flight: each arrival window
  sorted and split so that no batch pads past `max_ratio` padded/real tokens.
- single: one text per forward; each text's own compute time, the reference for latency.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from benchmarks.embed_workload import MODEL_NAME, Workload
from worker.compute_threads import ComputeThreads
from worker.encode.parallelism import Parallelism, usable_cores
from worker.encode.runners.base import Runner

Plan = list[list[int]]  # batches of workload indices


@dataclass(frozen=True, slots=True)
class OfflineRun:
    figures: dict  # texts_per_s, padded_per_real, mean_batch_size, ...
    batch_seconds: list[float]  # per batch, in plan order


@dataclass(frozen=True, slots=True)
class Loaded:
    runner: Runner
    compute: ComputeThreads  # the worker's own thread discipline: see compute_threads


def load_runner(backend: str = "torch", device: str = "cpu", dtype: str = "float32") -> Loaded:
    """The default model as a worker with `backend` on `device` in `dtype` loads it (on its
    stream-0 thread), so the offline arms and the servers compute with the same engine."""
    from common.settings import Settings
    from worker.loading import encoder_runner
    from worker.models import describe

    compute = ComputeThreads()
    compute.ensure(worker_parallelism(device).streams)
    files = describe(MODEL_NAME)
    make = partial(encoder_runner, Settings(backend=backend, device=device, dtype=dtype), files)
    return Loaded(compute.first.submit(make).result(), compute)


def worker_parallelism(device: str = "cpu") -> Parallelism:
    """What a worker with default settings on `device` chooses on this machine (one stream
    on a GPU)."""
    from common.settings import Settings

    return Parallelism.from_settings(Settings(device=device), concurrent_ok=True)


def _cut(order: Sequence[int], fits: Callable[[list[int]], bool]) -> Plan:
    """Greedy cut of `order` into batches; `fits(batch + [i])` decides whether `i` joins."""
    plan: Plan = []
    batch: list[int] = []
    for i in order:
        if batch and not fits([*batch, i]):
            plan.append(batch)
            batch = []
        batch.append(i)
    if batch:
        plan.append(batch)
    return plan


def padded(batch: Sequence[int], tokens: Sequence[int]) -> int:
    return len(batch) * max(tokens[i] for i in batch)


def _fits(
    tokens: Sequence[int], max_ratio: float, max_size: int, max_tokens: int
) -> Callable[[list[int]], bool]:
    """Whether a batch stays within size, padded-token and padding-ratio limits."""

    def fits(b: list[int]) -> bool:
        pad = padded(b, tokens)
        real = sum(tokens[i] for i in b)
        return len(b) <= max_size and pad <= max_tokens and pad <= max_ratio * real

    return fits


def limit_plan(tokens: Sequence[int], max_ratio: float, max_size: int, max_tokens: int) -> Plan:
    """The whole workload sorted by length, in batches within the worker's size/token limits.

    Batches are also cut where padding would pass `max_ratio`: on a CPU a batch of 16 that
    pads a 60-token text to 200 costs more than two smaller ones, and a limit that a
    window of 32 could beat would be no limit.
    """
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    return _cut(order, _fits(tokens, max_ratio, max_size, max_tokens))


def ceiling_plan(
    tokens: Sequence[int], window: int, max_ratio: float, max_size: int, max_tokens: int
) -> Plan:
    """Each arrival window of `window` sorted and split so padded/real ≤ `max_ratio`."""
    fits = _fits(tokens, max_ratio, max_size, max_tokens)
    plan: Plan = []
    for start in range(0, len(tokens), window):
        arrived = range(start, min(start + window, len(tokens)))
        plan += _cut(sorted(arrived, key=lambda i: tokens[i]), fits)
    return plan


def single_plan(tokens: Sequence[int]) -> Plan:
    return [[i] for i in range(len(tokens))]


def run_plan(
    loaded: Loaded,
    workload: Workload,
    plan: Plan,
    parallel: Parallelism | None = None,
    warm_passes: int = 0,
) -> OfflineRun:
    """Time every batch of the plan once, after one untimed warm-up forward of its largest
    and `warm_passes` untimed passes over the whole plan (a GPU compiles and tunes kernels
    per shape on first sight: timed cold, the limit would count that).

    With `parallel` (the worker's own choice for this machine), batches run as the worker
    runs them under load: `streams` at once, each on `threads_per_stream` threads, on the
    worker's threads; without it, one at a time on every core on stream 0, as a lone batch.
    """
    rows = workload.token_ids
    tokens = workload.tokens
    parallel = parallel or Parallelism(usable_cores(), 1, usable_cores(), adaptive=False)
    threads = parallel.threads_per_stream
    # Longest first, so that no stream idles at the end while another runs a long batch
    # (the order is free offline; with one stream it changes nothing).
    order = sorted(range(len(plan)), key=lambda k: padded(plan[k], tokens), reverse=True)
    seconds = [0.0] * len(plan)
    pending: list[int] = []
    lock = threading.Lock()

    def lane() -> None:
        while True:
            with lock:
                if not pending:
                    return
                k = pending.pop()
            started = time.perf_counter()
            loaded.runner.embed([rows[i] for i in plan[k]], threads=threads)
            seconds[k] = time.perf_counter() - started

    def warm() -> None:
        loaded.runner.embed([rows[i] for i in plan[order[0]]], threads=threads)

    streams = range(parallel.streams)
    for f in [loaded.compute.submit(s, warm) for s in streams]:
        f.result()
    for _ in range(warm_passes + 1):  # the last pass is the timed one
        pending[:] = reversed(order)
        started = time.perf_counter()
        for f in [loaded.compute.submit(s, lane) for s in streams]:
            f.result()
    elapsed = time.perf_counter() - started
    texts = sum(len(b) for b in plan)
    real = sum(tokens[i] for b in plan for i in b)
    return OfflineRun(
        figures={
            "texts": texts,
            "texts_per_s": texts / elapsed,
            "padded_per_real": sum(padded(b, tokens) for b in plan) / real,
            "mean_batch_size": texts / len(plan),
            "compute_s": elapsed,
            "batch_ms_p50": statistics.median(seconds) * 1000,
            "streams": parallel.streams,
            "threads_per_stream": threads,
            "warm_passes": warm_passes,
        },
        batch_seconds=seconds,
    )
