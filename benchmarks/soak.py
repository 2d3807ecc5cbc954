"""Soak under faults: the durability promise, held for minutes while processes die.

    .venv/bin/python benchmarks/soak.py                 # 10 minutes (~11 with start and stop)
    .venv/bin/python benchmarks/soak.py --minutes 2 --out /tmp/soak.json --plot /tmp/soak.png

Why: the unit and integration tests each prove one fault at a time; this runs them all,
repeatedly, under steady mixed load, and checks what a client was promised: every request
the gateway accepted gets exactly one answer, none after its deadline, no streamed answer
has a silent hole, and Redis memory stays flat (nothing leaks into streams or keys).

How: in a temp dir (printed; every process logs there), redis-server with an append-only
file (fsync every second), a tiny Llama and cross-encoder (`microbatch tiny-model`), workers
(2 `noop`, 1 reranker, 2 chat; beat 500 ms, stale after 3 s, claims after 10 s) and one
gateway. Load (`benchmarks/soak_load.py`): 4 single-text embedding loops, 1 bulk (300 texts),
1 rerank (8 documents), 2 streamed chats, back to back, 20 s deadline each. Faults: every
60 s a worker is SIGKILLed (rotating over all) and replaced; every 60 s offset by 30 s one is
SIGTERMed and replaced once drained; at 40% Redis restarts (SIGTERM: a clean AOF shutdown),
at 70% the gateway. Every second Redis' `used_memory` and the counters are sampled.

Printed: a summary, a PASS/FAIL line per goal; written: the JSON report (`--out`) and a
plot of used_memory with the faults marked (`--plot`). Exit status 0 always: it is a report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import soak_load
from benchmarks.batching import free_port, microbatch
from benchmarks.soak_load import Load

ROOT = Path(__file__).resolve().parent.parent
LOOPS = {"embed": 4, "bulk": 1, "rerank": 1, "chat": 2}
LIVENESS = {"heartbeat_interval_ms": 500, "worker_stale_ms": 3000, "claim_idle_ms": 10000}
# (slot, model folder or name, served name), in the order the faults rotate over them
WORKERS = [
    ("noop-0", "noop", "noop"),
    ("chat-0", "tiny-llama", "chat"),
    ("reranker-0", "tiny-reranker", "reranker"),
    ("noop-1", "noop", "noop"),
    ("chat-1", "tiny-llama", "chat"),
]
COUNTER = r"^{name}(?:\{{[^}}]*\}})? (\S+)$"


def metric(text: str, name: str) -> float:
    """The sum of a counter's samples in a Prometheus exposition (0 when absent)."""
    return sum(float(v) for v in re.findall(COUNTER.format(name=name), text, re.M))


@dataclass
class Worker:
    slot: str
    model: str
    served: str
    proc: subprocess.Popen | None = None
    metrics_port: int = 0
    incarnation: int = 0


class Stack:
    """redis-server, workers and one gateway as subprocesses, each logging to the temp dir."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.redis_port, self.gateway_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.redis: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.gateway_incarnation = 0
        self.workers = [Worker(*spec) for spec in WORKERS]
        self.crashes: dict[int, dict] = {}  # pid -> a process that exited without a fault

    def note_crashes(self, t: float) -> None:
        """Any process that exited unasked (a fault sets its slot to None while it acts)."""
        named = [("redis", self.redis), ("gateway", self.gateway)]
        for name, proc in [*named, *((w.slot, w.proc) for w in self.workers)]:
            if proc is not None and proc.poll() is not None and proc.pid not in self.crashes:
                self.crashes[proc.pid] = {"t": t, "process": name, "exit": proc.returncode}
                print(f"[{t:6.1f} s] {name} (pid {proc.pid}) exited on its own", flush=True)

    def env(self, **settings: object) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_")}
        redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        settings = {"redis_url": redis_url, "log_format": "text", **LIVENESS, **settings}
        env.update({f"MICROBATCH_{k.upper()}": str(v) for k, v in settings.items()})
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        return env

    def spawn(self, args: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        with (self.tmp / log).open("ab") as handle:
            return subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT
            )

    def write_models(self) -> None:
        for kind, folder in (("causal-lm", "tiny-llama"), ("cross-encoder", "tiny-reranker")):
            args = [*microbatch("tiny-model"), "--kind", kind, str(self.tmp / folder)]
            subprocess.run(args, cwd=ROOT, env=self.env(), check=True, timeout=300)

    def start_redis(self) -> None:
        directory = self.tmp / "redis"
        directory.mkdir(exist_ok=True)
        args = [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port)]
        args += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", "everysec", "--dir", str(directory)]
        self.redis = self.spawn(args, {}, "redis.log")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.redis_port), 0.2),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.redis_port}")

    def start_worker(self, w: Worker) -> None:
        model = w.model if w.model == "noop" else str(self.tmp / w.model)
        w.metrics_port, w.incarnation = free_port(), w.incarnation + 1
        env = self.env(
            model=model, served_model_name=w.served, metrics_port=w.metrics_port, torch_threads=1
        )
        w.proc = self.spawn(microbatch("worker"), env, f"worker-{w.slot}.log")

    def start_gateway(self) -> None:
        self.gateway_incarnation += 1
        env = self.env(model="noop", port=self.gateway_port)
        self.gateway = self.spawn(microbatch("gateway"), env, "gateway.log")

    def wait_ready(self, timeout_s: float, workers: int = 0) -> bool:
        """/readyz 200 naming 3 models, and `workers` live workers if they come in time."""
        deadline, seen = time.monotonic() + timeout_s, False
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{self.url}/readyz", timeout=2)
                live = [m["live_workers"] for m in r.json().get("models", {}).values()]
                seen = r.status_code == 200 and len(live) >= 3
                if seen and sum(live) >= workers:
                    return True
            time.sleep(0.25)
        return seen

    @staticmethod
    def stop(proc: subprocess.Popen | None, timeout_s: float) -> None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL."""
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop_all(self) -> None:
        """The gateway, then every worker at once, then Redis; SIGKILL whatever outstays."""
        self.stop(self.gateway, 40)
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.stop(self.redis, 10)


