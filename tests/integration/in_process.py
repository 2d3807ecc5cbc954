"""A deployment on one event loop on a thread: gateways (uvicorn over `create_app`) and
workers (`run_worker`), each with its own store, over a real redis-server. What a scenario
needs of a fleet, without process starts; `stop_gateway` ends one gateway as SIGTERM would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import httpx
import uvicorn

from common.settings import Settings
from common.store import close_store, open_store
from gateway.app import create_app
from tests.conftest import wait_until
from worker.main import run_worker


class InProcess:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: dict[str, tuple[uvicorn.Server, Any]] = {}
        self._workers: list[tuple[asyncio.Event, Any]] = []
        self._drain_s: dict[str, int] = {}
        self.failures: list[BaseException | None] = []  # what ended a worker early

    def _run(self, coro: Any, timeout_s: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start_gateway(self, settings: Settings, tracer: Any = None) -> str:
        async def start() -> tuple[uvicorn.Server, Any]:
            store = open_store(settings)
            app = create_app(settings, store, tracer)
            config = uvicorn.Config(
                app,
                host="127.0.0.1",
                port=settings.port,
                log_config=None,
                timeout_graceful_shutdown=settings.drain_timeout_s,  # as `microbatch gateway`
            )
            server = uvicorn.Server(config)

            async def serve() -> None:
                try:
                    await server.serve()
                finally:
                    await close_store(store)

            return server, self.loop.create_task(serve())

        url = f"http://127.0.0.1:{settings.port}"
        self._servers[url] = self._run(start())
        self._drain_s[url] = settings.drain_timeout_s
        wait_until(
            lambda: _status(f"{url}/healthz"), 30, f"gateway {url} up", until=lambda s: s == 200
        )
        return url

    def stop_gateway(self, url: str) -> None:
        server, task = self._servers.pop(url)
        server.should_exit = True

        limit_s = self._drain_s.pop(url) + 10

        async def ended() -> None:
            try:
                await asyncio.wait_for(asyncio.shield(task), limit_s)
            except TimeoutError:  # say what it still waits on, not only that it waits
                raise AssertionError(f"gateway {url} still stopping: {_waiting()}") from None

        self._run(ended(), limit_s + 5)

    def start_worker(self, settings: Settings, tracer: Any = None) -> None:
        async def start() -> tuple[asyncio.Event, Any]:
            stop = asyncio.Event()
            task = self.loop.create_task(run_worker(settings, stop, tracer=tracer))
            task.add_done_callback(self._ended)
            return stop, task

        self._workers.append(self._run(start()))

    def stop_worker(self, index: int = -1) -> None:
        """Stop one worker (the last started, by default) as SIGTERM would: it drains,
        leaves, and is gone when this returns."""
        stop, task = self._workers.pop(index)

        async def ended() -> None:
            stop.set()
            await asyncio.wait_for(asyncio.shield(task), 60)

        self._run(ended(), 65)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())

    def close(self) -> None:
        for url in list(self._servers):
            with contextlib.suppress(Exception):
                self.stop_gateway(url)

        async def stop_workers() -> None:
            for stop, _ in self._workers:
                stop.set()
            await asyncio.wait_for(
                asyncio.gather(*(task for _, task in self._workers), return_exceptions=True), 60
            )

        with contextlib.suppress(Exception):
            self._run(stop_workers(), 90)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()  # its self-pipe sockets, which a later gc.collect would warn about


def _waiting() -> str:
    """Every task still pending on this loop, each with the line it waits at."""
    out = []
    for task in asyncio.all_tasks():
        frames = task.get_stack(limit=30)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames[-6:]))
        out.append(f"{task.get_name()}: {where}")
    return "\n".join(sorted(out))


def _status(url: str) -> int | None:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code
    return None
