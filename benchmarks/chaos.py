"""Chaos run: requests under load while workers are SIGKILLed and Redis is restarted.

    .venv/bin/python benchmarks/chaos.py --requests 2000

One redis-server (append-only file, fsync always), one gateway, two `noop` workers with a
simulated 50 ms batch. A supervisor SIGKILLs a random worker every few seconds and starts a
replacement, and restarts Redis once mid-run. Every request has its own token count, so a
reply routed to the wrong request would show. Printed: answered, errors by status, lost
(no HTTP answer at all; must be 0), misrouted (must be 0), and the duplicates the gateway
dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import env_with, free_port, microbatch, wait_ready

ROOT = Path(__file__).resolve().parent.parent
REASONS: Counter = Counter()  # "status code: message" of every error answer


def spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with log.open("ab") as handle:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)


async def client_load(url: str, n: int, concurrency: int) -> tuple[Counter, int, int]:
    statuses: Counter = Counter()
    lost = misrouted = 0
    reasons = REASONS
    queue = list(range(n))
    limits = httpx.Limits(max_connections=concurrency)

    async def one_client(client: httpx.AsyncClient) -> None:
        nonlocal lost, misrouted
        while queue:
            i = queue.pop()
            tokens = [101] + [7] * (i % 400 + 1) + [102]
            try:
                r = await client.post(
                    "/v1/embeddings",
                    json={"input": [tokens]},
                    headers={"X-Microbatch-Timeout-Ms": "20000"},
                )
            except httpx.HTTPError:
                lost += 1
                continue
            statuses[r.status_code] += 1
            if r.status_code != 200:
                error = r.json().get("error", {})
                reasons[
                    f"{r.status_code} {error.get('code')}: {error.get('message', '')[:80]}"
                ] += 1
            if r.status_code == 200 and r.json()["usage"]["prompt_tokens"] != len(tokens):
                misrouted += 1

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(*(one_client(client) for _ in range(concurrency)))
    return statuses, lost, misrouted


async def chaos(
    procs: dict, start_worker, restart_redis, kill_every_s: float, stop: asyncio.Event
) -> dict:
    rng = random.Random(1)
    kills = redis_restarts = 0
    started = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(kill_every_s)
        if stop.is_set():
            break
        victim = rng.choice(list(procs["workers"]))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        procs["workers"].remove(victim)
        procs["workers"].append(start_worker())
        kills += 1
        if redis_restarts == 0 and time.monotonic() - started > 1.5 * kill_every_s:
            await asyncio.to_thread(restart_redis)
            redis_restarts += 1
    return {"workers_killed": kills, "redis_restarts": redis_restarts}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kill-every", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        rport, gport = free_port(), free_port()
        redis_args = [
            shutil.which("redis-server"),
            "--port",
            str(rport),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            tmp,
        ]
        redis_proc = {"p": spawn(redis_args, {}, tmpdir / "redis.log")}
        time.sleep(0.5)
        common = {
            "redis_url": f"redis://127.0.0.1:{rport}/0",
            "model": "noop",
            "noop_compute_ms": 50,
            "claim_idle_ms": 2000,
            "heartbeat_interval_ms": 250,
        }

        def start_worker() -> subprocess.Popen:
            return spawn(microbatch("worker"), env_with(**common), tmpdir / "workers.log")

        def restart_redis() -> None:
            redis_proc["p"].send_signal(signal.SIGKILL)
            redis_proc["p"].wait()
            time.sleep(1.0)  # an outage, not a blip
            redis_proc["p"] = spawn(redis_args, {}, tmpdir / "redis.log")

        procs = {"workers": [start_worker(), start_worker()]}
        gateway = spawn(microbatch("gateway"), env_with(port=gport, **common), tmpdir / "gw.log")
        url = f"http://127.0.0.1:{gport}"
        try:
            wait_ready(url)

            async def run() -> tuple:
                stop = asyncio.Event()
                monkey = asyncio.create_task(
                    chaos(procs, start_worker, restart_redis, args.kill_every, stop)
                )
                t0 = time.perf_counter()
                statuses, lost, misrouted = await client_load(url, args.requests, args.concurrency)
                elapsed = time.perf_counter() - t0
                stop.set()
                return statuses, lost, misrouted, elapsed, await monkey

            statuses, lost, misrouted, elapsed, faults = asyncio.run(run())
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            dup = re.search(r"^microbatch_duplicate_replies_total (\S+)$", metrics, re.M)
            report = {
                "requests": args.requests,
                "elapsed_s": round(elapsed, 1),
                "answered_200": statuses.get(200, 0),
                "errors_by_status": {str(k): v for k, v in statuses.items() if k != 200},
                "error_reasons": dict(REASONS),
                "lost": lost,
                "misrouted": misrouted,
                "duplicates_dropped_by_gateway": float(dup.group(1)) if dup else 0.0,
                **faults,
            }
            print(json.dumps(report, indent=2))
        finally:
            for proc in [*procs["workers"], gateway]:
                proc.send_signal(signal.SIGTERM)
            for proc in [*procs["workers"], gateway]:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            redis_proc["p"].kill()


if __name__ == "__main__":
    main()
