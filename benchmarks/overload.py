"""Memory stays bounded at ten times the sustainable load.

    .venv/bin/python benchmarks/overload.py                  # ~35 s on 2 cores
    .venv/bin/python benchmarks/overload.py --sustainable 50 --batch 4 --duration 10

One redis-server, one gateway, one `noop` worker whose simulated batch (`--batch` entries
per `--batch`/`--sustainable` seconds) fixes the rate it can serve. An open-loop client
(Poisson arrivals over at most `--connections` keep-alive connections; an arrival that finds
them all busy is shed and counted) offers `--factor` times that rate for `--duration`
seconds, while a probe sends one request every half second and notes its status,
Retry-After and latency. The RSS of every process is read from /proc each
second. Printed (and written as JSON to `--out`): start, peak and end RSS per process and
whether its growth stayed under `--rss-growth-mb`, the rate actually offered, answers by
status, refusals by reason, and how fast the refusals came. Exit status 1 if any process
grew past the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import env_with, free_port, microbatch, started, wait_ready
from common.cli import loadgen

ROOT = Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float | None:
    """Resident set size from /proc (no psutil needed); None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) / 1024 if match else None


class RssSampler(threading.Thread):
    """Samples every process once a second, on its own thread so a busy loop cannot skip one."""

    def __init__(self, pids: dict[str, int], period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.period_s = period_s
        self.samples: dict[str, list[float]] = {name: [] for name in pids}
        self._done = threading.Event()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            value = rss_mb(pid)
            if value is not None:
                self.samples[name].append(value)

    def run(self) -> None:
        while not self._done.wait(self.period_s):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.sample()


@dataclass(frozen=True, slots=True)
class Answer:
    sent_s: float  # perf_counter at send
    latency_s: float
    status: int  # HTTP status; 0 for a connection that failed


def request_head(timeout_ms: int) -> bytes:
    """An embeddings POST up to its Content-Length value: append the length, a blank line
    and the body."""
    return (
        "POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\n"
        f"X-Microbatch-Timeout-Ms: {timeout_ms}\r\nContent-Length: "
    ).encode()


class RawClient:
    """Keep-alive HTTP/1.1 over plain asyncio streams: a few microseconds of CPU a request.

    common.cli.loadgen's httpx client costs about a millisecond of CPU per request, so on two
    cores shared with the gateway it, not the gateway, would set the offered rate. One
    request at a time per connection, at most `connections` of them (the client's bound),
    opened as needed and reused oldest-idle first so none sits out the server's keep-alive.
    """

    def __init__(self, port: int, timeout_ms: int, connections: int) -> None:
        self.port = port
        self.head = request_head(timeout_ms)
        self.free = connections  # requests that may start now
        self.idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()

    def reserve(self) -> bool:
        if self.free == 0:
            return False
        self.free -= 1
        return True

    async def post(self, body: bytes) -> Answer:
        """Send one request on a reserved slot; the slot is free again when it returns."""
        started_s = time.perf_counter()
        conn = self.idle.popleft() if self.idle else None
        try:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", self.port)
            reader, writer = conn
            writer.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            await reader.readexactly(length)
            status = int(head[9:12])
            self.idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status = 0
            if conn is not None:
                conn[1].close()
        finally:
            self.free += 1
        return Answer(started_s, time.perf_counter() - started_s, status)

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def open_loop(
    client: RawClient, bodies: list[bytes], rate: float, duration_s: float
) -> tuple[list[Answer], int]:
    """Poisson arrivals at `rate`; an arrival that finds every connection busy is shed."""
    rng = random.Random(0)
    answers: list[Answer] = []
    tasks: set[asyncio.Task] = set()
    shed = 0
    t0 = next_at = time.perf_counter()
    i = 0
    while next_at < t0 + duration_s:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if client.reserve():
            task = asyncio.create_task(client.post(bodies[i % len(bodies)]))
            task.add_done_callback(lambda t: (tasks.discard(t), answers.append(t.result())))
            tasks.add(task)
        else:
            shed += 1
        i += 1
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.gather(*tasks)
    return answers, shed


async def probe(url: str, headers: dict, stop: asyncio.Event) -> list[dict]:
    """One request every half second: what a client sees, Retry-After included."""
    seen = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not stop.is_set():
            started_s = time.perf_counter()
            try:
                r = await client.post("/v1/embeddings", json={"input": "probe"}, headers=headers)
                status, retry_after = r.status_code, r.headers.get("retry-after")
            except httpx.HTTPError:
                status, retry_after = 0, None
            seen.append(
                {
                    "status": status,
                    "retry_after": retry_after,
                    "latency_ms": (time.perf_counter() - started_s) * 1000,
                }
            )
            await asyncio.sleep(0.5)
    return seen


async def overload(port: int, rate: float, duration_s: float, args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{port}"
    bodies = [orjson.dumps({"input": t}) for t in loadgen.workload("short", 500)]
    client = RawClient(port, args.timeout_ms, args.connections)
    stop = asyncio.Event()
    prober = asyncio.create_task(
        probe(url, {"X-Microbatch-Timeout-Ms": str(args.timeout_ms)}, stop)
    )
    started_s = time.perf_counter()
    answers, shed = await open_loop(client, bodies, rate, duration_s)
    elapsed_s = time.perf_counter() - started_s
    stop.set()
    client.close()
    return {
        "answers": answers,
        "started_s": started_s,
        "shed": shed,
        "elapsed_s": elapsed_s,
        "probes": await prober,
    }


def _ms(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else None


def _by_status(answers: Iterable[Answer]) -> dict[str, int]:
    return dict(sorted(Counter(str(a.status) for a in answers).items()))


def summarize(result: dict, duration_s: float) -> dict:
    answers: list[Answer] = result["answers"]
    settled_s = result["started_s"] + 5.0
    refused = [a.latency_s for a in answers if a.status == 503]
    ok = [a.latency_s for a in answers if a.status == 200]
    return {
        "offered": len(answers) + result["shed"],
        "offered_per_s": round((len(answers) + result["shed"]) / duration_s, 1),
        "sent": len(answers),
        "shed_by_client_bound": result["shed"],
        "elapsed_s": round(result["elapsed_s"], 1),
        "by_status": _by_status(answers),
        # Until a rate is measured (a few seconds of backlog) admission knows only the depth.
        "by_status_first_5_s": _by_status(a for a in answers if a.sent_s < settled_s),
        "by_status_after_5_s": _by_status(a for a in answers if a.sent_s >= settled_s),
        "ok_per_s": round(len(ok) / result["elapsed_s"], 1),
        "ok_p50_ms": _ms(ok, 0.5),
        "ok_p99_ms": _ms(ok, 0.99),
        "refused_p50_ms": _ms(refused, 0.5),
        "refused_p99_ms": _ms(refused, 0.99),
    }


def rejected_by_reason(metrics: str) -> dict[str, float]:
    found = re.findall(r'^microbatch_rejected_total\{reason="([^"]+)"\} (\S+)$', metrics, re.M)
    return {reason: float(value) for reason, value in found}


def memory(samples: dict[str, list[float]], start: dict[str, float], bound_mb: float) -> dict:
    report = {}
    for name, values in samples.items():
        peak, end = max(values, default=0.0), values[-1] if values else 0.0
        report[name] = {
            "start_mb": round(start[name], 1),
            "peak_mb": round(peak, 1),
            "end_mb": round(end, 1),
            "growth_mb": round(peak - start[name], 1),
            "within_bound": peak - start[name] < bound_mb,
        }
    return report


def run(args: argparse.Namespace) -> dict:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("needs redis-server (apt-get install redis-server)")
    compute_ms = args.batch * 1000 / args.sustainable
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        rport, gport = free_port(), free_port()
        url = f"http://127.0.0.1:{gport}"
        common = {
            "redis_url": f"redis://127.0.0.1:{rport}/0",
            "model": "noop",
            "max_queue_depth": args.max_queue_depth,
        }
        redis_args = [redis_server, "--port", str(rport), "--save", "", "--appendonly", "no"]
        procs = {
            "redis-server": stack.enter_context(
                started(redis_args, dict(os.environ), Path(tmp) / "redis.log")
            ),
            "worker": stack.enter_context(
                started(
                    microbatch("worker"),
                    env_with(max_batch_size=args.batch, noop_compute_ms=compute_ms, **common),
                    Path(tmp) / "worker.log",
                )
            ),
            "gateway": stack.enter_context(
                started(microbatch("gateway"), env_with(port=gport, **common), Path(tmp) / "gw.log")
            ),
        }
        wait_ready(url)
        # Warm up at the sustainable rate so lazy allocations are not counted as growth.
        asyncio.run(overload(gport, args.sustainable, 3.0, args))
        sampler = RssSampler({name: p.pid for name, p in procs.items()})
        sampler.sample()
        start = {name: values[-1] for name, values in sampler.samples.items()}
        sampler.start()
        offered = args.sustainable * args.factor
        result = asyncio.run(overload(gport, offered, args.duration, args))
        time.sleep(2.0)  # let the backlog drain; end RSS is after the storm
        sampler.stop()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    probes = result["probes"]
    refused_probes = [p for p in probes if p["status"] == 503]
    return {
        "machine": {"cpus": os.cpu_count()},
        "setup": {
            "sustainable_per_s": args.sustainable,
            "factor": args.factor,
            "target_offered_per_s": offered,
            "duration_s": args.duration,
            "batch": args.batch,
            "noop_compute_ms": round(compute_ms, 1),
            "max_queue_depth": args.max_queue_depth,
            "timeout_ms": args.timeout_ms,
            "client_connections": args.connections,
            "rss_growth_bound_mb": args.rss_growth_mb,
        },
        "answers": summarize(result, args.duration),
        "rejected_by_reason": rejected_by_reason(metrics),
        "probes": {
            "sent": len(probes),
            "refused": len(refused_probes),
            "refused_with_retry_after": sum(1 for p in refused_probes if p["retry_after"]),
            "refused_median_ms": round(
                statistics.median(p["latency_ms"] for p in refused_probes), 1
            )
            if refused_probes
            else None,
        },
        "rss": memory(sampler.samples, start, args.rss_growth_mb),
    }


def print_report(report: dict) -> None:
    setup, a = report["setup"], report["answers"]
    print(
        f"sustainable {setup['sustainable_per_s']}/s (batch {setup['batch']} per "
        f"{setup['noop_compute_ms']} ms), target {setup['target_offered_per_s']}/s for "
        f"{setup['duration_s']} s, deadline {setup['timeout_ms']} ms, "
        f"max_queue_depth {setup['max_queue_depth']}"
    )
    print(
        f"offered {a['offered_per_s']}/s ({a['offered']} arrivals, {a['shed_by_client_bound']} "
        f"shed at the client's {setup['client_connections']} connections); answers by status "
        f"{a['by_status']}; served {a['ok_per_s']}/s"
    )
    print(
        f"first 5 s {a['by_status_first_5_s']}, after {a['by_status_after_5_s']}; "
        f"refused by reason {report['rejected_by_reason']}"
    )
    print(
        f"503 latency p50 {a['refused_p50_ms']} ms, p99 {a['refused_p99_ms']} ms; "
        f"200 latency p50 {a['ok_p50_ms']} ms, p99 {a['ok_p99_ms']} ms"
    )
    p = report["probes"]
    print(
        f"probes: {p['refused']}/{p['sent']} refused, {p['refused_with_retry_after']} with "
        f"Retry-After, median {p['refused_median_ms']} ms"
    )
    print(f"{'process':<14}{'start MB':>10}{'peak MB':>10}{'end MB':>10}{'growth':>10}  bound")
    for name, m in report["rss"].items():
        verdict = "within" if m["within_bound"] else "EXCEEDED"
        print(
            f"{name:<14}{m['start_mb']:>10}{m['peak_mb']:>10}{m['end_mb']:>10}"
            f"{m['growth_mb']:>10}  {verdict} {setup['rss_growth_bound_mb']} MB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--sustainable", type=float, default=200.0, help="requests/s served")
    parser.add_argument("--batch", type=int, default=16, help="worker max_batch_size")
    parser.add_argument("--factor", type=float, default=10.0, help="offered / sustainable")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    parser.add_argument("--timeout-ms", type=int, default=5000, help="each request's deadline")
    parser.add_argument("--max-queue-depth", type=int, default=2000)
    parser.add_argument("--connections", type=int, default=1024, help="the client's bound")
    parser.add_argument("--rss-growth-mb", type=float, default=150.0, help="allowed peak growth")
    parser.add_argument("--out", type=Path, default=ROOT / ".bench" / "overload.json")
    args = parser.parse_args()
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_report(report)
    sys.exit(0 if all(m["within_bound"] for m in report["rss"].values()) else 1)


if __name__ == "__main__":
    main()
