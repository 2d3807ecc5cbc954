"""Shared fixtures: a real redis-server on a free port, real `microbatch` processes, the real model.

Fixtures are factories that clean up what they made. A missing redis-server binary is a
clear failure, never a skip.

Every test has one tier, so the inner loop can leave out what is slow to prove:
- `unit`: pure logic and the house rules (`tests/unit/`): no Redis, no model;
- `scenario`: in-process against real components (a real redis-server, the tiny models,
  burst-mode workers, an in-process gateway): the default for `tests/integration/`;
- `process`: what only real processes prove (signals, exit codes, `--processes`, Cluster
  failover, the CLI over HTTP): a test that uses the `processes` fixture, or a module
  marked `pytest.mark.process` because its module-scoped deployment starts processes.
`pytest -m "unit or scenario"` is the inner loop; the summary prints each tier's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

import httpx
import pytest
import redis

from common.streams import GROUP, Keys
from tests import forked
from tests.engines import HAS_VLLM

# The suite runs three pytest processes (-n 3) on two cores, each starting workers and
# gateways: a torch that spins an OpenMP team of one thread per core in every one of them
# oversubscribes the cores many times over. Measured on 5 modules: 108 s with torch's
# defaults, 88 s with passive waits, 80 s with one thread each; one schedule-drawing test
# went from 23.7 s to under 6 s. Set before anything here imports torch; `process_env` hands
# both to the processes the tests start (a worker there still sets its own thread count:
# one thread each gained nothing more, 84 s against 80 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "scenario", "process")
collect_ignore = [] if HAS_VLLM else ["vllm"]  # tests/engines.py says why


def tier_of(item: pytest.Item) -> str:
    """A test's tier: its own mark, else where it lives and what it starts."""
    for marker in item.iter_markers():
        if marker.name in TIERS:
            return marker.name
    if Path(str(item.fspath)).parent.name == "unit":
        return "unit"
    return "process" if "processes" in getattr(item, "fixturenames", ()) else "scenario"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        item.add_marker(tier)
        item.user_properties.append(("tier", tier))


_tier_seconds: dict[str, float] = {}
_tier_counts: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = dict(report.user_properties).get("tier", "unknown")
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration
    if report.when == "call":
        _tier_counts[tier] = _tier_counts.get(tier, 0) + 1


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """Time per tier (setup, call and teardown), so a slow tier shows where it grew."""
    if not _tier_seconds:
        return
    terminalreporter.section("time per tier")
    for tier in (*TIERS, *sorted(set(_tier_seconds) - set(TIERS))):
        if tier in _tier_seconds:
            terminalreporter.write_line(
                f"{tier:>9}: {_tier_counts.get(tier, 0):4d} tests, {_tier_seconds[tier]:7.1f} s"
            )


@pytest.fixture(autouse=True)
def no_leaked_sockets(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test that leaves a socket open (a client never closed, caught in a reference
    cycle). Left alone, its ResourceWarning surfaced at whatever later collection ran, and
    failed an unrelated test there: an in-process gateway's start collects garbage. Runs
    after the test's own fixtures are torn down; a module fixture's leak shows at the test
    after it. Survivors are frozen, so each check scans only what the test made (~20 ms)."""
    yield
    if request.node.get_closest_marker("unit"):
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    gc.freeze()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaked, f"left open by this test (or a module fixture ended before it): {leaked}"


def free_port() -> int:
    """A port nothing listens on, drawn below the kernel's range for outgoing connections:
    a port that range hands out (bind to port 0) can be taken by some client's connection
    before the server binds it, which failed a gateway's start on CI ("address in use")."""
    low = _ephemeral_low()
    while True:
        port = _PORTS.randint(10_000, low - 1)
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port))
            return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


_PORTS = random.SystemRandom()  # not the `random` a test may seed: xdist workers would agree


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 10000))
            return port


