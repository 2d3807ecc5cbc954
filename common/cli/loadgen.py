"""Load generation against a running gateway: workloads, closed and open loops, summaries.

Used by `microbatch bench` and `microbatch tune`. Closed loop: N clients, each sending its next
request when the last is answered. Open loop: Poisson arrivals at a fixed rate, whatever the
answers do, so queueing shows up as latency instead of hiding as a lower offered load.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.tasks import spawn_supervised

# Each of these is one token for BERT-style vocabularies, so n words + [CLS] + [SEP] = n + 2.
WORDS = [
    "the",
    "queue",
    "groups",
    "short",
    "requests",
    "so",
    "the",
    "model",
    "sees",
    "fuller",
    "groups",
    "and",
    "fewer",
    "calls",
    "while",
    "every",
    "client",
    "waits",
    "less",
    "for",
    "its",
    "answer",
    "from",
    "the",
    "worker",
]
MIXES = {
    "short": [(1.0, 8, 48)],
    "mixed": [(0.60, 8, 48), (0.25, 49, 200), (0.15, 201, 500)],
    "long": [(1.0, 201, 500)],
}
MAX_IN_FLIGHT = 10_000  # an open loop stops adding work past this rather than exhaust memory


def workload(name: str, n: int, seed: int = 0) -> list[str]:
    """`n` texts with the token-length mix `name`, or the lines of a file if `name` is a path."""
    if name not in MIXES:
        lines = [line.strip() for line in Path(name).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"workload file {name} has no texts")
        return [lines[i % len(lines)] for i in range(n)]
    rng = random.Random(seed)
    weights = [w for w, _, _ in MIXES[name]]
    texts = []
    for _ in range(n):
        _, low, high = rng.choices(MIXES[name], weights)[0]
        texts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high) - 2)))
    return texts


@dataclass(frozen=True, slots=True)
class Sample:
    start_s: float  # since the run began
    latency_s: float
    status: int  # HTTP status, 0 for a transport error
    batch_size: int | None


async def _one(client: httpx.AsyncClient, body: dict, t0: float, headers: dict) -> Sample:
    start = time.perf_counter()
    try:
        r = await client.post("/v1/embeddings", json=body, headers=headers)
        status = r.status_code
        size = r.headers.get("x-microbatch-batch-size")
    except httpx.HTTPError:
        status, size = 0, None
    end = time.perf_counter()
    return Sample(start - t0, end - start, status, int(size) if size else None)


def _client(url: str, connections: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)


async def closed_loop(
    url: str,
    bodies: Sequence[dict],
    *,
    clients: int,
    duration_s: float,
    headers: dict | None = None,
    on_sample: Callable[[Sample], None] | None = None,
) -> tuple[list[Sample], float]:
    samples: list[Sample] = []
    t0 = time.perf_counter()
    stop_at = t0 + duration_s

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            sample = await _one(client, bodies[i % len(bodies)], t0, headers or {})
            samples.append(sample)
            if on_sample:
                on_sample(sample)
            i += clients

    async with _client(url, clients, 120) as client:
        await asyncio.gather(*(client_loop(client, k) for k in range(clients)))
    return samples, time.perf_counter() - t0


async def open_loop(
    url: str,
    bodies: Sequence[dict],
    *,
    rate: float,
    duration_s: float,
    seed: int = 0,
    headers: dict | None = None,
    on_sample: Callable[[Sample], None] | None = None,
) -> tuple[list[Sample], float]:
    """Poisson arrivals at `rate` per second for `duration_s`, then wait for the answers."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    tasks: set[asyncio.Task] = set()
    t0 = time.perf_counter()
    next_at = t0

    def record(task: asyncio.Task) -> None:
        tasks.discard(task)
        samples.append(task.result())
        if on_sample:
            on_sample(task.result())

    async with _client(url, 1024, 120) as client:
        i = 0
        while next_at < t0 + duration_s:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if len(tasks) < MAX_IN_FLIGHT:
                one = _one(client, bodies[i % len(bodies)], t0, headers or {})
                task = spawn_supervised("load-request", one, _gathered_below)
                task.add_done_callback(record)
                tasks.add(task)
            i += 1
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.gather(*tasks)
    return samples, time.perf_counter() - t0


def _gathered_below(exc: BaseException | None) -> None:
    """A request task that fails is logged by the supervisor and re-raised by the gather."""


def summarize(samples: Sequence[Sample], elapsed_s: float) -> dict:
    ok = sorted(s.latency_s for s in samples if s.status == 200)

    def pct(q: float) -> float | None:
        return ok[min(len(ok) - 1, int(q * len(ok)))] * 1000 if ok else None

    sizes = [s.batch_size for s in samples if s.batch_size]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "elapsed_s": elapsed_s,
        "requests_per_s": len(ok) / elapsed_s if elapsed_s else 0.0,
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": ok[-1] * 1000 if ok else None,
        "errors_by_status": {
            str(k): v for k, v in Counter(s.status for s in samples).items() if k != 200
        },
        "mean_batch_size": statistics.fmean(sizes) if sizes else None,
    }


def padding_from_metrics(text: str) -> tuple[float, float]:
    """(sum, count) of `microbatch_padding_ratio` over every label set in a /metrics page."""
    total = count = 0.0
    for name, value in re.findall(
        r"^microbatch_padding_ratio_(sum|count)\{[^}]*\} (\S+)$", text, re.M
    ):
        if name == "sum":
            total += float(value)
        else:
            count += float(value)
    return total, count


async def metrics_page(url: str) -> str:
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return (await client.get("/metrics")).text
    except httpx.HTTPError:
        return ""
