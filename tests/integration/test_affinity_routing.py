"""Cache-aware routing between two generation workers, with real processes and signals.

A conversation's next turn reaches the worker that answered its previous one (and hits its
prefix cache there); an explicit session key pins a conversation; and a prompt routed to a
worker that then stops (SIGSTOP: no beats, no reads) is adopted from its stream by the peer
and answered, exactly as generate() would.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Processes, wait_ready, wait_workers
from tests.integration.test_generation import metric, reference_greedy

QUICK = {"claim_idle_ms": 1000, "heartbeat_interval_ms": 200, "worker_stale_ms": 1000}


def complete(base: str, prompt: list[int], n: int, **headers: str) -> tuple[dict, str]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json(), r.headers["x-microbatch-worker"]


@pytest.fixture
def two_workers(redis_url: str, processes: Processes, tiny_model: Path):
    common = {"redis_url": redis_url, "model": tiny_model, "dtype": "float32", **QUICK}
    workers = [processes.start("worker", worker_id=f"w{i}", **common) for i in range(2)]
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    # /readyz refreshes the catalog; a beat writes liveness and load at once: both loads seen
    wait_workers(gateway, str(tiny_model), 2)
    return (
        gateway,
        workers,
        f'microbatch_affinity_routes_total{{model="{tiny_model}",route="affine"}}',
    )


def test_each_conversations_next_turn_reaches_the_worker_caching_it(two_workers) -> None:
    gateway, _, affine = two_workers
    base = gateway.base_url
    histories = {c: [*range(10, 90), *range(100 + 20 * c, 110 + 20 * c)] for c in range(6)}
    served: dict[int, set[str]] = {c: set() for c in histories}
    cached = prompt = 0
    for turn in range(3):
        for c, history in histories.items():
            answer, worker = complete(base, history, 6)
            served[c].add(worker)
            if turn:
                cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt += answer["usage"]["prompt_tokens"]
            history += [*answer["choices"][0]["token_ids"], 200 + turn, 201 + turn]
    assert all(len(workers) == 1 for workers in served.values()), served
    assert cached / prompt > 0.8
    routed = metric(f"{base}/metrics", affine)
    assert routed >= 12  # every later turn


def test_a_session_key_pins_its_conversation(two_workers) -> None:
    gateway, _, _ = two_workers
    base = gateway.base_url
    session = {"X-Microbatch-Session": "s1"}
    workers = {complete(base, [5 + i, 6, 7], 2, **session)[1] for i in range(5)}
    assert len(workers) == 1  # five unrelated prompts, one session, one worker


def test_a_prompt_routed_to_a_stopped_worker_is_adopted_by_its_peer(
    two_workers, tiny_model: Path
) -> None:
    gateway, procs, affine = two_workers
    base = gateway.base_url
    history = list(range(30, 120))
    answer, owner = complete(base, history, 4)
    history += [*answer["choices"][0]["token_ids"], 7, 8]
    stopped = procs[int(owner.removeprefix("w"))]
    before = metric(f"{base}/metrics", affine)
    stopped.signal(signal.SIGSTOP)  # alive to the gateway for up to worker_stale_ms
    try:
        started = time.monotonic()
        again, worker = complete(base, history, 5)
        assert metric(f"{base}/metrics", affine) == before + 1  # it was sent to the owner
        assert worker != owner
        assert time.monotonic() - started < 20
        assert again["choices"][0]["token_ids"] == reference_greedy(tiny_model, [history], [5])[0]
    finally:
        stopped.signal(signal.SIGCONT)
