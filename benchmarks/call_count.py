"""Python function calls per embeddings request, on every thread: a deterministic cost figure.

    PYTHONPATH=<tree> .venv/bin/python benchmarks/call_count.py [--requests 200] [--key KEY]

`serve`'s composition in one process (gateway, `noop` worker, embedded store, uvicorn on a
free port), background loops slowed to a crawl, as `request_path.py` runs it. Every call
(Python and C) on every thread is counted from the first of `--requests` requests to the
last answer, tracing's export flushed inside the window, so what tracing costs in a
background thread is counted too. Tracing is on as the standard OTEL_* environment says,
for trees that have it (`common/tracing.py`). Prints one JSON line: calls per request.
`--key` sends it as the API key (settings from MICROBATCH_*, a tenants file among them).
A wall-clock figure on a shared 2-core host drifts by more than a few per cent between
runs; a count of calls does not, so `tracing_cost.py` and `tenant_cost.py` print both.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.request_path import _free_port, _ready


class Counter:
    def __init__(self) -> None:
        self.calls = 0
        self.on = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.on and event in ("call", "c_call"):
            self.calls += 1


def _tracers() -> tuple[Any, Any, list[Any]]:
    """The gateway's and the worker's tracers, as `microbatch serve` starts them."""
    try:
        from common import tracing
    except ImportError:  # a tree from before tracing
        return None, None, []
    gateway, worker = tracing.start("gateway"), tracing.start("worker")
    started = [t for t in (gateway, worker) if t is not None]
    return (gateway and gateway.tracer), (worker and worker.tracer), started


async def _measure(requests: int, key: str | None = None) -> float:
    import uvicorn

    from common.settings import Settings
    from common.store import open_store
    from gateway.app import create_app
    from worker.main import run_worker

    counter = Counter()
    sys.setprofile(counter)
    threading.setprofile(counter)
    settings = Settings(
        model="noop", port=_free_port(), heartbeat_interval_ms=60_000, worker_stale_ms=600_000,
        cancel_poll_ms=60_000, claim_idle_ms=600_000, read_block_ms=1000,
        request_timeout_ms=600_001, max_request_timeout_ms=600_001,
    )  # fmt: skip
    store = open_store(settings)
    gateway_tracer, worker_tracer, started = _tracers()
    traced = {"tracer": worker_tracer} if worker_tracer is not None else {}
    app = (
        create_app(settings, store, gateway_tracer)
        if gateway_tracer
        else create_app(settings, store)
    )
    server = uvicorn.Server(uvicorn.Config(app, port=settings.port, log_level="warning"))
    stop = asyncio.Event()
    tasks = [
        asyncio.ensure_future(server.serve()),
        asyncio.ensure_future(run_worker(settings, stop, store, **traced)),
    ]  # (a benchmark: both are awaited below)
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"http://127.0.0.1:{settings.port}"
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as c:
        while not await _ready(c):
            await asyncio.sleep(0.2)
        for _ in range(5):  # warm: lazy imports and first calls are not the path
            (await c.post("/v1/embeddings", json={"input": "warm"})).raise_for_status()
        for t in started:
            t.provider.force_flush()
        counter.on = True
        for i in range(requests):
            (await c.post("/v1/embeddings", json={"input": f"text {i}"})).raise_for_status()
        await asyncio.sleep(0.05)  # the last entry's span ends just after its answer
        for t in started:
            t.provider.force_flush()
        counter.on = False
    server.should_exit = True
    stop.set()
    await asyncio.gather(*tasks)
    for t in started:
        t.shutdown()
    return counter.calls / requests


def main() -> None:
    requests = int(sys.argv[sys.argv.index("--requests") + 1]) if "--requests" in sys.argv else 200
    key = sys.argv[sys.argv.index("--key") + 1] if "--key" in sys.argv else None
    print(json.dumps({"calls_per_request": round(asyncio.run(_measure(requests, key)), 1)}))


if __name__ == "__main__":
    main()