class Faults:
    """The schedule of faults, run in order on threads so the load never stops for them."""

    def __init__(self, stack: Stack, duration_s: float) -> None:
        self.stack = stack
        self.log: list[dict] = []
        self.turn = 0  # the next worker slot to hit, shared by SIGKILL and SIGTERM
        kills = [(float(t), self.sigkill) for t in range(60, int(duration_s), 60)]
        terms = [(float(t), self.sigterm) for t in range(30, int(duration_s), 60)]
        whole = [(0.4 * duration_s, self.restart_redis), (0.7 * duration_s, self.restart_gateway)]
        self.schedule = sorted([*kills, *terms, *whole], key=lambda item: item[0])

    async def run(self, load: Load, stop: asyncio.Event) -> None:
        for at, action in self.schedule:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, at - load.now()))
            if stop.is_set():
                return
            started = load.now()
            what = await asyncio.to_thread(action)
            took = round(load.now() - started, 1)
            entry = {"t": round(started, 1), "took_s": took, "fault": what}
            self.log.append(entry)
            print(f"[{entry['t']:6.1f} s] {what} (took {entry['took_s']} s)", flush=True)

    def _victim(self) -> tuple[Worker, subprocess.Popen]:
        """The next worker in turn, its slot emptied while the fault acts on its process."""
        w = self.stack.workers[self.turn % len(self.stack.workers)]
        self.turn += 1
        proc, w.proc = w.proc, None
        assert proc is not None
        return w, proc

    def sigkill(self) -> str:
        w, proc = self._victim()
        proc.kill()
        proc.wait(10)
        self.stack.start_worker(w)
        return f"SIGKILL worker {w.slot} (pid {proc.pid}), replaced"

    def sigterm(self) -> str:
        w, proc = self._victim()
        self.stack.stop(proc, 60)  # drained, or SIGKILLed after 60 s (exit -9)
        self.stack.start_worker(w)
        return f"SIGTERM worker {w.slot} (pid {proc.pid}), exit {proc.returncode}, replaced"

    def restart_redis(self) -> str:
        old, self.stack.redis = self.stack.redis, None
        self.stack.stop(old, 30)
        self.stack.start_redis()
        return f"restart Redis (SIGTERM, exit {old and old.returncode}; same port and dir)"

    def restart_gateway(self) -> str:
        old, self.stack.gateway = self.stack.gateway, None
        self.stack.stop(old, 45)
        self.stack.start_gateway()
        ready = self.stack.wait_ready(60)
        return f"restart gateway (SIGTERM, exit {old and old.returncode}; ready again: {ready})"


