"""The role commands: `serve` (gateway and worker in one process), `gateway`, `worker`.

This is the composition root: the one place that imports both roles, and only inside command
bodies, so `microbatch gateway --help` never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Coroutine, Iterator
from typing import Any

import typer

from common import tracing
from common.cli.exposure import open_bind_refusal
from common.cli.options import (
    EXTRA,
    Host,
    Model,
    Port,
    Processes,
    RedisUrl,
    settings_from_context,
)
from common.cli.processes import (
    REFUSED,
    START_FAILED,
    Supervisor,
    die_with_parent,
    reuse_port_socket,
)
from common.logs import setup_logging
from common.settings import Settings
from common.tasks import spawn_supervised


@contextlib.contextmanager
def _traced(role: str) -> Iterator[Any]:
    """The role's tracer, as the standard OTEL_* environment asks (None: tracing off); what
    it still buffers is exported when the role ends."""
    try:
        traced = tracing.start(role)
    except tracing.TracingConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        yield traced.tracer if traced is not None else None
    finally:
        if traced is not None:
            traced.shutdown()


def _run(main: Coroutine[Any, Any, int | None]) -> None:
    code = _exit_code(main)
    if code:
        raise typer.Exit(code)


def _exit_code(main: Coroutine[Any, Any, int | None]) -> int:
    """Run `main` on uvloop where installed; the exit code it returns (None: 0)."""
    from common import gc_tuning
    from common.store import StoreRefused

    gc_tuning.relax()

    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        return runner(main) or 0
    except StoreRefused as exc:
        typer.echo(f"microbatch: {exc}", err=True)
        return REFUSED


def _refuse_an_open_bind(settings: Settings) -> None:
    """Refuse to start open to anyone, or on a tenants file that cannot be used (the
    message names the tenant and the field)."""
    refusal = open_bind_refusal(settings)
    if refusal is not None:
        raise typer.BadParameter(refusal)
    if settings.tenants is not None:
        from common.tenants import TenantsError, load

        try:
            load(settings.tenants)
        except TenantsError as exc:
            raise typer.BadParameter(str(exc)) from None


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
        timeout_graceful_shutdown=settings.drain_timeout_s,
        log_config=None,  # uvicorn's lines go through our handler (JSON by default)
    )
    return Server(config)


def serve(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    host: Host = None,
    port: Port = None,
    model: Model = None,
    processes: Processes = None,
) -> None:
    """Gateway and one worker in one process; embedded store unless --redis-url."""
    settings = settings_from_context(
        ctx, redis_url=redis_url, host=host, port=port, model=model, processes=processes
    )
    if settings.processes > 1 and settings.embedded:
        raise typer.BadParameter(
            "serve --processes needs --redis-url (or MICROBATCH_REDIS_URL): the embedded "
            "store lives in one process, and gateway processes must share it"
        )
    setup_logging(settings.log_level, settings.log_format)
    _refuse_an_open_bind(settings)
    if settings.processes > 1:
        serve_worker_health(settings)  # the worker's metrics: no gateway runs in this process
        with _traced("worker") as tracer:
            _run(_serve_processes(settings, tracer))
        return

    # two roles, two services in a trace, as in a fleet
    with _traced("gateway") as gateway_tracer, _traced("worker") as worker_tracer:
        _run(_serve_one(settings, gateway_tracer, worker_tracer))


async def _serve_one(settings: Settings, gateway_tracer: Any, worker_tracer: Any) -> None:
    """`serve`: the gateway and the worker on one event loop, over one store."""
    from common.store import check_access, close_store, open_store
    from gateway.app import create_app
    from worker.main import run_worker

    store = open_store(settings)
    await check_access(store)
    server = _uvicorn_server(settings, create_app(settings, store, gateway_tracer))
    sockets = _listen(settings)
    worker_stop = asyncio.Event()
    _stop_on_signals(lambda: setattr(server, "should_exit", True))
    # a worker that dies takes the gateway down with it: serving without one only fails
    worker = spawn_supervised(
        "worker",
        run_worker(settings, worker_stop, store, tracer=worker_tracer),
        lambda exc: setattr(server, "should_exit", True),
    )
    try:
        await server.serve(sockets=sockets)
    finally:
        worker_stop.set()  # after the gateway: its in-flight requests need the worker
        await worker
        await close_store(store)


async def _serve_processes(settings: Settings, tracer: Any) -> int:
    """`serve --processes N`: the gateways in N children, the one worker here; on a signal
    the gateways drain first, then the worker (their in-flight requests need it)."""
    from common.store import check_access, close_store, open_store
    from worker.main import run_worker

    store = open_store(settings)
    await check_access(store)
    gateways = Supervisor(_gateway_process, settings)
    _stop_on_signals(gateways.stop)
    worker_stop = asyncio.Event()
    worker = spawn_supervised(
        "worker",
        run_worker(settings, worker_stop, store, tracer=tracer),
        lambda exc: gateways.stop(),
    )
    try:
        return await gateways.run()
    finally:
        worker_stop.set()
        await worker
        await close_store(store)


def gateway(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    host: Host = None,
    port: Port = None,
    processes: Processes = None,
) -> None:
    """The HTTP gateway only (needs --redis-url)."""
    settings = settings_from_context(
        ctx, redis_url=redis_url, host=host, port=port, processes=processes
    )
    if settings.embedded:
        raise typer.BadParameter("gateway needs --redis-url (or MICROBATCH_REDIS_URL); use serve")
    setup_logging(settings.log_level, settings.log_format)
    _refuse_an_open_bind(settings)
    if settings.processes > 1:
        _run(_supervise_gateways(settings))
    else:
        with _traced("gateway") as tracer:
            _run(_serve_gateway(settings, tracer=tracer))


async def _supervise_gateways(settings: Settings) -> int:
    from common.store import check_access, close_store, open_store

    store = open_store(settings)  # refused credentials: one message, before any child starts
    try:
        await check_access(store)
    finally:
        await close_store(store)
    gateways = Supervisor(_gateway_process, settings)
    _stop_on_signals(gateways.stop)
    return await gateways.run()


async def _serve_gateway(
    settings: Settings, sockets: list[socket.socket] | None = None, tracer: Any = None
) -> None:
    """One gateway on this event loop, until a signal; on `sockets` if given, else it binds."""
    from common import gc_tuning
    from common.store import check_access, close_store, open_store
    from gateway.app import create_app

    store = open_store(settings)
    await check_access(store)
    server = _uvicorn_server(settings, create_app(settings, store, tracer))
    _stop_on_signals(lambda: setattr(server, "should_exit", True))
    gc_tuning.freeze_startup_heap()
    try:
        await server.serve(sockets=sockets or _listen(settings))
    finally:
        await close_store(store)


def _gateway_process(settings: Settings, parent_pid: int) -> None:
    """A child of `--processes N` (spawned, so importable by name): one gateway on its own
    SO_REUSEPORT socket on the shared port."""
    die_with_parent(parent_pid)
    setup_logging(settings.log_level, settings.log_format)
    try:
        sockets = _listen(settings, always=True)
    except OSError as exc:
        typer.echo(f"microbatch: cannot listen on {settings.host}: {exc}", err=True)
        sys.exit(START_FAILED)
    with _traced("gateway") as tracer:
        code = _exit_code(_serve_gateway(settings, sockets, tracer))
    sys.exit(code)


def _listen(settings: Settings, always: bool = False) -> list[socket.socket] | None:
    """The gateway's listening sockets: the API port and, where set, the admin port (both
    SO_REUSEPORT, so `--processes N` children share them); None: uvicorn binds the one."""
    if settings.admin_port is None and not always:
        return None
    ports = [settings.port] if settings.admin_port is None else [settings.port, settings.admin_port]
    return [reuse_port_socket(settings.host, port, listen=True) for port in ports]


def worker(ctx: typer.Context, redis_url: RedisUrl = None, model: Model = None) -> None:
    """One worker for --model (needs --redis-url). SIGTERM drains and exits 0."""
    settings = settings_from_context(ctx, redis_url=redis_url, model=model)
    if settings.embedded:
        raise typer.BadParameter("worker needs --redis-url (or MICROBATCH_REDIS_URL); use serve")
    setup_logging(settings.log_level, settings.log_format)
    serve_worker_health(settings)

    async def main() -> None:
        from worker.main import run_worker

        stop = asyncio.Event()
        _stop_on_signals(stop.set)
        await run_worker(settings, stop, tracer=tracer)

    with _traced("worker") as tracer:
        _run(main())


def serve_worker_health(settings: Settings) -> None:
    """The worker's /metrics and /healthz on `metrics_port`, where one is set."""
    if settings.metrics_port is not None:
        from worker import health

        stale_after_s = health.stale_after_s(settings.heartbeat_interval_ms)
        health.serve(settings.metrics_port, settings.host, stale_after_s)


def register(app: typer.Typer) -> None:
    """Add the role commands to the one typer app."""
    for command in (serve, gateway, worker):
        app.command(context_settings=EXTRA)(command)
