"""Traces from real processes, configured only by the standard OTEL_* environment, exported
over OTLP/HTTP to a real receiver on loopback (tests/otlp_receiver.py): a gateway and two
workers, one of them killed while it computes the request, and `serve`. What only processes
prove: the environment switches tracing on, each process is a service instance of its own,
and a SIGKILLed attempt still shows in the request's trace beside the one that answered."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Processes, eventually, queue_counts, wait_ready, wait_until
from tests.otlp_receiver import Receiver, tree

TRACE, PARENT = "5bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
QUICK = {"claim_idle_ms": 1000, "heartbeat_interval_ms": 200}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """Asked for before `processes`, so it closes after they stop: a process whose collector
    is gone retries its last export for seconds before it exits."""
    received = Receiver()
    yield received
    received.close()


def otel(receiver: Receiver) -> dict[str, str]:
    """Tracing on, as an operator switches it on; spans exported within 100 ms of ending."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def test_a_request_whose_worker_is_killed_is_one_trace_over_three_processes(
    redis_url: str, receiver: Receiver, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    env = otel(receiver)
    doomed = processes.start("worker", noop_compute_ms=3000, env=env, **common)
    gateway = processes.start("gateway", env=env, **common)
    wait_ready(gateway)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = asyncio.create_task(
                client.post(
                    f"{gateway.base_url}/v1/embeddings",
                    json={"input": "survives a crash"},
                    headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
                )
            )
            await eventually(  # read, computing, and its first attempt's wait exported
                lambda: (queue_counts(redis_url).pending, len(receiver.named("queue wait"))),
                15,
                "the doomed worker computing the entry",
                until=lambda seen: seen == (1, 1),
            )
            doomed.signal(signal.SIGKILL)
            processes.start("worker", env=env, **common)
            return await answer

    answer = asyncio.run(scenario())
    assert answer.status_code == 200, answer.text
    assert answer.headers["traceparent"].split("-")[1] == TRACE
    spans = wait_until(
        lambda: receiver.trace(TRACE),
        15,
        "the gateway's spans and the second attempt's",
        until=lambda s: {"POST /v1/embeddings", "process entry"} <= {x.name for x in s},
    )
    services = {(s.service, s.instance) for s in spans}
    assert {service for service, _ in services} == {"microbatch-gateway", "microbatch-worker"}
    assert len(services) == 3  # the gateway and two worker processes, each its own instance
    waits = sorted((s for s in spans if s.name == "queue wait"), key=lambda s: s.start_ns)
    assert [w.attributes["microbatch.deliveries"] for w in waits] == [1, 2]
    assert waits[0].instance != waits[1].instance  # the killed attempt, then the one that answered
    (entry,) = [s for s in spans if s.name == "process entry"]  # the killed one never ended
    assert entry.instance == waits[1].instance and entry.events[0][0] == "redelivered"
    (server,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert server.parent_id == PARENT and entry.parent_id == server.span_id
    (batch,) = wait_until(
        lambda: [s for s in receiver.named("batch") if (TRACE, entry.span_id) in s.links],
        15,
        "the batch span linking to the entry",
    )
    assert batch.trace_id != TRACE and batch.instance == entry.instance
    print(tree(receiver.trace(TRACE)))  # what docs/operations.md shows


def test_serve_traces_as_two_services_and_not_at_all_without_an_endpoint(
    receiver: Receiver, processes: Processes
) -> None:
    traced = processes.start("serve", model="noop", env=otel(receiver))
    untraced = processes.start("serve", model="noop")
    wait_ready(traced)
    wait_ready(untraced)
    headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
    for proc in (traced, untraced):
        answer = httpx.post(f"{proc.base_url}/v1/embeddings", json={"input": "x"}, headers=headers)
        assert answer.status_code == 200
    spans = wait_until(
        lambda: receiver.trace(TRACE),
        15,
        "serve's spans",
        until=lambda s: {"POST /v1/embeddings", "process entry"} <= {x.name for x in s},
    )
    assert {s.service for s in spans} == {"microbatch-gateway", "microbatch-worker"}
    assert (
        "traceparent" in httpx.post(f"{traced.base_url}/v1/embeddings", json={"input": "y"}).headers
    )
    # off by default: the other serve exported nothing and answers no traceparent
    assert len({s.instance for s in receiver.spans}) == 2
    assert (
        "traceparent"
        not in httpx.post(f"{untraced.base_url}/v1/embeddings", json={"input": "z"}).headers
    )
