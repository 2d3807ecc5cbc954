"""Metrics and `microbatch status` agree with what happened and with what Redis holds."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import redis
from typer.testing import CliRunner

from common.cli import app
from common.protocol import DeadLetter, ModelInfo, encode
from tests.conftest import Processes, wait_ready, wait_until


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text, labels matched exactly (order-free)."""
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if found == labels:
            return float(match.group(2))
    raise AssertionError(f"no sample {name}{labels}")


def after_a_refresh(base_url: str) -> str:
    """/metrics right after a catalog refresh (GET /readyz runs one): queue gauges as in Redis."""
    httpx.get(f"{base_url}/readyz", timeout=10)
    return httpx.get(f"{base_url}/metrics", timeout=10).text


def test_metrics_count_the_batches_that_ran(processes: Processes) -> None:
    # A long wait and a batch size of 4: eight simultaneous requests make two full batches.
    serve = processes.start("serve", model="noop", max_batch_size=4, max_wait_ms=2000)
    wait_ready(serve)

    async def eight() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=serve.base_url, timeout=30) as client:
            return await asyncio.gather(
                *(client.post("/v1/embeddings", json={"input": f"text {i}"}) for i in range(8))
            )

    responses = asyncio.run(eight())
    assert [r.status_code for r in responses] == [200] * 8
    assert {r.headers["x-microbatch-batch-size"] for r in responses} == {"4"}
    labels = {"model": "noop", "bucket": "128"}

    def settled(text: str) -> bool:  # the last acks and the last request's exit land just after
        return (
            sample(text, "microbatch_queue_depth", **labels) == 0
            and sample(text, "microbatch_queue_pending", **labels) == 0
            and sample(text, "microbatch_inflight_requests") == 0
        )

    # each look runs its own catalog refresh, so the queue gauges follow Redis
    text = wait_until(
        lambda: after_a_refresh(serve.base_url), 10, "an empty queue in the gauges", until=settled
    )
    assert sample(text, "microbatch_batch_size_count", **labels) == 2
    assert sample(text, "microbatch_batch_size_sum", **labels) == 8
    assert sample(text, "microbatch_padding_ratio_count", **labels) == 2
    assert sample(text, "microbatch_queue_wait_seconds_count", **labels) == 8
    route = {"route": "/v1/embeddings", "model": "noop"}
    assert sample(text, "microbatch_requests_total", **route, status="200") == 8
    assert sample(text, "microbatch_request_duration_seconds_count", **route) == 8
    assert sample(text, "microbatch_queue_depth", **labels) == 0
    assert sample(text, "microbatch_queue_pending", **labels) == 0
    assert sample(text, "microbatch_workers", model="noop") == 1
    assert sample(text, "microbatch_inflight_requests") == 0

    # one request of five texts is one queue entry: five rows batched, one wait observed
    bulk = httpx.post(
        f"{serve.base_url}/v1/embeddings",
        json={"input": [f"more {i}" for i in range(5)]},
        timeout=30,
    )
    assert bulk.status_code == 200
    text = httpx.get(f"{serve.base_url}/metrics", timeout=10).text
    assert sample(text, "microbatch_batch_size_sum", **labels) == 13
    assert sample(text, "microbatch_queue_wait_seconds_count", **labels) == 9


def test_status_reports_exactly_what_redis_holds(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    info = ModelInfo(
        name="m",
        kind="embedding",
        dim=4,
        max_tokens=512,
        vocab_size=10,
        tokenizer_sha256="x",
        chat_template="",
        bos_token="",
        eos_token="",
        aliases=[],
    )
    client.hset("mb:models", "m", encode(info))
    stream = "mb:{m}:req:256"
    client.xgroup_create(stream, "workers", id="0", mkstream=True)
    for i in range(5):
        client.xadd(stream, {"m": b"entry %d" % i})
    client.xreadgroup("workers", "w-1", {stream: ">"}, count=2)  # two in progress
    letter = DeadLetter(
        stream=stream, entry_id="1-0", reason="r", deliveries=3, payload=b"", worker="w"
    )
    client.xadd("mb:{m}:dead", {"m": encode(letter)})
    now_ms = int(time.time() * 1000)
    client.zadd("mb:{m}:workers", {"w-1": now_ms, "w-old": now_ms - 600_000})
    client.close()

    result = CliRunner().invoke(app, ["status", "--redis-url", redis_url, "--json"])
    assert result.exit_code == 0, result.output
    [model] = json.loads(result.output)
    assert model["model"] == "m" and model["dead_letters"] == 1 and model["live_workers"] == 1
    by_bucket = {b["bucket"]: b for b in model["buckets"]}
    assert by_bucket[256]["depth"] == 5
    assert by_bucket[256]["pending"] == 2
    assert by_bucket[256]["lag"] == 3 and by_bucket[256]["lag_from_redis"] is True
    assert by_bucket[256]["oldest_age_s"] is not None and by_bucket[256]["oldest_age_s"] < 60
    assert by_bucket[128]["depth"] == 0 and by_bucket[128]["oldest_age_s"] is None
    assert sorted((w["name"], w["live"]) for w in model["workers"]) == [
        ("w-1", True),
        ("w-old", False),
    ]

    table = CliRunner().invoke(app, ["status", "--redis-url", redis_url])
    assert table.exit_code == 0
    assert "w-1" in table.output and "stale" in table.output


def test_status_says_clearly_when_redis_is_unreachable() -> None:
    result = CliRunner().invoke(app, ["status", "--redis-url", "redis://:pw@127.0.0.1:1/0"])
    assert result.exit_code == 1
    assert "cannot read Redis" in result.output and "pw" not in result.output.replace("***", "")


def test_a_worker_serves_its_own_metrics_port(redis_url: str, processes: Processes) -> None:
    from tests.conftest import free_port

    port = free_port()
    processes.start("worker", redis_url=redis_url, model="noop", metrics_port=port)
    gateway = processes.start("gateway", redis_url=redis_url)
    wait_ready(gateway)
    ok = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "hi", "model": "noop"})
    assert ok.status_code == 200
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert sample(text, "microbatch_batch_size_count", model="noop", bucket="128") == 1
    utilization = sample(text, "microbatch_device_utilization")
    assert 0.0 <= utilization <= 1.0


