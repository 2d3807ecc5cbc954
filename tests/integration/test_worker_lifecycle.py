"""Worker behaviour only a process proves: a graceful drain on SIGTERM, a slow batch that is
not run twice, a loop that dies of a bug stopping its process. (Garbage entries and a
successor serving its predecessor's pending entries are scenarios now, in-process:
tests/integration/test_worker_burst.py.)"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.conftest import (
    Processes,
    eventually,
    fire,
    queue_counts,
    texts,
    wait_ready,
)


def test_sigterm_drains_what_the_worker_holds_and_exits_zero(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", "noop_compute_ms": 300, "max_batch_size": 4}
    first = processes.start("worker", **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    async def scenario() -> tuple[list[httpx.Response], int]:
        requests = asyncio.create_task(fire(gateway.base_url, texts(16)))
        await eventually(  # the first batch is computing, the next one is held
            lambda: queue_counts(redis_url),
            15,
            "the first worker holding two batches",
            until=lambda q: q.pending >= 8,
        )
        first.signal(signal.SIGTERM)
        code = await asyncio.to_thread(first.wait, 30)
        processes.start("worker", **common)  # a peer takes what was never read
        return await requests, code

    responses, code = asyncio.run(scenario())
    assert code == 0, first.output()[-2000:]
    assert [r.status_code for r in responses] == [200] * 16
    served_by_first = sum(
        r.headers["x-microbatch-worker"].endswith(str(first.popen.pid)) for r in responses
    )
    assert served_by_first >= 4, "the draining worker finishes the batches it held"
    metrics = httpx.get(f"{gateway.base_url}/metrics").text
    assert "microbatch_duplicate_replies_total 0.0" in metrics  # nothing it finished was redone


def test_a_batch_slower_than_claim_idle_is_not_run_twice_by_its_own_worker(
    processes: Processes,
) -> None:
    # Compute (1.5 s) outlasts claim_idle_ms (300 ms): the reclaimer sees the batch's entries
    # idle, but they are this worker's own, in flight, and must not be queued again.
    serve = processes.start(
        "serve",
        model="noop",
        noop_compute_ms=1500,
        claim_idle_ms=300,
        max_batch_size=4,
        max_wait_ms=500,
    )
    wait_ready(serve)
    responses = asyncio.run(fire(serve.base_url, texts(4)))
    assert [r.status_code for r in responses] == [200] * 4
    # Room for a wrong second run to show up: one that could only be queued while the four
    # were pending, so before this probe. The noop model computes one batch at a time, the
    # oldest first, so the probe's answer comes after any such run; it is long enough for
    # another bucket, which leaves the count below to the four.
    probe = httpx.post(
        f"{serve.base_url}/v1/embeddings", json={"input": [[101, *[7] * 200, 102]]}, timeout=30
    )
    assert probe.status_code == 200 and probe.headers["x-microbatch-bucket"] != "128"
    text = httpx.get(f"{serve.base_url}/metrics").text
    assert 'microbatch_batch_size_count{bucket="128",model="noop"} 1.0' in text
    assert "microbatch_duplicate_replies_total 0.0" in text
    assert "microbatch_redeliveries_total 0.0" in text


def test_a_worker_whose_loop_dies_of_a_bug_stops_instead_of_hanging(redis_url: str) -> None:
    """A runner bug (wrong result count) escapes the batch task: the consumer must stop
    everything and report it, so the process exits and a supervisor restarts it, rather than
    keep reading into entries nobody will ever run."""
    from common import streams
    from common.protocol import RequestEntry, encode, pack_tokens
    from common.settings import Settings
    from common.store import close_store, open_store
    from worker.compute_threads import ComputeThreads
    from worker.consumer import compose
    from worker.encode.loop import EmbedLoop
    from worker.triage import EntryLimits

    class Buggy:
        dim = 4

        def embed(self, rows, threads=None):
            return []  # one result per row is the contract: this breaks it

    settings = Settings(redis_url=redis_url, model="noop", max_wait_ms=0, read_block_ms=100)
    limits = EntryLimits(model="noop", max_tokens=512, vocab_size=0, max_deliveries=3)

    async def scenario() -> BaseException | None:
        store = open_store(settings)

        async def register() -> None:
            return None

        compute = ComputeThreads()
        consumer = compose(
            settings,
            store,
            limits,
            "buggy",
            lambda wiring: EmbedLoop(settings, wiring, Buggy(), compute),
            register,
            compute,
        )
        now = int(time.time() * 1000)
        entry = RequestEntry(
            id="x.0",
            request_id="r",
            model="noop",
            tokens=pack_tokens([1, 2]),
            lengths=pack_tokens([2]),
            deadline_ms=now + 60_000,
            priority=1,
            reply_to="mb:reply:t",
            enqueued_ms=now,
        )
        keys = streams.Keys(settings.prefix)
        await streams.add_requests(store, [(keys.request("noop", 128), encode(entry))])
        try:
            await asyncio.wait_for(consumer.run_until_idle(), 20)
        finally:
            await close_store(store)
        return consumer.crashed

    crashed = asyncio.run(scenario())
    assert isinstance(crashed, ValueError)  # the bug itself (zip of rows and results), reported
