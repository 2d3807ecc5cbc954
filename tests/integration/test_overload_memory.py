"""Sustained overload: the gateway refuses fast with Retry-After and its memory stays flat.

A small, generous version of `benchmarks/overload.py` (which measures all three processes at
ten times the sustainable rate with a lighter client): five times what the worker can serve,
for eight seconds, at a rate the httpx client keeps up with on two shared cores.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import threading
from collections import Counter
from pathlib import Path

import httpx

from common.cli import loadgen
from tests.conftest import Processes, eventually, wait_ready
from tests.integration.test_observability import sample

# Observed on the test host: 0.40 MB of growth and refusals of 2.2-2.5 ms at the median
# against served requests' ~1 s (the queue's 20 entries at 20 a second); the memory bound
# leaves 10x (a leak of 6 KB per refused request would pass 150 MB, the old bound, but not
# this one); a refusal must take under a quarter of a served request's time (a refusal after
# a wait in the queue would take as long), which leaves room for a starved client's delay.
RSS_GROWTH_BOUND_MB = 4.0
REFUSAL_SHARE = 0.25
SUSTAINABLE_PER_S = 20  # four entries per 200 ms batch


def rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) / 1024


class PeakRss(threading.Thread):
    """The highest RSS seen, sampled every quarter second on its own thread."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_mb = rss_mb(pid)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))


async def _refused(url: str) -> float:
    """How many requests the gateway has refused for a full queue so far."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        text = (await client.get("/metrics")).text
    try:
        return sample(text, "microbatch_rejected_total", reason="queue_full")
    except AssertionError:  # no sample until the first refusal
        return 0.0


async def _refusal(url: str) -> httpx.Response:
    """A refused request's answer. One probe can land just as a batch frees queue slots, and
    on a loaded host the load itself may not keep the queue full (CI saw ten probes in a row
    admitted), so the probes come at once: more than `max_queue_depth` of them cannot all
    be admitted, whatever the load does."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/embeddings", json={"input": "one more"}) for _ in range(30))
        )
    return next((a for a in answers if a.status_code != 200), answers[-1])


def test_sustained_overload_is_refused_fast_and_the_gateway_memory_stays_bounded(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", "max_queue_depth": 20}
    # one batch at a time, so what it can serve is known
    processes.start("worker", noop_compute_ms=200, max_batch_size=4, compute_streams=1, **common)
    gateway = processes.start("gateway", log_level="error", **common)
    wait_ready(gateway)
    bodies = [{"input": t} for t in loadgen.workload("short", 200)]
    # Warm up so what the first requests allocate once is not counted as growth.
    asyncio.run(loadgen.open_loop(gateway.base_url, bodies, rate=20, duration_s=2))
    start_mb = rss_mb(gateway.popen.pid)
    peak = PeakRss(gateway.popen.pid)
    peak.start()

    async def overload() -> tuple[list[loadgen.Sample], httpx.Response]:
        before = await _refused(gateway.base_url)  # the warm-up's, if any
        load = asyncio.create_task(
            loadgen.open_loop(gateway.base_url, bodies, rate=5 * SUSTAINABLE_PER_S, duration_s=8)
        )
        await eventually(  # the queue is full: the gateway has started refusing
            lambda: _refused(gateway.base_url), 8, "refusals", until=lambda n: n > before
        )
        refused = await _refusal(gateway.base_url)
        samples, _ = await load
        return samples, refused

    samples, refused = asyncio.run(overload())
    peak.done.set()
    peak.join()

    statuses = Counter(s.status for s in samples)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[503] > statuses[200] > 0, statuses
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    refusal_s = statistics.median(s.latency_s for s in samples if s.status == 503)
    served_s = statistics.median(s.latency_s for s in samples if s.status == 200)
    # refused at admission, not after a wait in the queue: judged against the served ones of
    # the same run and client, as a host running two more test processes can slow the client
    # itself by a hundred times (213 ms at the median once, on a clean-clone CI run)
    assert refusal_s < served_s * REFUSAL_SHARE, (
        f"a refusal took {refusal_s * 1000:.0f} ms at the median, a served request "
        f"{served_s * 1000:.0f} ms"
    )
    growth_mb = peak.peak_mb - start_mb
    assert growth_mb < RSS_GROWTH_BOUND_MB, f"gateway RSS grew {growth_mb:.0f} MB"
