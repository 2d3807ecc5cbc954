"""`--processes N`: N gateway processes on one port, each answering through its own reply stream.

Real processes throughout: a `microbatch gateway --processes 2` (or `serve`) parent, its
spawned children, a `noop` worker and a real redis-server. Which processes answered is read
from Redis itself: a gateway's reply stream is `mb:reply:<host>-<pid>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import Proc, Processes, wait_ready, wait_until, wait_workers

NOOP_DIM = 384


@pytest.fixture
def processes(cold_processes: Processes) -> Processes:
    """Started as a deployment starts them: this module is about how the CLI spawns and
    supervises its own processes, which a fork of the suite's preloaded server could hide."""
    return cold_processes


def _children(pid: int) -> set[int]:
    """Direct children of `pid`, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
    return found


def _gateway_children(proc: Proc) -> set[int]:
    """The parent's spawned gateways (not multiprocessing's resource tracker)."""
    out = set()
    for pid in _children(proc.popen.pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.add(pid)
    return out


def _alive(pid: int) -> bool:
    """Running, not a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _answering_pids(redis_url: str) -> set[int]:
    """The pids of the gateways that have a reply stream: the ones workers answered."""
    client = redis.Redis.from_url(redis_url)
    try:
        return {int(key.rsplit(b"-", 1)[1]) for key in client.scan_iter(match="mb:reply:*")}
    finally:
        client.close()


async def _burst(url: str, n: int) -> None:
    """`n` requests at once, on fresh connections; each must get its own, complete answer."""
    bodies = [[f"text {i} {j}" for j in range(1 + i % 3)] for i in range(n)]
    ids = [uuid.uuid4().hex for _ in range(n)]
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.post("/v1/embeddings", json={"input": body}, headers={"X-Request-ID": rid})
                for body, rid in zip(bodies, ids, strict=True)
            )
        )
    for body, rid, answer in zip(bodies, ids, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-request-id"] == rid
        data = answer.json()["data"]
        assert [d["index"] for d in data] == list(range(len(body)))
        assert all(len(d["embedding"]) == NOOP_DIM for d in data)


def _until_answered_by(proc: Proc, redis_url: str, pids: set[int]) -> set[int]:
    """Send bursts until every one of `pids` has answered; the answering pids."""

    def burst_then_look() -> set[int]:
        asyncio.run(_burst(proc.base_url, 32))
        return _answering_pids(redis_url)

    return wait_until(burst_then_look, 90, f"answers from gateway pids {pids}", until=pids.issubset)


def _two_gateways(proc: Proc) -> set[int]:
    return wait_until(
        lambda: _gateway_children(proc), 90, "two gateway processes", until=lambda c: len(c) == 2
    )


def _stop_and_check_all_gone(proc: Proc, children: set[int]) -> None:
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()[-3000:]
    wait_until(
        lambda: {p for p in children if _alive(p)}, 10, "every child gone", until=lambda s: not s
    )


def test_two_gateway_processes_share_the_port_and_each_answers_its_own_requests(
    processes: Processes, redis_url: str
) -> None:
    processes.start("worker", redis_url=redis_url, model="noop")
    gateway = processes.start("gateway", "--processes", "2", redis_url=redis_url)
    wait_ready(gateway)
    children = _two_gateways(gateway)
    every_child = _children(gateway.popen.pid)  # the resource tracker too: it must go as well

    assert _until_answered_by(gateway, redis_url, children) == children  # distinct gateway ids
    _stop_and_check_all_gone(gateway, every_child)


def test_a_gateway_process_that_dies_is_restarted_and_serves(
    processes: Processes, redis_url: str
) -> None:
    processes.start("worker", redis_url=redis_url, model="noop")
    gateway = processes.start("gateway", "--processes", "2", redis_url=redis_url)
    wait_ready(gateway)
    victim, survivor = sorted(_two_gateways(gateway))

    os.kill(victim, signal.SIGKILL)
    children = wait_until(
        lambda: _gateway_children(gateway),
        90,
        "a new gateway process in place of the killed one",
        until=lambda c: len(c) == 2 and victim not in c,
    )
    assert survivor in children
    (successor,) = children - {survivor}
    _until_answered_by(gateway, redis_url, {successor, survivor})
    assert "died (killed by SIGKILL); restarting" in gateway.output()
    _stop_and_check_all_gone(gateway, _children(gateway.popen.pid))


def test_serve_runs_the_gateways_in_processes_and_the_worker_once(
    processes: Processes, redis_url: str
) -> None:
    serve = processes.start("serve", "--processes", "2", redis_url=redis_url, model="noop")
    wait_workers(serve, "noop", 1)
    children = _two_gateways(serve)

    answered = _until_answered_by(serve, redis_url, children)
    assert serve.popen.pid not in answered  # the parent serves no HTTP: it runs the worker
    body = serve.output()
    assert body.count("serving noop as noop") == 1
    _stop_and_check_all_gone(serve, _children(serve.popen.pid))
    assert "drained after" in serve.output()  # the worker drained after the gateways


def test_a_port_already_taken_stops_the_gateway_at_start(
    processes: Processes, redis_url: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        gateway = processes.start("gateway", "--processes", "2", redis_url=redis_url, port=port)
        assert gateway.wait(60) == 3, gateway.output()
    assert "Address already in use" in gateway.output()
