"""Worker scenarios driven in-process until idle (burst mode), with an injected runner.

A real redis-server holds the streams; `Consumer.run_until_idle` reads what they hold,
answers it and returns, so each scenario is deterministic: no sleeps, no timing bets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from prometheus_client import REGISTRY

from common import streams
from common.protocol import (
    PRIORITY_BACKGROUND,
    EmbeddingResult,
    ErrorReply,
    RequestEntry,
    decode,
    encode,
    pack_rows,
)
from common.settings import Settings
from common.store import close_store, open_store
from worker.compute_threads import ComputeThreads
from worker.consumer import compose
from worker.encode.loop import EmbedLoop
from worker.encode.runners.base import RowResult, isolate_failures
from worker.triage import EntryLimits

REPLY = "mb:reply:burst-test"
POISON = 99


class RecordingRunner:
    """Answers every row with [its length]; a row holding POISON fails; records each batch."""

    dim = 1
    concurrent = False

    def __init__(self) -> None:
        self.batches: list[list[int]] = []  # the lengths of each batch's rows

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        self.batches.append([len(r) for r in rows])
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        if any((r == POISON).any() for r in rows):
            raise ValueError("poison row")
        return [np.array([len(r)], dtype=np.float32) for r in rows]


def _entry(i: int, tokens: list[int], deadline_in_ms: int = 60_000) -> RequestEntry:
    """An entry of one row."""
    return _rows_entry(i, [], deadline_in_ms=deadline_in_ms, rows=[np.array(tokens)])


def _rows_entry(
    i: int,
    lengths: list[int],
    poison_row: int | None = None,
    deadline_in_ms: int = 60_000,
    rows: list[np.ndarray] | None = None,
) -> RequestEntry:
    """An entry of several rows (row r: `lengths[r]` tokens of value r + 1, or POISON), or
    of the `rows` given."""
    if rows is None:
        rows = [
            np.full(n, POISON if r == poison_row else r + 1, dtype=np.uint32)
            for r, n in enumerate(lengths)
        ]
    tokens, packed = pack_rows(rows)
    now = int(time.time() * 1000)
    return RequestEntry(
        id=f"e.{i}",
        request_id=f"r{i}",
        model="noop",
        tokens=tokens,
        lengths=packed,
        deadline_ms=now + deadline_in_ms,
        priority=1,
        reply_to=REPLY,
        enqueued_ms=now,
    )


def _waited(entry: RequestEntry) -> RequestEntry:
    """The entry as one that waited a second in the stream: its client left meanwhile."""
    return dataclasses.replace(entry, enqueued_ms=entry.enqueued_ms - 1000)


async def _burst(
    redis_url: str,
    entries: list[RequestEntry],
    cancelled: Sequence[str] = (),
    max_batch_size: int = 16,
    compute: ComputeThreads | None = None,
    runner: RecordingRunner | None = None,
    died_holding: int = 0,
    raw: Sequence[bytes] = (),
    dead: list | None = None,
) -> tuple[dict[str, EmbeddingResult | ErrorReply], RecordingRunner, int]:
    """Queue `entries`, run a worker until idle: its replies by id, its runner, what is left
    pending in the streams. `died_holding`: so many of the first entries were read by an
    earlier worker of the same name that died holding them, so this one reads them again.
    `raw`: payloads written as they are to the 128 stream (garbage a writer might leave);
    `dead`, when given, receives the dead letters the worker wrote."""
    settings = Settings(
        redis_url=redis_url, model="noop", max_wait_ms=0, max_batch_size=max_batch_size
    )
    store = open_store(settings)
    keys = streams.Keys(settings.prefix)
    try:
        items = [
            (keys.request("noop", 128 if e.longest <= 128 else 512), encode(e)) for e in entries
        ]
        await streams.add_requests(store, items)
        for payload in raw:
            await store.xadd(keys.request("noop", 128), {streams.FIELD: payload})
        await streams.cancel(store, keys, "noop", list(cancelled), int(time.time() * 1000) + 60_000)
        if died_holding:
            await streams.ensure_groups(store, sorted({s for s, _ in items}))
            for stream in sorted({s for s, _ in items[:died_holding]}):
                await streams.read_group(
                    store, "burst", {stream: ">"}, count=died_holding, block_ms=None
                )
        limits = EntryLimits(model="noop", max_tokens=512, vocab_size=0, max_deliveries=3)

        async def register() -> None:
            return None

        runner = runner or RecordingRunner()
        compute = compute or ComputeThreads()
        consumer = compose(
            settings,
            store,
            limits,
            "burst",
            lambda wiring: EmbedLoop(settings, wiring, runner, compute),
            register,
            compute,
        )
        await asyncio.wait_for(consumer.run_until_idle(), 60)
        assert consumer.crashed is None
        read = await streams.read_replies(store, REPLY, "0-0", count=1000, block_ms=None)
        replies: dict[str, EmbeddingResult | ErrorReply] = {}
        for item in read:
            reply = decode(item.payload or b"")
            assert reply.id not in replies, f"{reply.id} answered twice"
            replies[reply.id] = reply
        written = {s for s, _ in items} | ({keys.request("noop", 128)} if raw else set())
        left = sum([await store.xlen(stream) for stream in written])
        if dead is not None:
            dead += [
                decode(f[streams.FIELD.encode()]) for _, f in await store.xrange(keys.dead("noop"))
            ]
        return replies, runner, left
    finally:
        await close_store(store)


def test_every_entry_is_answered_once_in_batches_that_never_mix_buckets(redis_url: str) -> None:
    short = [_entry(i, [1] * 10) for i in range(5)]
    long = [_entry(10 + i, [1] * 300) for i in range(3)]
    replies, runner, left = asyncio.run(_burst(redis_url, short + long))
    assert sorted(replies) == sorted(e.id for e in short + long)
    for entry in short + long:
        reply = replies[entry.id]
        assert isinstance(reply, EmbeddingResult)
        assert reply.vectors().tolist() == [[entry.n_tokens]]
    for lengths in runner.batches:
        assert all(n <= 128 for n in lengths) or all(n > 128 for n in lengths)
    assert left == 0  # answered entries are acked and deleted


def test_a_failing_input_fails_only_its_own_entry(redis_url: str) -> None:
    entries = [_entry(i, [1, 2, POISON if i == 2 else 3]) for i in range(4)]
    replies, _, left = asyncio.run(_burst(redis_url, entries))
    failed = replies["e.2"]
    assert isinstance(failed, ErrorReply)
    assert (failed.status, failed.code) == (500, "inference_failed")
    assert all(isinstance(replies[f"e.{i}"], EmbeddingResult) for i in (0, 1, 3))
    assert left == 0


def test_cancelled_and_expired_entries_cost_no_compute(redis_url: str) -> None:
    kept = _entry(0, [7] * 4)
    cancelled = _waited(_entry(1, [8] * 5))
    expired = _entry(2, [9] * 6, deadline_in_ms=-1)
    replies, runner, left = asyncio.run(_burst(redis_url, [kept, cancelled, expired], ["e.1"]))
    assert runner.batches == [[4]]  # only the entry someone still waits for was computed
    assert "e.1" not in replies  # its client left: nobody to answer
    late = replies["e.2"]
    assert isinstance(late, ErrorReply) and late.status == 504
    assert left == 0


def test_an_entry_of_many_rows_is_batched_with_others_and_answered_once(
    redis_url: str,
) -> None:
    many = _rows_entry(0, list(range(1, 11)))  # ten rows, 1 to 10 tokens
    single = _entry(1, [1] * 5)
    replies, runner, left = asyncio.run(_burst(redis_url, [many, single], max_batch_size=4))
    reply = replies["e.0"]
    assert isinstance(reply, EmbeddingResult)
    assert reply.vectors().tolist() == [[n] for n in range(1, 11)]  # its rows, in its order
    assert reply.rows == 10 and reply.n_tokens == 55
    assert len(reply.batch_ids) >= 3  # eleven rows in batches of four: its rows span several
    assert all(len(batch) <= 4 for batch in runner.batches)
    assert sorted(n for batch in runner.batches for n in batch) == sorted([*range(1, 11), 5])
    assert isinstance(replies["e.1"], EmbeddingResult)
    assert left == 0


def test_a_failing_row_fails_its_own_entry_and_no_other(redis_url: str) -> None:
    bad = _rows_entry(0, [3, 4, 5, 6], poison_row=2)
    good = _rows_entry(1, [3, 4, 5, 6])
    replies, runner, left = asyncio.run(_burst(redis_url, [bad, good], max_batch_size=8))
    failed = replies["e.0"]
    assert isinstance(failed, ErrorReply)
    assert (failed.status, failed.code) == (500, "inference_failed")
    assert replies["e.1"].vectors().tolist() == [[3], [4], [5], [6]]  # type: ignore[union-attr]
    assert any(len(batch) > 1 for batch in runner.batches)  # they shared a batch, then bisected
    assert left == 0


def test_a_cancelled_entry_of_many_rows_computes_none_of_them(redis_url: str) -> None:
    kept = _rows_entry(0, [2, 2])
    gone = _waited(_rows_entry(1, [3, 3, 3]))
    replies, runner, left = asyncio.run(_burst(redis_url, [kept, gone], ["e.1"]))
    assert sorted(n for batch in runner.batches for n in batch) == [2, 2]
    assert "e.1" not in replies and isinstance(replies["e.0"], EmbeddingResult)
    assert left == 0


def test_a_batch_is_handed_to_compute_before_the_next_read_goes_out(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop submits a batch in the turn it picks it, and the reader lets it have that turn
    before sending its next XREADGROUP: a lone request's compute does not queue behind a read
    round trip (the 1-connection latency of the queue-path benchmark)."""
    events: list[str] = []
    read_group = streams.read_group

    async def recording_read(store, consumer, ids, **kwargs):
        if ">" in ids.values():  # new entries (not a worker's own pending ones at start)
            events.append("read")
        return await read_group(store, consumer, ids, **kwargs)

    class RecordingCompute(ComputeThreads):
        def submit(self, stream, fn, *args, **kwargs):
            events.append("compute")
            return super().submit(stream, fn, *args, **kwargs)

    monkeypatch.setattr(streams, "read_group", recording_read)
    replies, _, left = asyncio.run(
        _burst(redis_url, [_entry(0, [1] * 4)], compute=RecordingCompute())
    )
    assert isinstance(replies["e.0"], EmbeddingResult)
    assert events[:3] == ["read", "compute", "read"]
    assert left == 0