class Sampler:
    """Once a second: Redis used_memory and each process's counters (last value per process)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.memory: list[tuple[float, int | None]] = []
        self.duplicates: dict[int, float] = {}  # gateway incarnation -> duplicate replies
        self.redeliveries: dict[str, float] = {}  # worker slot#incarnation -> counter
        self.dead_letters: dict[str, float] = {}
        self.redis = aioredis.Redis(
            port=stack.redis_port, socket_timeout=1, socket_connect_timeout=1
        )

    async def run(self, load: Load, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=1) as client:
            while not stop.is_set():
                await self.sample(load.now(), client)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            await self.sample(load.now(), client)
        await self.redis.aclose()

    async def sample(self, t: float, client: httpx.AsyncClient) -> None:
        self.stack.note_crashes(t)
        used = None
        with contextlib.suppress(Exception):  # Redis restarting: a gap in the series
            used = int((await self.redis.info("memory"))["used_memory"])
        self.memory.append((round(t, 1), used))
        gateway = await self._metrics(client, f"{self.stack.url}/metrics")
        if gateway is not None:
            found = metric(gateway, "microbatch_duplicate_replies_total")
            self.duplicates[self.stack.gateway_incarnation] = found
        for w in self.stack.workers:
            text = await self._metrics(client, f"http://127.0.0.1:{w.metrics_port}/metrics")
            if text is not None:
                key = f"{w.slot}#{w.incarnation}"
                self.redeliveries[key] = metric(text, "microbatch_redeliveries_total")
                self.dead_letters[key] = metric(text, "microbatch_dead_letters_total")

    @staticmethod
    async def _metrics(client: httpx.AsyncClient, url: str) -> str | None:
        try:
            r = await client.get(url)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None


async def soak(stack: Stack, minutes: float) -> dict:
    duration_s = minutes * 60
    load = Load(stack.url, time.monotonic())
    await load.fetch_references()
    load.t0 = time.monotonic()
    stop = asyncio.Event()
    faults, sampler = Faults(stack, duration_s), Sampler(stack)
    tasks = [
        asyncio.create_task(load.run(LOOPS, stop)),
        asyncio.create_task(faults.run(load, stop)),
        asyncio.create_task(sampler.run(load, stop)),
    ]
    await asyncio.sleep(duration_s)
    stop.set()
    print(f"[{load.now():6.1f} s] load stopped; waiting for requests in flight", flush=True)
    _, pending = await asyncio.wait(tasks, timeout=120)
    for task in pending:
        task.cancel()
    return {
        "setup": {"minutes": minutes, "loops": LOOPS, "workers": WORKERS, **LIVENESS},
        "references": len(load.references),
        "summary": soak_load.summarize(load.records, faults.log),
        "faults": faults.log,
        "memory": soak_load.memory_report(sampler.memory, duration_s),
        "memory_series": sampler.memory,
        "duplicate_replies_dropped": sum(sampler.duplicates.values()),
        "redeliveries": sum(sampler.redeliveries.values()),
        "dead_letters": sum(sampler.dead_letters.values()),
        "crashes": list(stack.crashes.values()),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["memory_series"]
    t = [p[0] for p in series]
    mb = [p[1] / 2**20 if p[1] is not None else float("nan") for p in series]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.plot(t, mb, lw=1.2, color="tab:blue", label="Redis used_memory")
    top = max((v for v in mb if v == v), default=1.0) * 1.5
    for fault in report["faults"]:
        ax.axvline(fault["t"], color="tab:red", lw=0.8, ls="--")
        label = fault["fault"].split(" (")[0]
        ax.text(fault["t"], top, label, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("MB")
    ax.set_ylim(0, top)
    ax.set_title(f"Soak, {report['setup']['minutes']} min under faults: Redis memory")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "data" / "soak.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "data" / "soak.png")
    parser.add_argument("--flat-mb", type=float, default=5.0, help="allowed used_memory drift")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (apt-get install redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"logs and data in {tmp}", flush=True)
    stack = Stack(tmp)
    try:
        stack.write_models()
        stack.start_redis()
        for w in stack.workers:
            stack.start_worker(w)
        stack.start_gateway()
        if not stack.wait_ready(300, workers=len(WORKERS)):
            raise SystemExit(f"the stack never became ready with 3 models; see {tmp}")
        print("ready: 3 models, 5 workers; load and faults start", flush=True)
        report = asyncio.run(soak(stack, args.minutes))
    finally:
        stack.stop_all()
    report["log_dir"] = str(tmp)
    report["goals"] = [
        {"goal": name, "pass": ok, "detail": detail}
        for name, ok, detail in soak_load.goals(report, args.flat_mb)
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.plot)
    soak_load.print_summary(report, args.flat_mb)
    print(f"wrote {args.out} and {args.plot}; logs in {tmp}")


if __name__ == "__main__":
    main()
