"""A bug in a gateway background task fails the requests waiting on it at once, not at their
deadline: the queue writer and the reply reader are supervised.

The gateway runs in-process under a real uvicorn server, against a real redis-server, with a
real `noop` worker process; the store seam wraps the real client and raises a plain
RuntimeError (a bug, not a RedisError) where a test arms it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from common.settings import Settings
from common.store import close_store, open_store
from gateway.app import create_app
from tests.conftest import Processes, free_port, wait_until

DEADLINE_MS = "60000"  # far beyond every wait below: an answer before it is not the deadline
# "At once": these answers took 20-110 ms on the test host; 1 s leaves a 9x margin and is
# still far from any timeout that could give the same answer (5 s, 60 s).
AT_ONCE_S = 1.0


class FaultyPipeline:
    def __init__(self, inner: Any, store: FaultyStore) -> None:
        self._inner = inner
        self._store = store
        self._adds = 0

    def xadd(self, *args: Any, **kwargs: Any) -> Any:
        self._adds += 1
        return self._inner.xadd(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def execute(self) -> Any:
        if self._adds and self._store.fail_enqueue:
            raise RuntimeError("injected bug in the queue writer")
        result = await self._inner.execute()
        if self._adds and self._store.break_reader_after_enqueue:
            self._store.fail_reads = True  # the request now waits on the reply reader
        return result


class FaultyStore:
    """The real redis-asyncio client, with bugs to arm."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_enqueue = False
        self.fail_reads = False
        self.break_reader_after_enqueue = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def pipeline(self) -> FaultyPipeline:
        return FaultyPipeline(self.inner.pipeline(transaction=False), self)

    async def xadd(self, *args: Any, **kwargs: Any) -> Any:
        """The queue writer's call for a single entry (a pipeline for several)."""
        if self.fail_enqueue:
            raise RuntimeError("injected bug in the queue writer")
        result = await self.inner.xadd(*args, **kwargs)
        if self.break_reader_after_enqueue:
            self.fail_reads = True  # the request now waits on the reply reader
        return result

    async def xread(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail_reads:
            raise RuntimeError("injected bug in the reply reader")
        return await self.inner.xread(*args, **kwargs)


@contextlib.contextmanager
def gateway_in_thread(settings: Settings, store: FaultyStore) -> Iterator[str]:
    """`create_app` served by uvicorn on its own thread and event loop; its base URL."""
    import uvicorn

    app = create_app(settings, store)
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_config=None)
    server = uvicorn.Server(config)

    def serve() -> None:
        async def main() -> None:
            try:
                await server.serve()
            finally:
                await close_store(store.inner)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        _wait_ready(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    def readyz() -> int | None:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/readyz", timeout=2).status_code
        return None  # not listening yet

    wait_until(
        readyz,
        timeout_s,
        f"the in-process gateway at {url} ready",
        until=lambda status: status == 200,
        interval_s=0.1,
    )


def _settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, model="noop", port=free_port(), read_block_ms=100)


def _embed(url: str) -> httpx.Response:
    headers = {"X-Microbatch-Timeout-Ms": DEADLINE_MS}
    return httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers=headers, timeout=20)


def test_a_bug_in_the_queue_writer_fails_its_requests_at_once(
    redis_url: str, processes: Processes
) -> None:
    processes.start("worker", redis_url=redis_url, model="noop")
    settings = _settings(redis_url)
    store = FaultyStore(open_store(settings))
    with gateway_in_thread(settings, store) as url:
        store.fail_enqueue = True
        started = time.monotonic()
        failed = _embed(url)
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["code"] == "internal_error"
        assert time.monotonic() - started < AT_ONCE_S  # the deadline is 60 s away
        store.fail_enqueue = False  # the next request gets a new queue writer
        answered = _embed(url)
        assert answered.status_code == 200, answered.text


def test_a_bug_in_the_reply_reader_fails_waiting_requests_at_once(
    redis_url: str, processes: Processes
) -> None:
    # the worker answers after 5 s: a 503 before then can only come from the dead reader
    processes.start("worker", redis_url=redis_url, model="noop", noop_compute_ms=5000)
    settings = _settings(redis_url)
    store = FaultyStore(open_store(settings))
    with gateway_in_thread(settings, store) as url:
        store.break_reader_after_enqueue = True
        started = time.monotonic()
        waiting = _embed(url)
        assert time.monotonic() - started < AT_ONCE_S  # the worker answers after 5 s
        assert waiting.status_code == 503, waiting.text
        assert "reply reader" in waiting.json()["error"]["message"]
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 503
        started = time.monotonic()
        later = _embed(url)  # refused at once: nothing could deliver its answer
        assert later.status_code == 503, later.text
        assert time.monotonic() - started < AT_ONCE_S
