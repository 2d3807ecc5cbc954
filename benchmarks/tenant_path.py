"""What a tenant's request costs the queue path, in CPU, with the noise of processes removed.

    .venv/bin/python benchmarks/tenant_path.py                   # ~2 min on 2 cores

A redis-server, and in this one process a `noop` worker and two gateways: `on`, with a
tenants file of 100 tenants, each with a requests and a tokens quota far above the load
(every request quota-checked, laned and read from its lane), and `off`, with the same key
as a plain `api_keys` entry. wrk (another process) sends single-input embedding requests
over 64 connections to each in turn for `--duration` (1) s, `--rounds` (40) times; a turn's
CPU per request is this process's CPU over it (gateway and worker; not Redis's, nor wrk's).
Both gateways live in one process, so the memory layout that makes two identical gateway
processes differ by up to 8% (`tenant_cost.py`'s control) is the same for both, and each
round's two turns see the host at nearly the same speed. Judged beside `tenant_cost.py`:
CPU per request, off over on, the median of the rounds. Needs `wrk`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fleet import host_cpu, start_redis
from benchmarks.tenant_cost import KEY, _script, _wrk, many_tenants

SETTINGS = {
    "model": "noop",
    "max_queue_depth": 100_000,
    "heartbeat_interval_ms": 60_000,
    "worker_stale_ms": 600_000,
    "cancel_poll_ms": 60_000,
}
RUNNING: list[asyncio.Task] = []  # the servers and the worker, for the process's life


def _serve(tenants: Path, redis_url: str) -> dict[str, str]:
    """The two gateways and the worker on an event loop in a thread; the gateways' URLs."""
    import uvicorn

    from benchmarks.request_path import _free_port
    from common.settings import Settings
    from common.store import open_store
    from gateway.app import create_app
    from worker.main import run_worker

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    modes = {"on": {"tenants": str(tenants)}, "off": {"api_keys": [KEY]}}
    settings = {
        mode: Settings(**SETTINGS, redis_url=redis_url, port=_free_port(), **extra)  # type: ignore[arg-type]
        for mode, extra in modes.items()
    }

    async def start() -> None:
        for each in settings.values():
            app = create_app(each, open_store(each))
            # as `microbatch gateway` serves: no access log, no server header
            config = uvicorn.Config(
                app, port=each.port, log_level="warning", access_log=False, server_header=False
            )
            RUNNING.append(loop.create_task(uvicorn.Server(config).serve()))
        worker = run_worker(settings["off"], asyncio.Event(), open_store(settings["off"]))
        RUNNING.append(loop.create_task(worker))

    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    return {mode: f"http://127.0.0.1:{each.port}" for mode, each in settings.items()}


def _rounds(urls: dict[str, str], script: Path, args: argparse.Namespace) -> dict[str, list]:
    """Each turn's CPU per request (us), in rounds of one turn per gateway."""
    cpu_us: dict[str, list] = {mode: [] for mode in urls}
    for round_ in range(args.rounds):
        for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            before = time.process_time()
            served = _wrk(urls[mode], script, 64, args.duration)["requests_per_s"]
            used = time.process_time() - before
            cpu_us[mode].append(used * 1e6 / (served * args.duration))
    return cpu_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--duration", type=int, default=1, help="seconds (whole ones)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis_url = start_redis("single", stack, folder).url
        tenants = many_tenants()
        (folder / "tenants.json").write_text(json.dumps({"tenants": tenants}))
        urls = _serve(folder / "tenants.json", redis_url)
        script = _script(folder)
        time.sleep(3)  # the worker registered, the gateways see it
        for url in urls.values():
            _wrk(url, script, 64, 2)  # warm
        cpu_us = _rounds(urls, script, args)
    ratios = [b / a for a, b in zip(cpu_us["on"], cpu_us["off"], strict=True)]
    result = {
        "host": host_cpu(),
        "rounds": args.rounds,
        "cpu_us_per_request": {mode: round(statistics.median(v), 1) for mode, v in cpu_us.items()},
        "cpu_ratio": round(statistics.median(ratios), 4),
        "cpu_ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
    }
    print(json.dumps(result, indent=2))
    print(
        f"CPU per request (gateway and worker), tenants off / on, median of {args.rounds} "
        f"rounds: {result['cpu_ratio']} (quartiles {result['cpu_ratio_quartiles']})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
