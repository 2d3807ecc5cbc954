"""A worker SIGKILLed mid-generation: every request still gets exactly one clear outcome.

A whole (non-streamed) answer is completed by a peer; a stream that already relayed text ends
with an error event rather than repeating it; a stream that had relayed nothing completes as
if nothing had happened. Real redis-server, real processes and signals, a random Llama big
enough that 1,500 tokens take seconds.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import (
    Processes,
    eventually,
    free_port,
    queue_counts,
    wait_ready,
    wait_until,
    wait_workers,
)
from tests.engines import ENGINES
from tests.integration.test_generation import metric
from tests.proc_tree import descendants
from worker.generate.tiny_model import TinyShape, write_tiny_model

QUICK = {"claim_idle_ms": 1000, "heartbeat_interval_ms": 200}
LONG = 1500
# 1,500 tokens, a worker's restart and the whole answer again take over the default 30 s
# deadline on a slow host: the tests are about who answers, not how fast.
PATIENT = {"request_timeout_ms": 180_000}


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = TinyShape(layers=4, hidden=256, intermediate=512, max_positions=4096)
    return write_tiny_model(tmp_path_factory.mktemp("slow") / "slow-llama", shape)


# vLLM's engine starts in tens of seconds, twice per test (the doomed worker, its peer)
ENGINE_CASES = [
    pytest.param(e, marks=[pytest.mark.timeout(300)] if e == "vllm" else []) for e in ENGINES
]


def engine_settings(engine: str) -> dict:
    """The worker settings of one engine; vLLM's KV cache sized small (its CPU backend would
    otherwise reserve most of the host's memory) and its start given time to compile."""
    if engine == "microbatch":
        return {}
    return {"engine": "vllm", "kv_cache_tokens": 16_384}


def wait_running(metrics_url: str, count: int, timeout: float = 30.0) -> None:
    wait_until(
        lambda: metric(metrics_url, "microbatch_running_sequences"),
        timeout,
        f"{count} sequences running",
        until=lambda n: n >= count,
    )


async def read_stream(client: httpx.AsyncClient, body: dict, events: list) -> None:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else orjson.loads(data))


def text_events(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict) and "choices" in e]


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_a_whole_generation_and_a_stream_that_sent_nothing_survive_their_worker(
    redis_url: str, processes: Processes, slow_model: Path, engine: str
) -> None:
    common = {"redis_url": redis_url, "model": slow_model, **QUICK, **engine_settings(engine)}
    processes.cold = engine == "vllm"  # vLLM spawns its engine: a fresh interpreter, not a fork
    port = free_port()
    # One sequence at a time: the stream waits, unsent, behind the whole answer.
    doomed = processes.start("worker", metrics_port=port, max_running_seqs=1, **common)
    gateway = processes.start("gateway", **common, **PATIENT)
    wait_ready(gateway)
    whole_body = {"prompt": "kalo mine", "max_tokens": LONG, "temperature": 0}
    stream_body = {"prompt": "sati vobe", "max_tokens": 20, "temperature": 0}

    engine_processes: list[int] = []

    async def scenario() -> tuple[httpx.Response, list]:
        events: list = []
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:
            whole = asyncio.create_task(client.post("/v1/completions", json=whole_body))
            await asyncio.to_thread(wait_running, f"http://127.0.0.1:{port}/metrics", 1)
            stream = asyncio.create_task(read_stream(client, stream_body, events))
            await eventually(  # the stream's entry is read and held, not started
                lambda: queue_counts(redis_url, str(slow_model)),
                30,
                "the worker holding the stream's entry too",
                until=lambda q: q.pending == 2,
            )
            assert not events
            engine_processes.extend(descendants(doomed.popen.pid))
            doomed.signal(signal.SIGKILL)
            processes.start("worker", **common)
            response = await whole
            await stream
        return response, events

    response, events = asyncio.run(scenario())
    # vLLM's engine and model processes die with their worker, not left holding the memory
    wait_until(
        lambda: [p for p in engine_processes if Path(f"/proc/{p}").exists()],
        30,
        "the dead worker's engine processes gone",
        until=lambda alive: not alive,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == LONG
    assert not response.headers["x-microbatch-worker"].endswith(str(doomed.popen.pid))
    assert events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    alone = httpx.post(f"{gateway.base_url}/v1/completions", json=stream_body, timeout=60)
    streamed = "".join(e["choices"][0]["text"] for e in text_events(events))
    assert streamed == alone.json()["choices"][0]["text"]


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_a_stream_whose_worker_dies_after_sending_text_ends_with_an_error_not_repeats(
    redis_url: str, processes: Processes, slow_model: Path, engine: str
) -> None:
    common = {"redis_url": redis_url, "model": slow_model, **QUICK, **engine_settings(engine)}
    processes.cold = engine == "vllm"
    doomed = processes.start("worker", **common)
    gateway = processes.start("gateway", **common, **PATIENT)
    wait_ready(gateway)
    body = {"prompt": "kalo mine", "max_tokens": LONG, "temperature": 0}

    async def scenario() -> list:
        events: list = []
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:
            stream = asyncio.create_task(read_stream(client, body, events))
            await eventually(
                lambda: len(text_events(events)),
                60,
                "three streamed text events",
                until=lambda n: n >= 3,
                interval_s=0.01,
            )
            doomed.signal(signal.SIGKILL)
            processes.start("worker", **common)
            await asyncio.wait_for(stream, 90)
        return events

    events = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "worker_failed", errors
    assert events[-2] is errors[0]  # nothing after the error but [DONE]
    relayed = text_events(events)
    assert all(e["choices"][0]["finish_reason"] is None for e in relayed)
    wait_workers(gateway, str(slow_model), 1)
