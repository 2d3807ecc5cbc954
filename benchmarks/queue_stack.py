"""The processes `queue_path.py` measures: one worker and one gateway run from a given
checkout (its own modules first on the path, so each tree speaks its own wire format), and a
lone worker draining a backlog (`worker_drain.py`), on a real device or a simulated one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from benchmarks.batching import env_with, free_port
from benchmarks.fleet import poll

ROOT = Path(__file__).resolve().parent.parent
MODEL = "noop"


@contextmanager
def process(code: Path, args: list[str], env: dict[str, str], log: Path):
    """A `microbatch` role run from the checkout `code` (its own modules first on the path)."""
    env = {**env, "PYTHONPATH": str(code)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "common.cli", *args],
            cwd=code,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # --processes children go with it
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ready(url: str, model: str) -> bool:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        body = httpx.get(f"{url}/readyz", timeout=2).json()
        return int(body["models"][model]["live_workers"]) >= 1
    return False


def group(pgid: int) -> list[int]:
    """The processes of a process group (a gateway and its `--processes` children)."""
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@contextmanager
def stack(
    code: Path,
    redis_url: str,
    folder: Path,
    processes: int = 1,
    model: str = MODEL,
    device: str | None = None,
    env: dict[str, str] | None = None,
):
    """One worker and one gateway (of `processes` processes) of `model`: its URL, and the
    pids of each role (for CPU per request). `env`: other variables for both (OTEL_*)."""
    common = {"model": model, "redis_url": redis_url, "max_queue_depth": 100_000}
    if device is not None:
        common["device"] = device
    port = free_port()
    with ExitStack() as roles:
        worker = roles.enter_context(
            process(
                code,
                ["worker"],
                env_with(worker_id="w0", **common) | (env or {}),
                folder / "w0.log",
            )
        )
        extra = {"processes": processes} if processes > 1 else {}
        gateway_env = env_with(port=port, gateway_id="gw", **common, **extra) | (env or {})
        gateway = roles.enter_context(
            process(code, ["gateway"], gateway_env, folder / f"gw-{port}.log")
        )
        url = f"http://127.0.0.1:{port}"
        poll(lambda: ready(url, model), 300, f"gateway on {port} with a live worker")
        yield url, {"gateway": group(gateway.pid), "worker": [worker.pid]}


def drain(code: Path, redis_url: str, folder: Path, entries: int, device_ms: float = 0.0) -> dict:
    """One `noop` worker alone draining a backlog of one-text entries (`worker_drain.py`, run
    with the tree's own modules, so in its own wire format): its CPU per entry; with
    `device_ms`, against a simulated device taking that long per batch."""
    folder.mkdir(parents=True, exist_ok=True)
    device = {"noop_compute_ms": device_ms} if device_ms else {}
    env = env_with(worker_id="drain", model=MODEL, redis_url=redis_url, **device)
    with process(code, ["worker"], env, folder / "drain-worker.log") as worker:
        helper = [sys.executable, str(ROOT / "benchmarks" / "worker_drain.py"), redis_url]
        helper += [str(entries), str(worker.pid), str(device_ms)]
        done = subprocess.run(
            helper, env={**env, "PYTHONPATH": str(code)}, capture_output=True, text=True
        )
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip()[-300:]}
    return json.loads(done.stdout)


def supports_processes(code: Path) -> bool:
    return "processes" in (code / "common" / "settings.py").read_text()
