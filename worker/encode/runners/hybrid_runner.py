"""`HybridRunner` (`--backend auto`): torch and ONNX Runtime both loaded, each length bucket
served by the engine that ran its shapes faster when the worker started.

Neither engine wins everywhere. Here, ONNX Runtime's fixed cost per forward is well below
torch's, so it wins short texts and small batches (a lone 30-token text: 10.5 ms against
16-18 on two threads), while torch's TorchScript trace wins long texts (a lone 300-token
one: 82-84 ms against 98). Where the line falls depends on the CPU and the model, so it is
measured at load, not assumed: every bucket is timed on both engines at the middle of its
lengths, on a lone text (on the threads a lone batch gets) and on a small batch (on one
stream's threads), and the engine with the lower product of the two keeps the bucket
(torch, unless the other clearly wins). A batch's longest member names its bucket, and so
its engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.buckets import bucket_for
from worker.encode.runners.base import RowResult, Runner, example_rows

log = logging.getLogger("microbatch.worker")

ENGINES = ("torch", "onnx")  # the first is the default: another must clearly beat it
CLEAR_WIN = 0.9  # another engine's score must be below this share of the default's
CALIBRATION_BATCH = 2  # rows in the small-batch shape
CALIBRATION_REPEATS = 3  # the fastest of these counts: a busy host only slows a run down


def faster_engines(seconds: Mapping[tuple[str, int], tuple[float, float]]) -> dict[int, str]:
    """Per bucket, the engine with the lowest product of its (lone, batch) times, so that a
    lone text's speed counts as much as a batch's although the batch takes longer. Timings
    on a shared host are noisy: another engine replaces torch (which needs no export) only
    when its product is below `CLEAR_WIN` of torch's."""
    default, *others = ENGINES
    buckets = sorted({bucket for _, bucket in seconds})

    def score(engine: str, bucket: int) -> float:
        lone, batch = seconds[(engine, bucket)]
        return lone * batch

    choice = {}
    for b in buckets:
        best = min(others, key=lambda e: score(e, b))
        choice[b] = best if score(best, b) < CLEAR_WIN * score(default, b) else default
    return choice


def calibration_length(bucket: int, buckets: Sequence[int], max_tokens: int) -> int:
    """The middle of the lengths the bucket holds (above the next smaller bucket), within the
    model's limit."""
    smaller = [b for b in buckets if b < bucket]
    shortest = (max(smaller) + 1) if smaller else 1
    return max(1, min((shortest + bucket) // 2, max_tokens))


@dataclass(frozen=True, slots=True)
class Calibration:
    """What the engines are timed on: the worker's buckets and model, and its threads."""

    buckets: Sequence[int]
    vocab_size: int
    max_tokens: int
    lone_threads: int | None  # a lone batch's (every core, where adaptive)
    batch_threads: int | None  # one stream's


def time_engines(
    engines: Mapping[str, Runner],
    at: Calibration,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[tuple[str, int], tuple[float, float]]:
    """(lone text, small batch) seconds per (engine, bucket)."""
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for bucket in at.buckets:
        length = calibration_length(bucket, at.buckets, at.max_tokens)
        lone = _fastest(engines, example_rows([length], 0, at.vocab_size), at.lone_threads, clock)
        rows = example_rows([length] * CALIBRATION_BATCH, 0, at.vocab_size)
        batch = _fastest(engines, rows, at.batch_threads, clock)
        out.update({(name, bucket): (lone[name], batch[name]) for name in engines})
    return out


def _fastest(
    engines: Mapping[str, Runner],
    rows: list[np.ndarray],
    threads: int | None,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Each engine's fastest run on `rows`: after a warm-up run each, the engines take turns,
    so a moment of load slows both."""
    for engine in engines.values():
        engine.embed(rows, threads=threads)  # warm: first shapes allocate
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(CALIBRATION_REPEATS):
        for name, engine in engines.items():
            started = clock()
            engine.embed(rows, threads=threads)
            best[name] = min(best[name], clock() - started)
    return best


def describe_choice(
    seconds: Mapping[tuple[str, int], tuple[float, float]],
    choice: Mapping[int, str],
    engines: Sequence[str],
) -> str:
    """The choice per bucket with every engine's (lone, batch) times, for the log."""

    def times(name: str, bucket: int) -> str:
        lone, batch = seconds[(name, bucket)]
        return f"{name} {lone * 1000:.1f}/{batch * 1000:.1f}"

    return ", ".join(
        f"bucket {b}: {e} (lone/batch ms: {', '.join(times(n, b) for n in engines)})"
        for b, e in choice.items()
    )


class HybridRunner:
    """Routes each batch to its bucket's engine; both engines stay loaded (twice the memory
    of either: about 90 MB of weights each for MiniLM, plus one ONNX session per thread
    count)."""

    concurrent = True

    def __init__(
        self, engines: Mapping[str, Runner], buckets: Sequence[int], choice: Mapping[int, str]
    ) -> None:
        missing = [b for b in buckets if choice.get(b) not in engines]
        if missing:
            raise ValueError(f"no engine chosen for bucket(s) {missing}")
        self._engines = dict(engines)
        self._buckets = sorted(buckets)
        self.choice = {b: choice[b] for b in self._buckets}
        self.dim = next(iter(self._engines.values())).dim

    @classmethod
    def calibrated(cls, engines: Mapping[str, Runner], at: Calibration) -> HybridRunner:
        started = time.perf_counter()
        seconds = time_engines(engines, at)
        choice = faster_engines(seconds)
        log.info(
            "backend auto, timed in %.1f s: %s",
            time.perf_counter() - started,
            describe_choice(seconds, choice, list(engines)),
        )
        return cls(engines, at.buckets, choice)

    def engine_for(self, longest: int) -> str:
        bucket = bucket_for(longest, self._buckets) or self._buckets[-1]
        return self.choice[bucket]

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        if not rows:
            return []
        engine = self._engines[self.engine_for(max(len(r) for r in rows))]
        return engine.embed(rows, threads=threads)