class _Submits(ComputeThreads):
    """Compute threads that count the batches handed to them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.second = threading.Event()

    def submit(self, stream, fn, *args, **kwargs):
        self.count += 1
        if self.count >= 2:
            self.second.set()
        return super().submit(stream, fn, *args, **kwargs)


class _HoldsFirstBatch(RecordingRunner):
    """Holds its first batch until a second batch is handed to the compute thread, or
    `wait_s` passes; says whether one came while the first computed."""

    def __init__(self, submits: _Submits, wait_s: float) -> None:
        super().__init__()
        self._submits, self._wait_s = submits, wait_s
        self.queued_behind: bool | None = None

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        if self.queued_behind is None:
            self.queued_behind = self._submits.second.wait(self._wait_s)
        return super().embed(rows, threads)


def test_on_one_stream_the_next_full_batch_is_queued_while_one_computes(redis_url: str) -> None:
    """A device that runs one batch at a time starts the next the moment the running one
    ends: the loop hands the next full batch to the compute thread while the first computes,
    instead of idling the device through its turn after it."""
    submits = _Submits()
    runner = _HoldsFirstBatch(submits, wait_s=10)
    entries = [_entry(i, [1] * 5) for i in range(32)]  # two full batches of 16
    replies, _, left = asyncio.run(_burst(redis_url, entries, compute=submits, runner=runner))
    assert runner.queued_behind is True
    assert runner.batches == [[5] * 16, [5] * 16]
    assert all(isinstance(replies[e.id], EmbeddingResult) for e in entries)
    assert left == 0


def test_a_batch_that_could_still_grow_is_not_queued_behind_the_running_one(
    redis_url: str,
) -> None:
    submits = _Submits()
    runner = _HoldsFirstBatch(submits, wait_s=0.5)
    entries = [_entry(i, [1] * 5) for i in range(20)]  # a full batch, then four rows
    replies, _, left = asyncio.run(_burst(redis_url, entries, compute=submits, runner=runner))
    assert runner.queued_behind is False  # the four waited for the stream, free to grow
    assert sorted(len(b) for b in runner.batches) == [4, 16]
    assert all(isinstance(replies[e.id], EmbeddingResult) for e in entries)
    assert left == 0


@pytest.mark.parametrize("online_first", [True, False])
def test_a_background_batch_waits_for_the_stream_only_while_online_traffic_is_live(
    redis_url: str, online_first: bool
) -> None:
    """Behind an online batch, background rows go in slices (a quarter of the batch size
    before a cost model) and none is queued on the compute thread, so an online row read
    meanwhile goes first; with no online traffic, background batches are whole and queue
    behind the running one as any full batch does."""
    submits = _Submits()
    runner = _HoldsFirstBatch(submits, wait_s=0.5)
    online = [_entry(i, [1] * 5) for i in range(16)] if online_first else []
    background = [
        dataclasses.replace(_entry(i, [1] * 5), priority=PRIORITY_BACKGROUND)
        for i in range(16, 48 if not online_first else 32)
    ]
    entries = online + background
    replies, _, left = asyncio.run(_burst(redis_url, entries, compute=submits, runner=runner))
    assert runner.queued_behind is (not online_first)
    sizes = [len(b) for b in runner.batches]
    assert sizes == ([16, 4, 4, 4, 4] if online_first else [16, 16])
    assert all(isinstance(replies[e.id], EmbeddingResult) for e in entries)
    assert left == 0


class _Slow(RecordingRunner):
    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        time.sleep(0.2)
        return super().embed(rows, threads)


def test_a_queued_batch_reports_its_own_compute_time_not_its_wait(redis_url: str) -> None:
    """Compute time is taken on the compute thread: the second batch waited ~0.2 s behind
    the first, which neither its reply nor the cost model may count as compute."""
    entries = [_entry(i, [1] * 5) for i in range(32)]
    replies, runner, _ = asyncio.run(_burst(redis_url, entries, runner=_Slow()))
    assert len(runner.batches) == 2
    times = [replies[e.id].compute_ms for e in entries]  # type: ignore[union-attr]
    assert all(150 <= t < 350 for t in times), times


def _queue_wait(stat: str) -> float:
    labels = {"model": "noop", "bucket": "128"}
    return REGISTRY.get_sample_value(f"microbatch_queue_wait_seconds_{stat}", labels) or 0.0


def test_queue_wait_is_observed_once_per_entry_up_to_its_batch_s_real_start(
    redis_url: str,
) -> None:
    """The second batch is handed over while the first computes, then waits ~0.2 s on the
    compute thread: that wait is queueing, and each entry is observed once."""
    count, total = _queue_wait("count"), _queue_wait("sum")
    entries = [_entry(i, [1] * 5) for i in range(32)]
    replies, runner, _ = asyncio.run(_burst(redis_url, entries, runner=_Slow()))
    assert len(runner.batches) == 2
    assert _queue_wait("count") - count == 32
    waits = [replies[e.id].queue_ms for e in entries]  # type: ignore[union-attr]
    assert sum(w >= 150 for w in waits) == 16, waits  # the second batch's entries
    assert _queue_wait("sum") - total >= 16 * 0.15


class _SlowFirst(RecordingRunner):
    def __init__(self, first_s: float) -> None:
        super().__init__()
        self._first_s = first_s

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        if not self.batches:
            time.sleep(self._first_s)
        return super().embed(rows, threads)


def test_a_queued_batch_whose_deadline_passes_is_revoked_just_after_the_gateway_s_answer(
    redis_url: str,
) -> None:
    """While the first batch computes for 0.8 s, the second waits behind it with a 0.2 s
    deadline. The loop wakes `DEADLINE_GRACE_S` past that deadline (the gateway, which owns
    it, answers the client first), takes the batch back before it starts, and answers 504:
    not at the deadline itself, and not only once the first batch ends."""
    kept = [_entry(i, [1] * 5) for i in range(16)]
    late = [_entry(16 + i, [1] * 5, deadline_in_ms=200) for i in range(16)]
    replies, runner, left = asyncio.run(_burst(redis_url, kept + late, runner=_SlowFirst(0.8)))
    assert runner.batches == [[5] * 16]  # the late ones never computed
    assert all(isinstance(replies[e.id], EmbeddingResult) for e in kept)
    for entry in late:
        reply = replies[entry.id]
        assert isinstance(reply, ErrorReply) and reply.status == 504
        late_ms = int(reply.message.split()[2])  # "deadline passed N ms before compute"
        # the grace (100 ms, less a wall-clock millisecond of rounding), then at once
        assert 99 <= late_ms < 500, reply.message
    assert left == 0


class _OnAGrid(RecordingRunner):
    """Computes every batch at its longest row rounded up to 16, as bfloat16 does on a CPU."""

    def padded_width(self, longest: int) -> int:
        return -(-longest // 16) * 16


def _batch_metric(name: str) -> float:
    labels = {"model": "noop", "bucket": "128"}
    return REGISTRY.get_sample_value(f"microbatch_{name}_sum", labels) or 0.0


def test_batch_metrics_count_the_padding_the_runner_computes(redis_url: str) -> None:
    tokens, padding = _batch_metric("batch_tokens"), _batch_metric("padding_ratio")
    entries = [_entry(i, [1] * 5) for i in range(16)]
    replies, runner, _ = asyncio.run(_burst(redis_url, entries, runner=_OnAGrid()))
    assert runner.batches == [[5] * 16]
    assert all(isinstance(replies[e.id], EmbeddingResult) for e in entries)
    assert _batch_metric("batch_tokens") - tokens == 16 * 16  # not 16 x 5
    assert _batch_metric("padding_ratio") - padding == pytest.approx(1 - 5 / 16)


def test_an_entry_a_worker_died_holding_runs_alone_one_row_per_batch(redis_url: str) -> None:
    again = _rows_entry(0, [3, 4])  # read by a worker that died: maybe what killed it
    fresh = [_entry(i, [1] * 5) for i in range(1, 4)]
    replies, runner, left = asyncio.run(
        _burst(redis_url, [again, *fresh], max_batch_size=8, died_holding=1)
    )
    assert sorted(replies) == ["e.0", "e.1", "e.2", "e.3"]
    assert replies["e.0"].vectors().tolist() == [[3], [4]]  # type: ignore[union-attr]
    assert [3] in runner.batches and [4] in runner.batches  # its rows, each alone
    assert [5, 5, 5] in runner.batches  # the others still batch together
    assert left == 0


def test_garbage_entries_are_dead_lettered_and_the_worker_carries_on(redis_url: str) -> None:
    """What is not a valid entry of a version this worker reads is dead-lettered, raw, and
    never run or unpickled; the good entry beside it is answered. (Moved in-process from the
    process tier: only the worker's own handling is at stake.)"""
    import pickle

    import msgpack

    garbage = [
        b"\xc1not msgpack",
        pickle.dumps({"t": "req", "v": 1}),
        msgpack.packb({"t": "req", "v": 99}),  # a version nobody reads, naming no sender
        b"\x91" * 5000 + b"\xc0",  # deeply nested arrays
    ]
    letters: list = []
    replies, runner, left = asyncio.run(
        _burst(redis_url, [_entry(0, [1] * 4)], raw=garbage, dead=letters)
    )
    assert isinstance(replies["e.0"], EmbeddingResult) and runner.batches == [[4]]
    assert len(letters) == len(garbage)
    assert all(d.reason.startswith("malformed") for d in letters), [d.reason for d in letters]
    assert sorted(d.payload for d in letters) == sorted(garbage)
    assert left == 0  # acked and deleted
