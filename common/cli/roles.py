"""The role commands: `serve` (gateway and worker in one process), `gateway`, `worker`.

This is the composition root: the one place that imports both roles, and only inside command
bodies, so `microbatch gateway --help` never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import typer

from common.cli.options import EXTRA, Host, Model, Port, RedisUrl, settings_from_context
from common.logs import setup_logging
from common.settings import Settings
from common.tasks import spawn_supervised


def _run(main: Any) -> None:
    from common.store import StoreRefused

    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(main)
    except StoreRefused as exc:
        typer.echo(f"microbatch: {exc}", err=True)
        raise typer.Exit(2) from None


def _stop_on_signals(on_stop: Any) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)


def _uvicorn_server(settings: Settings, fastapi_app: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """Signals are ours: the worker must drain after the gateway stops, not be killed."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    config = uvicorn.Config(
        fastapi_app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        server_header=False,  # one header less per answer, and no version to fingerprint
        lifespan="on",
        timeout_graceful_shutdown=30,
        log_config=None,  # uvicorn's lines go through our handler (JSON by default)
    )
    return Server(config)


def serve(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    host: Host = None,
    port: Port = None,
    model: Model = None,
) -> None:
    """Gateway and one worker in one process; embedded store unless --redis-url."""
    settings = settings_from_context(ctx, redis_url=redis_url, host=host, port=port, model=model)
    setup_logging(settings.log_level, settings.log_format)

    async def main() -> None:
        from common.store import check_access, close_store, open_store
        from gateway.app import create_app
        from worker.main import run_worker

        store = open_store(settings)
        await check_access(store)
        server = _uvicorn_server(settings, create_app(settings, store))
        worker_stop = asyncio.Event()
        _stop_on_signals(lambda: setattr(server, "should_exit", True))
        # a worker that dies takes the gateway down with it: serving without one only fails
        worker = spawn_supervised(
            "worker",
            run_worker(settings, worker_stop, store),
            lambda exc: setattr(server, "should_exit", True),
        )
        try:
            await server.serve()
        finally:
            worker_stop.set()  # after the gateway: its in-flight requests need the worker
            await worker
            await close_store(store)

    _run(main())


def gateway(
    ctx: typer.Context, redis_url: RedisUrl = None, host: Host = None, port: Port = None
) -> None:
    """The HTTP gateway only (needs --redis-url)."""
    settings = settings_from_context(ctx, redis_url=redis_url, host=host, port=port)
    if settings.embedded:
        raise typer.BadParameter("gateway needs --redis-url (or MICROBATCH_REDIS_URL); use serve")
    setup_logging(settings.log_level, settings.log_format)

    async def main() -> None:
        from common.store import check_access, close_store, open_store
        from gateway.app import create_app

        store = open_store(settings)
        await check_access(store)
        server = _uvicorn_server(settings, create_app(settings, store))
        _stop_on_signals(lambda: setattr(server, "should_exit", True))
        try:
            await server.serve()
        finally:
            await close_store(store)

    _run(main())


def worker(ctx: typer.Context, redis_url: RedisUrl = None, model: Model = None) -> None:
    """One worker for --model (needs --redis-url). SIGTERM drains and exits 0."""
    settings = settings_from_context(ctx, redis_url=redis_url, model=model)
    if settings.embedded:
        raise typer.BadParameter("worker needs --redis-url (or MICROBATCH_REDIS_URL); use serve")
    setup_logging(settings.log_level, settings.log_format)

    if settings.metrics_port is not None:
        from worker import health

        stale_after_s = health.stale_after_s(settings.heartbeat_interval_ms)
        health.serve(settings.metrics_port, settings.host, stale_after_s)

    async def main() -> None:
        from worker.main import run_worker

        stop = asyncio.Event()
        _stop_on_signals(stop.set)
        await run_worker(settings, stop)

    _run(main())


def register(app: typer.Typer) -> None:
    """Add the role commands to the one typer app."""
    for command in (serve, gateway, worker):
        app.command(context_settings=EXTRA)(command)