@dataclass
class RedisServer:
    port: int
    dir: Path
    proc: subprocess.Popen | None = None
    persist: bool = False  # an append-only file fsynced on every write: restarts keep all

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: .ci/run installs it with apt")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else []
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *persistence,
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            time.sleep(0.05)
        pytest.fail(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def flush(self) -> None:
        client = redis.Redis.from_url(self.url)
        client.flushall()
        client.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(free_port(), Path(tmp))
        server.start()
        yield server
        server.kill()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server for one module's deployment alone: the shared one is flushed by other
    tests at any time, and a request sent between a flush and its worker's next registration
    is a 404 (which made the tracing, fuzz and responses modules flaky on CI)."""
    server = RedisServer(free_port(), tmp_path_factory.mktemp("module-redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with room for tool prompts and conversations: its small vocabulary
    spells a tool schema out in hundreds of tokens (745 for two small tools)."""
    from worker.generate.tiny_model import TinyShape, write_tiny_model

    folder = tmp_path_factory.mktemp("tiny-4k") / "tiny-llama"
    return write_tiny_model(folder, TinyShape(max_positions=4096))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A real Redis, empty at the start of the test."""
    redis_server.flush()
    return redis_server.url


def process_env(**settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MICROBATCH_", "OTEL_"))}
    env.update({f"MICROBATCH_{k.upper()}": str(v) for k, v in settings.items()})
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | forked.Forked
    log: Path
    port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)


@dataclass
class Processes:
    """Starts `microbatch` roles as real processes and stops them all at teardown: forked
    from a server that imported torch once (`tests/forked.py`), or `cold`, each a new
    interpreter."""

    tmp: Path
    cold: bool = False
    started: list[Proc] = field(default_factory=list)

    def start(
        self, role: str, *args: str, env: dict[str, str] | None = None, **settings: object
    ) -> Proc:
        """`microbatch <role> *args`, configured by `settings` (as MICROBATCH_* variables)
        and any other variables in `env` (OTEL_*, say)."""
        return self.start_module("common.cli", role, *args, env=env, **settings)

    def start_module(
        self, module: str, *args: str, env: dict[str, str] | None = None, **settings: object
    ) -> Proc:
        """`python -m module *args`: a role (`common.cli`) or a test's own process
        (`tests.fault_worker`)."""
        role = args[0] if module == "common.cli" else module.rsplit(".", 1)[-1]
        port = None
        if role in ("serve", "gateway"):
            port = int(settings.setdefault("port", free_port()))
        log = self.tmp / f"{role}-{len(self.started)}.log"
        environment = process_env(**settings) | (env or {})
        popen: subprocess.Popen | forked.Forked
        if not self.cold:
            popen = forked.start(module, list(args), environment, ROOT, log)
        else:
            with log.open("wb") as handle:  # the child keeps its own descriptor
                popen = subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=ROOT,
                    env=environment,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
        proc = Proc(role, popen, log, port)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            proc.signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture
def closing() -> Iterator[contextlib.ExitStack]:
    """Closes at teardown what a test opened with `closing.enter_context(...)`: a client
    left to the garbage collector leaves its pooled socket open (`no_leaked_sockets`)."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def cold_processes(tmp_path: Path) -> Iterator[Processes]:
    """Each process a new interpreter, as a deployment starts it: for what a fork of a
    preloaded server could hide (the CLI's own imports, how it spawns its children)."""
    procs = Processes(tmp_path, cold=True)
    yield procs
    procs.stop_all()


async def fire(url: str, bodies: list[dict], headers: dict | None = None) -> list[httpx.Response]:
    """POST every body to /v1/embeddings at once; the answers in order."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(
            *(client.post("/v1/embeddings", json=b, headers=headers) for b in bodies)
        )


def texts(n: int, tag: str = "text") -> list[dict]:
    return [{"input": f"{tag} {i}"} for i in range(n)]


T = TypeVar("T")


def _brief(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def wait_until(
    observe: Callable[[], T],
    timeout_s: float,
    what: str,
    until: Callable[[T], object] = bool,
    interval_s: float = 0.05,
) -> T:
    """Poll `observe()` until `until` holds for what it returns (by default: until it is
    truthy), and return that; after `timeout_s`, fail naming `what` and the last value seen.

    What a test waits with instead of a fixed sleep: the condition the sleep was betting on,
    so a loaded machine waits longer and a quick one does not wait at all.
    """
    deadline = time.monotonic() + timeout_s
    while not until(value := observe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout_s:g} s (last: {_brief(value)})")
        time.sleep(interval_s)
    return value


async def eventually(
    observe: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    until: Callable[[T], object] = bool,
    interval_s: float = 0.05,
) -> T:
    """`wait_until` inside an event loop: the loop's other tasks run between polls, and
    `observe` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = observe()
        if inspect.isawaitable(value):
            value = await value
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout_s:g} s (last: {_brief(value)})")
        await asyncio.sleep(interval_s)


class QueueCounts(NamedTuple):
    length: int  # XLEN over the model's request streams: entries are deleted once acked
    pending: int  # XPENDING: delivered to a worker and not yet acked


def queue_counts(redis_url: str, model: str = "noop", prefix: str = "mb") -> QueueCounts:
    """What Redis holds for a model's request streams now, summed over its buckets."""
    client = redis.Redis.from_url(redis_url)
    try:
        length = pending = 0
        every_bucket = Keys(prefix).request(model, "*")  # a SCAN pattern
        for stream in client.scan_iter(match=every_bucket):
            length += client.xlen(stream)
            with contextlib.suppress(redis.ResponseError):  # no group yet: nothing delivered
                pending += client.xpending(stream, GROUP)["pending"]
        return QueueCounts(length, pending)
    finally:
        client.close()


def wait_ready(proc: Proc, timeout: float = 120.0, models: int = 1) -> None:
    """Until /readyz says every model has a live worker (and at least `models` models)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            pytest.fail(
                f"{proc.name} exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            last = httpx.get(f"{proc.base_url}/readyz", timeout=2)
            found = last.json()["models"] if last.status_code == 200 else {}
            if len(found) >= models and all(m["live_workers"] > 0 for m in found.values()):
                return
        time.sleep(0.2)
    body = last.text if last is not None else "no answer"
    pytest.fail(f"{proc.name} not ready after {timeout}s: {body}\n{proc.output()[-3000:]}")


def wait_workers(proc: Proc, model: str, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            body = httpx.get(f"{proc.base_url}/readyz", timeout=2).json()
            if body["models"][model]["live_workers"] >= count:
                return
        time.sleep(0.2)
    pytest.fail(f"{count} workers for {model} never became live")


@pytest.fixture(scope="session")
def reference_model():
    """sentence-transformers' own encoder for the default model, full 512 positions."""
    from sentence_transformers import SentenceTransformer

    from worker.models import default_model_path

    model = SentenceTransformer(str(default_model_path()), device="cpu")
    model.max_seq_length = 512
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight Llama `microbatch tiny-model` writes (fixed seed), once per run."""
    from worker.generate.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")
