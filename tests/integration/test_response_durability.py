"""Responses outlive the processes that run them (issue 37's durability goal).

A background response streamed through one gateway, its worker SIGKILLed mid-answer, is
resumed through another gateway with `starting_after`: the events join without a gap or a
repeat, and the text equals the uninterrupted greedy text, token for token. The gateway that
queued a background run can die too: the run finishes and any gateway serves it. A streamed
foreground response continues past its worker's death instead of ending in error, since its
replacement says the same again. Real redis-server, real processes and signals.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import Proc, Processes, free_port, wait_ready, wait_until
from tests.integration.test_generation_faults import PATIENT, QUICK, wait_running
from worker.generate.tiny_model import TinyShape, write_tiny_model

LONG = 400  # tokens: seconds of generation on this model, so a kill lands mid-answer
ASK = {"input": "kalo mine sati", "max_output_tokens": LONG, "temperature": 0}


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = TinyShape(layers=4, hidden=256, intermediate=512, max_positions=4096)
    return write_tiny_model(tmp_path_factory.mktemp("slow") / "slow-llama", shape)


@pytest.fixture
def client() -> Iterator[Callable[[Proc], openai.OpenAI]]:
    """One `openai` client per gateway, closed when the test ends: a client left to the
    garbage collector leaves its pooled socket open."""
    made: dict[str, openai.OpenAI] = {}

    def get(gateway: Proc) -> openai.OpenAI:
        if gateway.base_url not in made:
            made[gateway.base_url] = openai.OpenAI(
                base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0, timeout=120
            )
        return made[gateway.base_url]

    yield get
    for each in made.values():
        each.close()


def _greedy(api: openai.OpenAI, model: str) -> str:
    """The same turn in the foreground, nothing killed: the text a resumed run must equal."""
    return api.responses.create(model=model, **ASK).output_text


def test_a_background_stream_survives_its_worker_and_resumes_elsewhere_token_exact(
    redis_url: str, processes: Processes, slow_model: Path, client
) -> None:
    common = {"redis_url": redis_url, "model": slow_model, **QUICK}
    port = free_port()
    doomed = processes.start("worker", metrics_port=port, **common)
    first = processes.start("gateway", **common, **PATIENT)
    second = processes.start("gateway", **common, **PATIENT)
    wait_ready(first)
    wait_ready(second)
    model = str(slow_model)
    stream = client(first).responses.create(model=model, background=True, stream=True, **ASK)
    seen = []
    for event in stream:
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) >= 5:
            break
    wait_running(f"http://127.0.0.1:{port}/metrics", 1)
    doomed.signal(signal.SIGKILL)
    stream.close()
    assert not any(e.type.startswith("response.completed") for e in seen)
    processes.start("worker", **common)
    resumed = list(
        client(second).responses.retrieve(
            seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number
        )
    )
    whole = seen + resumed
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[-1].type in ("response.completed", "response.incomplete"), whole[-1]
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert text == whole[-1].response.output_text
    assert text == _greedy(client(second), model)
    stored = client(first).responses.retrieve(seen[0].response.id)
    assert stored.output_text == text and stored.usage.output_tokens == LONG


def test_a_background_run_outlives_the_gateway_that_queued_it(
    redis_url: str, processes: Processes, slow_model: Path, client
) -> None:
    common = {"redis_url": redis_url, "model": slow_model, **QUICK}
    processes.start("worker", **common)
    doomed = processes.start("gateway", **common, **PATIENT)
    other = processes.start("gateway", **common, **PATIENT)
    wait_ready(doomed)
    wait_ready(other)
    model = str(slow_model)
    made = client(doomed).responses.create(model=model, background=True, **ASK)
    doomed.signal(signal.SIGKILL)
    done = wait_until(
        lambda: client(other).responses.retrieve(made.id),
        120,
        "the background response finished",
        until=lambda r: r.status in ("completed", "incomplete", "failed"),
    )
    assert done.status in ("completed", "incomplete"), done.error
    assert done.output_text == _greedy(client(other), model)


def test_a_foreground_stream_continues_past_its_workers_death(
    redis_url: str, processes: Processes, slow_model: Path, client
) -> None:
    common = {"redis_url": redis_url, "model": slow_model, **QUICK}
    port = free_port()
    doomed = processes.start("worker", metrics_port=port, **common)
    gateway = processes.start("gateway", **common, **PATIENT)
    wait_ready(gateway)
    model = str(slow_model)
    events: list = []
    deltas = threading.Event()

    def read() -> None:
        for event in client(gateway).responses.create(model=model, stream=True, **ASK):
            events.append(event)
            if sum(e.type == "response.output_text.delta" for e in events) >= 5:
                deltas.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert deltas.wait(60)
    doomed.signal(signal.SIGKILL)
    processes.start("worker", **common)
    reader.join(150)
    assert not reader.is_alive()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == _greedy(client(gateway), model)
