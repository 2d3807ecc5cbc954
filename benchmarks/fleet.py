"""Local fleets for the scale-out and Redis-cost benchmarks: one redis-server or a 3-master
Cluster, `microbatch` gateways and workers as real processes, wrk to load them.

Everything is started inside an `ExitStack`, so a failure or Ctrl-C anywhere still stops
every process this module started (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from redis.cluster import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import env_with, free_port, microbatch, parse_wrk, started
from tests.conftest import cluster_port  # the suite's helper, as generation.py uses free_port

MODEL = "noop"


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise SystemExit(f"{binary} is not installed: apt-get install -y wrk redis-server")
    return path


def host_cpu() -> str:
    """The CPU model and count as lscpu names them, for the record beside every figure."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s+(.+)", out)
    return f"{model.group(1).strip() if model else 'unknown CPU'}, {os.cpu_count()} CPUs"


@dataclass
class RedisDeployment:
    """One server (`single`) or three masters without replicas (`cluster`)."""

    kind: str
    ports: list[int]
    pids: list[int]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"  # any node, for a cluster

    def client(self) -> redis.Redis | RedisCluster:
        if self.kind == "cluster":
            return RedisCluster(host="127.0.0.1", port=self.ports[0])
        return redis.Redis(port=self.ports[0])

    def node_clients(self) -> list[redis.Redis]:
        """One plain client per server: INFO is per node, and a cluster's sum is the cost."""
        return [redis.Redis(port=p) for p in self.ports]

    def settings(self) -> dict[str, object]:
        extra = {"redis_cluster": "true"} if self.kind == "cluster" else {}
        return {"redis_url": self.url, **extra}


def _ping(port: int) -> bool:
    with contextlib.suppress(redis.RedisError), redis.Redis(port=port, socket_timeout=1) as c:
        return bool(c.ping())
    return False


def _cluster_ok(port: int) -> bool:
    with contextlib.suppress(redis.RedisError), redis.Redis(port=port, socket_timeout=1) as c:
        return c.cluster("info")["cluster_state"] == "ok"
    return False


def poll(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not seen within {timeout_s:g} s")
        time.sleep(0.1)


def start_redis(kind: str, stack: ExitStack, folder: Path) -> RedisDeployment:
    """Start the servers inside `stack`; a cluster is joined with `redis-cli --cluster create`."""
    binary = need("redis-server")
    ports = [cluster_port() for _ in range(3)] if kind == "cluster" else [free_port()]
    pids = []
    for port in ports:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(folder)]
        if kind == "cluster":
            args += ["--cluster-enabled", "yes"]
            args += ["--cluster-config-file", str(folder / f"nodes-{port}.conf")]
        proc = stack.enter_context(started(args, env_with(), folder / f"redis-{port}.log"))
        pids.append(proc.pid)
    for port in ports:
        poll(lambda p=port: _ping(p), 10, f"redis-server on {port}")
    if kind == "cluster":
        addresses = [f"127.0.0.1:{p}" for p in ports]
        no_replicas = ["--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(
            [need("redis-cli"), "--cluster", "create", *addresses, *no_replicas],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for port in ports:
            poll(lambda p=port: _cluster_ok(p), 30, f"cluster_state:ok on {port}")
    return RedisDeployment(kind, ports, pids)


@dataclass
class Fleet:
    """Gateways and workers of the `noop` model on one Redis deployment, grown on demand."""

    redis: RedisDeployment
    stack: ExitStack
    folder: Path
    worker_settings: dict[str, object]
    workers: list[str] = field(default_factory=list)  # consumer names, in start order
    gateways: list[str] = field(default_factory=list)  # base URLs
    pids: dict[str, list[int]] = field(default_factory=lambda: {"gateway": [], "worker": []})

    def _common(self) -> dict[str, object]:
        return {"model": MODEL, "max_queue_depth": 100_000, **self.redis.settings()}

    def grow_workers(self, count: int) -> None:
        """Start workers until `count` run, and wait until a gateway sees them all live."""
        while len(self.workers) < count:
            name = f"w{len(self.workers)}"
            env = env_with(worker_id=name, **self._common(), **self.worker_settings)
            proc = self.stack.enter_context(started(microbatch("worker"), env, self.folder / name))
            self.pids["worker"].append(proc.pid)
            self.workers.append(name)
        if self.gateways:
            wait_live_workers(self.gateways[0], count)

    def grow_gateways(self, count: int) -> None:
        while len(self.gateways) < count:
            port = free_port()
            name = f"gw{len(self.gateways)}"
            env = env_with(port=port, gateway_id=name, **self._common())
            proc = self.stack.enter_context(started(microbatch("gateway"), env, self.folder / name))
            self.pids["gateway"].append(proc.pid)
            url = f"http://127.0.0.1:{port}"
            poll(lambda u=url: _answers(u), 120, f"gateway {name} up")
            self.gateways.append(url)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    return False


def _live_workers(url: str) -> int:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        return int(httpx.get(f"{url}/readyz", timeout=2).json()["models"][MODEL]["live_workers"])
    return 0


def wait_live_workers(url: str, count: int, timeout_s: float = 180) -> None:
    poll(lambda: _live_workers(url) >= count, timeout_s, f"{count} live {MODEL} workers")


@contextmanager
def wrk_all(
    urls: list[str], connections: int, duration_s: float, script: Path
) -> Iterator[list[subprocess.Popen]]:
    """One wrk process per gateway, `connections` shared evenly, started together."""
    wrk = need("wrk")
    procs = []
    try:
        for i, url in enumerate(urls):
            share = connections // len(urls) + (1 if i < connections % len(urls) else 0)
            args = [wrk, "-t1", f"-c{share}", f"-d{duration_s:g}s", "--timeout", "30s"]
            args += ["--latency", "-s", str(script), f"{url}/v1/embeddings"]
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, text=True))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def wrk_results(procs: list[subprocess.Popen]) -> list[dict]:
    """Wait for every wrk and parse what it printed."""
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    for proc, out in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"wrk exited with {proc.returncode}:\n{out}")
    return [parse_wrk(out) for out in outs]


def cpu_busy_share(before: list[int], after: list[int]) -> float:
    """The machine's busy share between two /proc/stat 'cpu' lines (all processes)."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    idle = delta[3] + delta[4]  # idle + iowait
    return 1 - idle / max(1, sum(delta))


def proc_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:8]]


TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU the processes used so far (/proc/<pid>/stat); a gone one counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICKS_PER_S
