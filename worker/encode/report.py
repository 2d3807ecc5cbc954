"""`BatchReport`: what a finished batch tells the outside: its bucket's metrics, a debug line
and, traced, its span linked to its entries'. The loop's own learning from it (the cost
model, the compute rate) stays in the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.encode.assembly import BatchFacts
from worker.encode.batching import Batch
from worker.encode.metrics import BatchMetrics, computed_tokens
from worker.encode.row_queues import Row
from worker.entry_spans import EntrySpans

log = logging.getLogger("microbatch.worker")


class BatchReport:
    def __init__(
        self, model: str, padded_width: Callable[[int], int] | None, spans: EntrySpans | None
    ) -> None:
        self._model = model
        self._padded_width = padded_width  # the width a runner computes a batch at, if known
        self._spans = spans
        self.metrics = BatchMetrics(model)

    def batch(self, batch: Batch, members: list[Row], facts: BatchFacts, threads: int) -> None:
        compute_s, start_ms = facts.compute_s, facts.start_ms
        series = self.metrics.of(batch.bucket)
        series.batch_size.observe(len(members))
        computed = computed_tokens(batch.padded_tokens, len(members), self._padded_width)
        series.batch_tokens.observe(computed)
        series.padding_ratio.observe(1 - batch.real_tokens / computed)
        series.compute_seconds.observe(compute_s)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("batch", extra=batch_line(self._model, batch, members, start_ms, compute_s))
        if self._spans is not None:
            spans = list(dict.fromkeys(a.held.span for a, _ in members))
            facts_of = span_facts(batch, len(members), computed, threads)
            self._spans.batch(facts.batch_id, spans, start_ms, compute_s, facts_of)


def batch_line(
    model: str, batch: Batch, members: list[Row], start_ms: int, compute_s: float
) -> dict[str, object]:
    """The fields of a batch's debug log line (`log_level` debug: one line per batch)."""
    return {
        "model": model,
        "bucket": batch.bucket,
        "size": len(members),
        "padded_tokens": batch.padded_tokens,
        "real_tokens": batch.real_tokens,
        "trigger": batch.trigger,
        "max_wait_ms": max(start_ms - a.entry.enqueued_ms for a, _ in members),
        "compute_ms": round(compute_s * 1000, 2),
        "request_ids": sorted({a.entry.request_id for a, _ in members}),
    }


def span_facts(batch: Batch, members: int, computed: int, threads: int) -> dict[str, int | str]:
    """A batch span's attributes (worker.entry_spans): its size, bucket, tokens and why."""
    return {
        "microbatch.batch_size": members,
        "microbatch.bucket": batch.bucket,
        "microbatch.real_tokens": batch.real_tokens,
        "microbatch.padded_tokens": computed,
        "microbatch.trigger": batch.trigger,
        "microbatch.threads": threads,
    }
