"""Micro-batching against one-at-a-time, and the capacity of the gateway path itself.

    .venv/bin/python benchmarks/batching.py            # both parts, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/batching.py --part model --duration 20

Part `model`: `microbatch serve` (embedded store) with the default model, 32 closed-loop
clients sending short texts (8-48 tokens), once with `max_batch_size 16` and once with 1,
side by side in one run; requests/s, p50/p99 and their ratio.

Part `path`: one redis-server, one gateway, one `noop` worker (no compute), loaded by wrk
(a C client, so the load generator is not the bottleneck) at several connection counts;
requests/s and p50/p99 as wrk measures them, plus the load generator's own CPU. Then an
open-loop run at a fixed offered rate (`--rate`, 1,000/s by default): wrk's connections send
on a fixed schedule (a Lua `delay()` against the clock) instead of as soon as an answer
arrives, so the latencies are those of a steady 1,000 requests/s, not of a saturated server.
The issue's goals: >= 1,500 requests/s, and p99 < 20 ms at 1,000/s offered.

Figures go to stdout and, as JSON, to `--out` (default `.bench/batching.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.cli import loadgen

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def started(args: list[str], env: dict[str, str], log: Path):
    with log.open("wb") as handle:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def env_with(**settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_")}
    env.update({f"MICROBATCH_{k.upper()}": str(v) for k, v in settings.items()})
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MICROBATCH_LOG_LEVEL="warning")
    return env


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never became ready")


def microbatch(role: str) -> list[str]:
    return [sys.executable, "-m", "common.cli", role]


async def measure(url: str, bodies: list[dict], clients: int, duration_s: float) -> dict:
    samples, elapsed = await loadgen.closed_loop(
        url, bodies, clients=clients, duration_s=duration_s
    )
    return loadgen.summarize(samples, elapsed)


def part_model(duration_s: float, clients: int) -> dict:
    bodies = [{"input": t} for t in loadgen.workload("short", 2000)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (16, 1):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = env_with(port=port, max_batch_size=size)
            with started(microbatch("serve"), env, Path(tmp) / f"serve-{size}.log"):
                wait_ready(url)
                asyncio.run(measure(url, bodies, clients, min(5.0, duration_s / 3)))  # warm-up
                results[f"max_batch_size={size}"] = asyncio.run(
                    measure(url, bodies, clients, duration_s)
                )
    batched, single = results["max_batch_size=16"], results["max_batch_size=1"]
    results["throughput_ratio_16_vs_1"] = batched["requests_per_s"] / single["requests_per_s"]
    return results


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{"input": "a short sentence for the gateway path", "model": "noop"}'
wrk.headers["Content-Type"] = "application/json"
"""


# Open loop: each wrk thread claims evenly spaced send times (`init` gets its own rate), and
# a connection that comes free waits for the next unclaimed one. A backlog is sent at once,
# up to a second of it, as an open-loop client would have sent it on time.
PACED_SCRIPT = (
    WRK_SCRIPT
    + """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } mb_timespec;
int clock_gettime(int clk, mb_timespec *tp);
]]
local ts = ffi.new("mb_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end
local interval_ms, next_at
function init(args)
  interval_ms = 1000 / tonumber(args[1])
end
function delay()
  local now = now_ms()
  next_at = math.max(next_at or now, now - 1000) + interval_ms
  local wait = next_at - now
  if wait < 0 then return 0 end
  return math.floor(wait)
end
"""
)


def parse_wrk(output: str) -> dict:
    def ms(value: str) -> float:
        number, unit = re.match(r"([\d.]+)(us|ms|s)", value).groups()
        return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    pct = dict(re.findall(r"^\s+(50|99)(?:\.0+)?%\s+(\S+)", output, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(r"Socket errors: (.*)", output)
    return {
        "requests_per_s": rps,
        "p50_ms": ms(pct["50"]),
        "p99_ms": ms(pct["99"]),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1) if errors else "none",
    }


def run_wrk(wrk_args: list[str], duration_s: float) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(wrk_args, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {**parse_wrk(out), "loadgen_cpu_share": cpu / duration_s}


def part_path(duration_s: float, connections: list[int], rate: int) -> dict:
    wrk = shutil.which("wrk")
    redis_server = shutil.which("redis-server")
    if wrk is None or redis_server is None:
        raise SystemExit(
            "part 'path' needs wrk and redis-server (apt-get install wrk redis-server)"
        )
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        rport, gport = free_port(), free_port()
        redis_url = f"redis://127.0.0.1:{rport}/0"
        url = f"http://127.0.0.1:{gport}"
        script, paced = Path(tmp) / "post.lua", Path(tmp) / "paced.lua"
        script.write_text(WRK_SCRIPT)
        paced.write_text(PACED_SCRIPT)
        redis_args = [redis_server, "--port", str(rport), "--save", "", "--appendonly", "no"]
        common = {"redis_url": redis_url, "model": "noop", "max_queue_depth": 100_000}
        with (
            started(redis_args, dict(os.environ), Path(tmp) / "redis.log"),
            started(microbatch("worker"), env_with(**common), Path(tmp) / "worker.log"),
            started(microbatch("gateway"), env_with(port=gport, **common), Path(tmp) / "gw.log"),
        ):
            wait_ready(url)
            subprocess.run(
                [wrk, "-t1", "-c8", "-d3s", "-s", str(script), url + "/v1/embeddings"],
                capture_output=True,
                check=True,
            )  # warm-up
            seconds = f"-d{int(duration_s)}s"
            for c in connections:
                args = [wrk, "-t2", f"-c{c}", seconds, "--latency", "-s", str(script)]
                results[f"connections={c}"] = run_wrk([*args, url + "/v1/embeddings"], duration_s)
            args = [wrk, "-t2", "-c64", seconds, "--latency", "-s", str(paced)]
            results[f"offered={rate}/s"] = {
                **run_wrk([*args, url + "/v1/embeddings", "--", str(rate / 2)], duration_s),
                "offered_per_s": rate,
            }
    best = max(v["requests_per_s"] for k, v in results.items() if k.startswith("connections="))
    results["goals"] = {
        "requests_per_s >= 1500": best >= 1500,
        f"p99 < 20 ms at {rate}/s offered": results[f"offered={rate}/s"]["p99_ms"] < 20,
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--part", choices=["model", "path", "all"], default="all")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per measurement")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--connections", default="16,32,64", help="wrk connection counts")
    parser.add_argument("--rate", type=int, default=1000, help="open-loop requests/s offered")
    parser.add_argument("--out", type=Path, default=ROOT / ".bench" / "batching.json")
    args = parser.parse_args()
    report: dict = {"machine": {"cpus": os.cpu_count()}}
    if args.part in ("model", "all"):
        report["model"] = part_model(args.duration, args.clients)
    if args.part in ("path", "all"):
        conns = [int(c) for c in args.connections.split(",")]
        report["path"] = part_path(args.duration, conns, args.rate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
