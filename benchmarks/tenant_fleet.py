"""The fleet the tenant benchmarks run on: one redis-server, one `noop` worker, and named
gateways (each with its own settings: a tenants file, or plain `api_keys`), as processes."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from benchmarks.batching import env_with, free_port
from benchmarks.fleet import poll, start_redis
from benchmarks.queue_stack import ROOT, process, ready


def start_fleet(
    stack: ExitStack,
    folder: Path,
    gateways: dict[str, dict[str, object]],
    **worker: object,
) -> dict[str, str]:
    """Start everything inside `stack`; each gateway's URL by name, once it sees the worker."""
    redis_url = start_redis("single", stack, folder).url
    common = {"model": "noop", "redis_url": redis_url, "max_queue_depth": 100_000}
    env = env_with(worker_id="w0", **common, **worker)
    stack.enter_context(process(ROOT, ["worker"], env, folder / "w0.log"))
    urls = {}
    for name, extra in gateways.items():
        port = free_port()
        env = env_with(port=port, gateway_id=f"gw-{name}", **common, **extra)
        stack.enter_context(process(ROOT, ["gateway"], env, folder / f"gw-{name}.log"))
        urls[name] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        poll(lambda url=url: ready(url, "noop"), 300, f"gateway {url} with a live worker")
    return urls
