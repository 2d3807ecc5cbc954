"""One request's trace across the queue, in process: a gateway and workers over a real
redis-server, each role with its own tracer provider and the SDK's in-memory exporter (two
services, as in a fleet). The entry carries the trace context through Redis; the batch span
links to the entries it served; the client's `traceparent` is honoured and returned."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from common import streams, tracing
from common.protocol import RequestEntry, encode, pack_rows
from common.settings import Settings
from common.store import close_store, open_store
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess
from worker.compute_threads import ComputeThreads
from worker.consumer import compose
from worker.encode.loop import EmbedLoop
from worker.encode.runners.base import RowResult, isolate_failures
from worker.triage import EntryLimits

PREFIX = "traced"
TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CLIENT = {"traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "vendor=abc"}


def _role(role: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    provider = TracerProvider(resource=tracing.resource(role))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return provider, exported


@dataclass
class Traced:
    url: str
    gateway: InMemorySpanExporter
    worker: InMemorySpanExporter

    def spans(self, trace_id: str) -> list[ReadableSpan]:
        return [
            s
            for s in [*self.gateway.get_finished_spans(), *self.worker.get_finished_spans()]
            if format_trace_id(s.context.trace_id) == trace_id
        ]

    def batch_of(self, span: ReadableSpan) -> ReadableSpan:
        """The batch span that links to `span`."""
        return wait_until(
            lambda: [
                s
                for s in self.worker.get_finished_spans()
                if s.name == "batch"
                and any(k.context.span_id == span.context.span_id for k in s.links)
            ],
            10,
            "the batch span linking to the entry",
        )[0]


@pytest.fixture(scope="module")
def traced(module_redis: RedisServer, tiny_model: Path) -> Iterator[Traced]:
    deployment = InProcess()
    common = {"redis_url": module_redis.url, "prefix": PREFIX, "read_block_ms": 100}
    (gateway_provider, gateway), (worker_provider, worker) = _role("gateway"), _role("worker")
    try:
        port = free_port()
        url = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"g-{port}"),
            gateway_provider.get_tracer("microbatch"),
        )
        for n, settings in enumerate(
            (
                Settings(**common, model="noop", worker_id="noop"),
                Settings(
                    **common, model=str(tiny_model), served_model_name=["tiny"], worker_id="llama"
                ),
            ),
            start=1,
        ):
            deployment.start_worker(settings, worker_provider.get_tracer("microbatch"))
            wait_until(
                lambda n=n: (
                    deployment.failures or len(httpx.get(f"{url}/v1/models").json()["data"]) == n
                ),
                120,
                f"{n} models served",
            )
        assert not deployment.failures
        yield Traced(url, gateway, worker)
    finally:
        deployment.close()


def _ids(span: ReadableSpan) -> tuple[str, str]:
    return format_trace_id(span.context.trace_id), format_span_id(span.context.span_id)


def test_one_request_is_one_trace_from_the_gateway_through_redis_to_its_batch(
    traced: Traced,
) -> None:
    answer = httpx.post(
        f"{traced.url}/v1/embeddings", json={"model": "noop", "input": ["a", "b c"]}, headers=CLIENT
    )
    assert answer.status_code == 200, answer.text
    spans = wait_until(
        lambda: traced.spans(TRACE),
        10,
        "the worker's spans, ended once the answer is published",
        until=lambda s: any(x.name == "process entry" for x in s),
    )
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /v1/embeddings" and server.parent is not None
    assert format_span_id(server.parent.span_id) == PARENT  # the client's span is its parent
    assert server.resource.attributes["service.name"] == "microbatch-gateway"
    assert server.attributes["microbatch.request_id"] == answer.headers["x-request-id"]
    assert server.attributes["http.response.status_code"] == 200
    children = {s.name for s in spans if s.parent and s.parent.span_id == server.context.span_id}
    assert {"validate", "tokenize", "admission", "enqueue", "wait for replies"} <= children
    worker = [s for s in spans if s.resource.attributes["service.name"] == "microbatch-worker"]
    assert sorted(s.name for s in worker) == ["process entry", "queue wait"]
    assert all(s.parent.span_id == server.context.span_id for s in worker)  # type: ignore[union-attr]
    (entry,) = [s for s in worker if s.name == "process entry"]
    assert (
        entry.attributes["microbatch.rows"] == 2 and entry.attributes["microbatch.deliveries"] == 1
    )
    batch = traced.batch_of(entry)
    assert format_trace_id(batch.context.trace_id) != TRACE  # the batch is a trace of its own
    assert batch.attributes["microbatch.batch_id"] in answer.headers["x-microbatch-batch-id"]
    assert (
        batch.attributes["microbatch.bucket"] == 128
        and batch.attributes["microbatch.batch_size"] >= 2
    )
    # the answer names the server span, and the tracestate went along with the trace
    assert answer.headers["traceparent"] == f"00-{TRACE}-{_ids(server)[1]}-01"
    assert server.context.trace_state.get("vendor") == "abc"


def test_a_request_with_no_trace_context_starts_one_and_is_told_its_id(traced: Traced) -> None:
    answer = httpx.post(f"{traced.url}/v1/embeddings", json={"model": "noop", "input": "x"})
    assert answer.status_code == 200
    version, trace_id, span_id, flags = answer.headers["traceparent"].split("-")
    assert (version, len(trace_id), len(span_id)) == ("00", 32, 16)
    assert int(flags, 16) & 1  # sampled (the SDK also sets W3C level 2's "random" bit)
    spans = wait_until(
        lambda: traced.spans(trace_id),
        10,
        "its spans",
        until=lambda s: len({x.name for x in s}) >= 7,
    )
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.parent is None and _ids(server) == (trace_id, span_id)


def test_a_refused_request_is_a_server_span_with_its_status(traced: Traced) -> None:
    answer = httpx.post(
        f"{traced.url}/v1/embeddings",
        json={"model": "noop", "input": []},
        headers=CLIENT | {"traceparent": f"00-{'1' * 32}-{PARENT}-01"},
    )
    assert answer.status_code == 400
    (server,) = wait_until(
        lambda: [s for s in traced.spans("1" * 32) if s.kind is SpanKind.SERVER], 10, "the span"
    )
    assert server.attributes["http.response.status_code"] == 400


def test_a_streamed_generation_traces_prefill_first_token_and_finish_and_ends_with_its_stream(
    traced: Traced,
) -> None:
    trace_id = "2" * 32
    headers = {"traceparent": f"00-{trace_id}-{PARENT}-01"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{traced.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["traceparent"].split("-")[1] == trace_id
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    spans = wait_until(
        lambda: traced.spans(trace_id),
        10,
        "the server span, ended with its stream, and the worker's",
        until=lambda s: {"POST /v1/chat/completions", "process entry"} <= {x.name for x in s},
    )
    (entry,) = [s for s in spans if s.name == "process entry"]
    names = [e.name for e in entry.events]
    assert names[:2] == ["prefill", "first token"] and names[-1] == "finished"
    finished = entry.events[-1].attributes or {}
    assert (finished["reason"], finished["tokens"]) == ("length", 6)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.end_time >= entry.events[-1].timestamp  # type: ignore[operator]


def test_the_latency_histogram_carries_trace_exemplars_for_openmetrics_scrapers(
    traced: Traced,
) -> None:
    trace_id = "3" * 32
    headers = {"traceparent": f"00-{trace_id}-{PARENT}-01"}
    assert (
        httpx.post(
            f"{traced.url}/v1/embeddings", json={"model": "noop", "input": "e"}, headers=headers
        ).status_code
        == 200
    )
    scraped = httpx.get(
        f"{traced.url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert scraped.headers["content-type"].startswith("application/openmetrics-text")
    lines = [
        line
        for line in scraped.text.splitlines()
        if line.startswith("microbatch_request_duration_seconds_bucket")
    ]
    assert any(f'trace_id="{trace_id}"' in line for line in lines)
    plain = httpx.get(f"{traced.url}/metrics").text  # the classic format has no exemplars
    assert "trace_id" not in plain


# ---- the worker alone, in burst mode: a batch of eight entries, each of its own trace ----


class Rows:
    """Answers each row with its length; a row holding POISON fails."""

    dim = 1
    concurrent = False
    POISON = 99

    def embed(self, rows: list[np.ndarray], threads: int | None = None) -> list[RowResult]:
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        if any((r == self.POISON).any() for r in rows):
            raise ValueError("poison row")
        return [np.array([len(r)], dtype=np.float32) for r in rows]


def _entry(i: int, tokens: list[int], deadline_in_ms: int = 60_000) -> RequestEntry:
    packed, lengths = pack_rows([np.array(tokens)])
    now = int(time.time() * 1000)
    return RequestEntry(
        id=f"t.{i}", request_id=f"r{i}", model="noop", tokens=packed, lengths=lengths,
        deadline_ms=now + deadline_in_ms, priority=1, reply_to="traced:reply:burst",
        enqueued_ms=now - 5, traceparent=f"00-{i + 1:032x}-{PARENT}-01",
    )  # fmt: skip


async def _burst(
    redis_url: str, entries: list[RequestEntry], died_holding: int = 0
) -> list[ReadableSpan]:
    settings = Settings(redis_url=redis_url, prefix=f"burst{free_port()}", model="noop",
                        max_wait_ms=0, max_batch_size=16)  # fmt: skip
    provider, exported = _role("worker")
    store = open_store(settings)
    keys = streams.Keys(settings.prefix)
    try:
        items = [(keys.request("noop", 128), encode(e)) for e in entries]
        await streams.add_requests(store, items)
        if died_holding:  # an earlier worker of this name read them, then died
            await streams.ensure_groups(store, [keys.request("noop", 128)])
            await streams.read_group(
                store, "burst", {keys.request("noop", 128): ">"}, count=died_holding, block_ms=None
            )
        limits = EntryLimits(model="noop", max_tokens=512, vocab_size=0, max_deliveries=3)

        async def register() -> None:
            return None

        compute = ComputeThreads()
        consumer = compose(settings, store, limits, "burst",
                           lambda wiring: EmbedLoop(settings, wiring, Rows(), compute),
                           register, compute, tracer=provider.get_tracer("microbatch"))  # fmt: skip
        await asyncio.wait_for(consumer.run_until_idle(), 60)
        assert consumer.crashed is None
        return list(exported.get_finished_spans())
    finally:
        await close_store(store)


def test_eight_entries_batched_together_are_one_batch_span_with_eight_links(redis_url: str) -> None:
    spans = asyncio.run(_burst(redis_url, [_entry(i, [1, 2, 3]) for i in range(8)]))
    (batch,) = [s for s in spans if s.name == "batch"]
    entries = [s for s in spans if s.name == "process entry"]
    assert len(entries) == 8 and len(batch.links) == 8
    assert {k.context.span_id for k in batch.links} == {s.context.span_id for s in entries}
    assert {format_trace_id(s.context.trace_id) for s in entries} == {
        f"{i + 1:032x}" for i in range(8)
    }
    assert (
        batch.attributes["microbatch.batch_size"] == 8
        and batch.attributes["microbatch.entries"] == 8
    )
    assert batch.attributes["microbatch.real_tokens"] == 24


def test_what_befalls_an_entry_is_an_event_and_its_log_line_names_its_trace(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    redelivered = _entry(0, [1, 2])
    poisoned = _entry(1, [Rows.POISON])
    expired = _entry(2, [3], deadline_in_ms=-1)
    with caplog.at_level(logging.ERROR, logger="microbatch.worker"):
        spans = asyncio.run(_burst(redis_url, [redelivered, poisoned, expired], died_holding=1))
    by_trace = {format_trace_id(s.context.trace_id): s for s in spans if s.name == "process entry"}
    events = {trace: [e.name for e in s.events] for trace, s in by_trace.items()}
    assert events[f"{1:032x}"][0] == "redelivered"
    assert "input failed" in events[f"{2:032x}"]
    assert events[f"{3:032x}"] == ["deadline_exceeded"]
    (failed,) = [r for r in caplog.records if r.getMessage().startswith("input failed")]
    assert failed.trace_id == f"{2:032x}"  # type: ignore[attr-defined]
    assert failed.span_id == format_span_id(by_trace[f"{2:032x}"].context.span_id)  # type: ignore[attr-defined]


def test_a_request_its_client_did_not_sample_is_traced_nowhere(traced: Traced) -> None:
    """The parent's sampled flag off: the gateway's span is not recorded, so nothing under it
    is made, its entries carry no context (untraced on the wire and on the worker), and no
    trace id is returned that no backend will ever hold."""
    trace_id = "4" * 32
    headers = {"traceparent": f"00-{trace_id}-{PARENT}-00"}
    answer = httpx.post(
        f"{traced.url}/v1/embeddings", json={"model": "noop", "input": "q"}, headers=headers
    )
    assert answer.status_code == 200 and "traceparent" not in answer.headers
    # the answer came after everything that would have traced it: a gateway span ends
    # before its answer is sent, an entry span starts at read, and a batch span is exported
    # before its replies are published (the exporters here are synchronous)
    assert traced.spans(trace_id) == []
    batch_id = answer.headers["x-microbatch-batch-id"]
    assert not [  # nor a batch span of its own: nothing would lead to it
        s for s in traced.worker.get_finished_spans()
        if s.name == "batch" and s.attributes["microbatch.batch_id"] == batch_id
    ]  # fmt: skip


def test_eight_http_requests_batched_together_are_one_batch_span_with_eight_links(
    redis_server: RedisServer,
) -> None:
    """Eight clients, each its own trace, queue while no worker runs (scale from zero: the
    gateway knows a worker's cold start); the worker that starts reads all eight at once
    and runs them as one batch, whose span links to each request's entry span."""
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": "traced8", "read_block_ms": 100}
    (gateway_provider, _), (worker_provider, worker) = _role("gateway"), _role("worker")
    worker_settings = Settings(
        **common, model="noop", worker_id="noop8", max_wait_ms=0, max_batch_size=16
    )
    try:
        port = free_port()
        url = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"g-{port}"),
            gateway_provider.get_tracer("microbatch"),
        )
        deployment.start_worker(worker_settings)  # registers the model and its cold start

        def ready() -> int:
            return httpx.get(f"{url}/readyz/noop").status_code

        wait_until(ready, 60, "the worker serving", until=lambda status: status == 200)
        deployment.stop_worker()
        wait_until(ready, 30, "no worker live", until=lambda status: status == 503)
        # the cold start an in-process worker records is the test process's age; a real
        # worker's is seconds, which is what the gateway lets these requests wait for
        store = redis.Redis.from_url(redis_server.url)
        store.set("traced8:{noop}:cold_start", 2000)
        wait_until(  # the gateway's catalog refresh has seen it
            lambda: httpx.post(
                f"{url}/v1/embeddings",
                json={"model": "noop", "input": "probe"},
                headers={"x-microbatch-timeout-ms": "1"},
            ).json()["error"]["message"],
            30,
            "the gateway knowing the cold start",
            until=lambda message: "2000 ms" in message,
        )

        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            headers = {
                "traceparent": f"00-{i + 100:032x}-{PARENT}-01",
                "x-microbatch-timeout-ms": "30000",  # past the cold start: it queues
            }
            body = {"model": "noop", "input": f"text {i}"}
            return await client.post(f"{url}/v1/embeddings", json=body, headers=headers)

        async def eight() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, i) for i in range(8)))

        asked = asyncio.run_coroutine_threadsafe(eight(), deployment.loop)
        stream = "traced8:{noop}:req:128"
        wait_until(lambda: store.xlen(stream), 10, "eight queued", until=lambda n: n == 8)
        deployment.start_worker(worker_settings, worker_provider.get_tracer("microbatch"))
        answers = asked.result(60)
    finally:
        deployment.close()
    assert [a.status_code for a in answers] == [200] * 8
    assert len({a.headers["x-microbatch-batch-id"] for a in answers}) == 1  # one batch
    spans = worker.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "batch"]
    entries = [s for s in spans if s.name == "process entry"]
    assert len(batch.links) == 8
    assert {k.context.span_id for k in batch.links} == {s.context.span_id for s in entries}
    traces = {format_trace_id(s.context.trace_id) for s in entries}
    assert traces == {f"{i + 100:032x}" for i in range(8)}
