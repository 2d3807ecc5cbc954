"""A microbatch stack serving a generation model, and the streamed completions it answers.

What the generation benchmarks share (`generation.py`'s Poisson arm, `chat_turns.py`'s chat
arms, `choices.py`): redis-server, workers and one gateway started as subprocesses on free
ports, and the JSON events of one streamed /v1/completions call. Imported as
`benchmarks.gen_server`, never run on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def completion_events(client, body: dict):
    """The JSON events of one streamed /v1/completions call; an error event raises."""
    headers = {"X-Microbatch-Timeout-Ms": "600000"}  # the arms are judged on throughput
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"microbatch answered an error: {event['error']}")
            yield event


@contextlib.contextmanager
def microbatch_server(
    path: Path, log_dir: Path, workers: int = 1, metrics: list | None = None, **settings: str
) -> Iterator[str]:
    """redis-server, `workers` workers and one gateway serving `path` (`settings` as
    MICROBATCH_ variables); yields the gateway's URL. `metrics`, if given, receives each
    worker's /metrics URL."""
    import httpx

    from tests.conftest import free_port  # the suite's helper, not a test dependency

    redis_port, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "MICROBATCH_LOG_FORMAT": "text",
        "MICROBATCH_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "MICROBATCH_MODEL": str(path),
        "MICROBATCH_PORT": str(http_port),
        **{f"MICROBATCH_{k.upper()}": v for k, v in settings.items()},
    }
    redis = [shutil.which("redis-server"), "--port", str(redis_port), "--save", ""]
    procs = [subprocess.Popen([*redis, "--appendonly", "no"], stdout=subprocess.DEVNULL)]
    for n, role in enumerate(["worker"] * workers + ["gateway"]):
        log = (log_dir / f"{role}-{n}.log").open("wb")
        own = dict(env)
        if role == "worker" and metrics is not None:
            own["MICROBATCH_METRICS_PORT"] = str(port := free_port())
            metrics.append(f"http://127.0.0.1:{port}/metrics")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "common.cli", role],
                cwd=ROOT,
                env=own,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    base = f"http://127.0.0.1:{http_port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