def test_bench_against_a_live_gateway_writes_json_results_and_a_png(
    processes: Processes, tmp_path
) -> None:
    serve = processes.start("serve", model="noop", noop_compute_ms=2)
    wait_ready(serve)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            serve.base_url,
            "--model",
            "noop",
            "--duration",
            "2",
            "--clients",
            "4",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for field in (
        "requests_per_s",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "max_ms",
        "errors_by_status",
        "mean_batch_size",
        "padding_ratio",
    ):
        assert field in report, field
    assert report["ok"] == report["requests"] > 0 and report["errors_by_status"] == {}
    assert 0 <= report["padding_ratio"] < 1  # serve mode: batch metrics are on the gateway
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_live_batching_change_alters_the_batches_that_follow(
    redis_url: str, processes: Processes, tmp_path
) -> None:
    common = {"redis_url": redis_url, "model": "noop", "max_batch_size": 8, "max_wait_ms": 400}
    worker = processes.start("worker", **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    def applied(size: int) -> None:
        """Until the worker says so: it reads live settings on its next heartbeat."""
        line = f"batching limits now Limits(max_batch_size={size},"
        wait_until(
            lambda: line in worker.output(), 10, f"the worker applying max_batch_size {size}"
        )

    async def sizes_of_eight() -> set[int]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
            rs = await asyncio.gather(
                *(
                    client.post("/v1/embeddings", json={"input": f"t {i}", "model": "noop"})
                    for i in range(8)
                )
            )
        assert [r.status_code for r in rs] == [200] * 8
        return {int(r.headers["x-microbatch-batch-size"]) for r in rs}

    def tune(*args: str) -> None:
        result = CliRunner().invoke(
            app, ["tune", "--redis-url", redis_url, "--model", "noop", *args]
        )
        assert result.exit_code == 0, result.output

    assert asyncio.run(sizes_of_eight()) == {8}
    tune("--set", "max_batch_size=2")
    applied(2)
    assert max(asyncio.run(sizes_of_eight())) <= 2
    tune("--set", "clear")
    applied(8)
    assert asyncio.run(sizes_of_eight()) == {8}

    report = tmp_path / "tune.json"
    tune(
        "--url",
        gateway.base_url,
        "--waits",
        "0",
        "--sizes",
        "1,4",
        "--rate",
        "40",
        "--duration",
        "1.5",
        "--p99-target-ms",
        "5000",
        "--json",
        str(report),
    )
    rows = json.loads(report.read_text())["rows"]
    assert [(r["max_wait_ms"], r["max_batch_size"]) for r in rows] == [(0, 1), (0, 4)]
    assert rows[0]["mean_batch_size"] == 1
    assert json.loads(report.read_text())["best"] is not None


def test_the_request_id_is_carried_into_the_workers_batch_log_line(processes: Processes) -> None:
    serve = processes.start("serve", model="noop", log_level="debug")
    wait_ready(serve)
    r = httpx.post(
        f"{serve.base_url}/v1/embeddings",
        json={"input": "follow me"},
        headers={"X-Request-ID": "follow-me-123"},
        timeout=30,
    )
    assert r.status_code == 200

    def batch_lines() -> list[dict]:
        lines = [json.loads(line) for line in serve.output().splitlines() if line.startswith("{")]
        return [line for line in lines if line["msg"] == "batch"]

    logged = wait_until(batch_lines, 10, "the worker's batch log line", interval_s=0.1)
    [line] = [b for b in logged if "follow-me-123" in b["request_ids"]]
    assert (
        line["size"] == 1 and line["bucket"] == 128 and line["padded_tokens"] == line["real_tokens"]
    )
    assert {"max_wait_ms", "compute_ms", "trigger"} <= set(line)
