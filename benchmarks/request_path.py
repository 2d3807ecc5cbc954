"""Which of the project's modules one embeddings request runs code in, from HTTP in to HTTP out.

    .venv/bin/python benchmarks/request_path.py            # the count, then the modules

`serve`'s composition in one process (gateway, `noop` worker, embedded store, uvicorn on a
free port), background loops slowed to a crawl; every Python call on every thread is
profiled while one request goes through over real HTTP. A module counts when a function of
it was called (a coroutine counts when it starts, not each time it resumes) for every one
of `--requests` requests (the intersection), so a background tick that
lands inside one request's window does not count. Prints the count and the modules in the
order they first ran.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import socket
import sys
import threading
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / p) + "/" for p in ("common", "gateway", "worker"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module_of(filename: str) -> str | None:
    if not filename.startswith(PACKAGES):
        return None
    return str(Path(filename).relative_to(ROOT).with_suffix("")).replace("/", ".")


RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


class Recorder:
    """Modules with a function called (not merely resumed) while `on`.

    The profiler reports a coroutine's every resumption as a call, so a loop that started
    long before the request (`run_worker` awaiting its consumer) would count whenever it
    wakes; a coroutine frame counts only at its first start. The frames seen are kept, so
    their ids cannot be reused within the run.
    """

    def __init__(self) -> None:
        self.order: dict[str, None] = {}
        self.on = False
        self._started: set[object] = set()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        if frame.f_code.co_flags & RESUMABLE:
            if frame in self._started:
                return  # resumed, not called
            self._started.add(frame)
        if self.on:
            module = _module_of(frame.f_code.co_filename)
            if module is not None and module not in self.order:
                self.order[module] = None


async def _ready(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False  # not listening yet


async def _measure(requests: int) -> list[dict[str, None]]:
    import uvicorn

    from common.settings import Settings
    from common.store import open_store
    from gateway.app import create_app
    from worker.main import run_worker

    recorder = Recorder()  # on every thread from the start: compute threads start later
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    settings = Settings(
        model="noop",
        port=_free_port(),
        heartbeat_interval_ms=60_000,
        worker_stale_ms=600_000,
        cancel_poll_ms=60_000,
        claim_idle_ms=600_000,
        request_timeout_ms=600_001,
        max_request_timeout_ms=600_001,
        read_block_ms=1000,
    )
    store = open_store(settings)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, store), port=settings.port, log_level="warning")
    )
    stop = asyncio.Event()
    tasks = [
        asyncio.ensure_future(server.serve()),
        asyncio.ensure_future(run_worker(settings, stop, store)),
    ]
    # (a benchmark, not the service: its two tasks are awaited below, nothing is left bare)
    url = f"http://127.0.0.1:{settings.port}"
    runs = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not await _ready(client):
            await asyncio.sleep(0.2)
        for _ in range(3):  # warm: lazy imports and first-call set-up are not the path
            (await client.post("/v1/embeddings", json={"input": "warm"})).raise_for_status()
        for i in range(requests):
            recorder.order = {}
            recorder.on = True
            answer = await client.post("/v1/embeddings", json={"input": f"text {i}"})
            recorder.on = False
            answer.raise_for_status()
            runs.append(recorder.order)
    server.should_exit = True
    stop.set()
    await asyncio.gather(*tasks)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    runs = asyncio.run(_measure(args.requests))
    every = set.intersection(*(set(r) for r in runs))
    path = [m for m in runs[0] if m in every]
    print(f"modules crossed by one embeddings request: {len(path)}")
    for module in path:
        print(f"  {module}")


if __name__ == "__main__":
    main()
