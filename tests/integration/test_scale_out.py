"""Several gateways and workers on one Redis: replies reach the gateway that asked."""

from __future__ import annotations

import asyncio
import re

import httpx
import redis

from tests.conftest import Processes, fire, wait_ready, wait_workers


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_two_gateways_two_workers_every_reply_reaches_its_gateway(
    redis_url: str, processes: Processes
) -> None:
    # noop with a simulated 5 ms per batch: cheap, yet slow enough that both workers share load
    common = {"redis_url": redis_url, "model": "noop", "noop_compute_ms": 5, "max_batch_size": 8}
    for _ in range(2):
        processes.start("worker", **common)
    gateways = [processes.start("gateway", **common) for _ in range(2)]
    for gw in gateways:
        wait_ready(gw)
    wait_workers(gateways[0], "noop", 2)

    # Each request has its own token count, so a reply routed to the wrong request shows up.
    per_gateway = 150
    plans = {
        gw.base_url: [
            {"input": [[101] + [7] * (g * per_gateway + i) + [102]]} for i in range(per_gateway)
        ]
        for g, gw in enumerate(gateways)
    }

    async def both() -> dict[str, list[httpx.Response]]:
        results = await asyncio.gather(*(fire(url, bodies) for url, bodies in plans.items()))
        return dict(zip(plans, results, strict=True))

    answers = asyncio.run(both())
    workers_seen = set()
    for url, responses in answers.items():
        assert [r.status_code for r in responses] == [200] * per_gateway
        for body, r in zip(plans[url], responses, strict=True):
            assert r.json()["usage"]["prompt_tokens"] == len(body["input"][0])
            workers_seen.add(r.headers["x-microbatch-worker"])
    assert len(workers_seen) == 2, "both workers should have served part of the load"

    for gw in gateways:
        text = httpx.get(f"{gw.base_url}/metrics").text
        assert metric(text, "microbatch_duplicate_replies_total") == 0
    client = redis.Redis.from_url(redis_url)
    # Entries are deleted on ack: nothing left waiting or pending anywhere.
    for key in client.scan_iter("mb:{noop}:req:*"):
        assert client.xlen(key) == 0
        assert client.xpending(key, "workers")["pending"] == 0
    assert client.xlen("mb:{noop}:dead") == 0
    client.close()
