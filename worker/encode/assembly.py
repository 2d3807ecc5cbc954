"""`Assembly`: one queue entry's rows on their way through batches, until it can be answered.

An entry carries several rows of one request (one bucket's, up to `max_entry_rows`); the
worker batches rows, not entries, so an entry's rows may run in several batches beside other
requests' rows. Its assembly gathers their vectors and what the batches report, and says when
the entry is settled: every row computed, or the entry dropped (its client left, its deadline
passed) with none of its rows still computing. Only then is it answered and acknowledged, so
a crash before that leaves the whole entry pending for a peer. Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.protocol import PRIORITY_BACKGROUND, EmbeddingResult, RequestEntry, encode
from worker.held import Held
from worker.replies import Reply, error_reply, within_limit


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """What one batch reports to the entries whose rows it computed."""

    batch_id: str
    size: int
    start_ms: int  # wall clock when the batch started computing
    compute_s: float


@dataclass(slots=True)
class Assembly:
    held: Held
    rows: list[np.ndarray]  # each row's token ids
    computing: int = 0  # rows in a batch now
    done: int = 0  # rows computed (or failed)
    dropped: str = ""  # "cancelled" or "deadline": the rows still queued will not run
    failure: Exception | None = None  # the first row that failed: the entry fails with it
    vectors: np.ndarray | None = None  # float32 [rows, dim], allocated by the first result
    batch_ids: list[str] = field(default_factory=list)
    batch_size: int = 0
    compute_s: float = 0.0
    first_start_ms: int | None = None

    @classmethod
    def of(cls, held: Held) -> Assembly:
        entry = held.entry
        assert isinstance(entry, RequestEntry)
        return cls(held, entry.rows())

    @property
    def entry(self) -> RequestEntry:
        return self.held.entry  # type: ignore[return-value]

    @property
    def background(self) -> bool:
        """A Batch API line: it only fills what online traffic leaves."""
        return self.entry.priority == PRIORITY_BACKGROUND

    def filled(self, indices: list[int], results: list[object], facts: BatchFacts) -> None:
        """Rows of this entry that one batch computed: their indices in the entry, and each
        one's vector or exception (a row's vector may be a view into the batch's output)."""
        self.computing -= len(indices)
        self.done += len(indices)
        self._facts(facts)
        if len(self.rows) == 1 and not isinstance(results[0], Exception):  # one text: no copy
            self.vectors = np.asarray(results[0], dtype=np.float32).reshape(1, -1)
            return
        places, vectors = [], []
        for index, result in zip(indices, results, strict=True):
            if isinstance(result, Exception):
                self.failure = self.failure or result
            else:
                places.append(index)
                vectors.append(result)
        if vectors:
            block = np.asarray(vectors, dtype=np.float32)  # one copy of all of them, in C
            if self.vectors is None:
                self.vectors = np.empty((len(self.rows), block.shape[-1]), np.float32)
            self.vectors[places] = block

    def _facts(self, facts: BatchFacts) -> None:
        self.batch_ids.append(facts.batch_id)
        self.batch_size = max(self.batch_size, facts.size)
        self.compute_s += facts.compute_s
        if self.first_start_ms is None or facts.start_ms < self.first_start_ms:
            self.first_start_ms = facts.start_ms  # batches on two streams end out of order

    @property
    def settled(self) -> bool:
        """Nothing of it computes and nothing more will: answer and ack it now."""
        return not self.computing and (self.done == len(self.rows) or bool(self.dropped))

    def reply(self, bucket: int, worker: str, now_ms: int) -> Reply | None:
        """Its answer once settled: the vectors, the first failure, a 504 for a deadline
        that passed before all its rows ran; None for a client that left."""
        entry = self.entry
        if self.dropped == "cancelled":
            return None
        if self.dropped:
            late_ms = now_ms - entry.deadline_ms
            message = f"deadline passed {late_ms} ms before compute"
            return error_reply(entry, 504, "deadline_exceeded", message, worker)
        if self.failure is not None or self.vectors is None:
            message = f"model failed: {self.failure}"
            return error_reply(entry, 500, "inference_failed", message, worker)
        result = EmbeddingResult(
            id=entry.id,
            embeddings=np.ascontiguousarray(self.vectors, "<f4").tobytes(),
            rows=len(self.rows),
            n_tokens=entry.n_tokens,
            batch_ids=self.batch_ids,
            batch_size=self.batch_size,
            bucket=bucket,
            queue_ms=max(0.0, (self.first_start_ms or now_ms) - entry.enqueued_ms),
            compute_ms=self.compute_s * 1000,
            worker=worker,
        )
        return within_limit((entry.reply_to, encode(result)), entry, worker)
