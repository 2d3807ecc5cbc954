"""`Supervisor`: N gateway processes on one port; a crashed one is restarted, a signal stops all.

One event loop caps a gateway at one core, so `--processes N` runs N of them. Each child binds
its own listening socket with SO_REUSEPORT and the kernel spreads new connections evenly over
them (one socket shared by all wakes every process per connection and favours the busiest).
The parent keeps the port bound but not listening: a port someone else holds fails at start,
port 0 is resolved once for all, and no connection ever queues on the parent. Children are
spawned (a fresh interpreter, not a fork: `serve`'s parent runs torch threads that a fork
would copy mid-flight), and each builds its own app, Redis connections, gateway id and reply
stream.

A child that dies while the parent is not stopping is restarted, as gunicorn and uvicorn
restart a dead worker, after a delay that grows while it keeps dying young. One that could not
start (exit 3: port or app start-up; exit 2: Redis refused us) stops them all with its code: a
restart cannot fix configuration. On SIGTERM or SIGINT the parent passes SIGTERM on, each child
drains (its in-flight requests finish), and the parent returns once every child is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from common.backoff import Backoff
from common.settings import Settings

log = logging.getLogger("microbatch.processes")

REFUSED = 2  # Redis refused our credentials: retrying cannot help (common.cli.roles)
START_FAILED = 3  # uvicorn's STARTUP_FAILURE: the port, or the app's start-up, failed
STABLE_S = 30.0  # a child that lived this long crashed once; it was not crash-looping
STOP_GRACE_S = 40.0  # past uvicorn's 30 s graceful shutdown; then SIGKILL
BACKLOG = 2048  # uvicorn's default listen backlog

# What a child runs: its settings and the parent's pid (see `die_with_parent`).
Target = Callable[[Settings, int], None]


def reuse_port_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket on (host, port) that other processes of this user may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def die_with_parent(parent_pid: int) -> None:
    """Have Linux send this child SIGTERM when its parent dies, so a parent killed with
    SIGKILL leaves no gateway serving unsupervised; the child then drains as on any SIGTERM.
    (The signal follows the thread that spawned the child: the parent's main thread.)"""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def child_settings(settings: Settings, index: int, port: int) -> Settings:
    """Child `index`'s settings: the port resolved, and its own gateway id where one was
    given (the default, host + pid, already differs per process)."""
    update: dict[str, object] = {"port": port, "processes": 1}
    if settings.gateway_id is not None:
        update["gateway_id"] = f"{settings.gateway_id}-{index}"
    return settings.model_copy(update=update)


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@dataclass(slots=True)
class _Child:
    index: int
    settings: Settings
    process: BaseProcess | None = None
    started_s: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(first_s=0.5, cap_s=10.0))
    restart: asyncio.TimerHandle | None = None


class Supervisor:
    """Runs `target` in `settings.processes` children until `stop()`; `run` returns the exit
    code the parent should end with."""

    def __init__(self, target: Target, settings: Settings) -> None:
        self._target = target
        self._settings = settings
        self._spawn = multiprocessing.get_context("spawn")
        self._events: asyncio.Queue[_Child | None] = asyncio.Queue()  # exits; None: stop
        self._children: list[_Child] = []
        self._stopping = False

    def stop(self) -> None:
        """Stop every child (they drain); safe from a signal handler and before `run`."""
        if not self._stopping:
            self._stopping = True
            self._events.put_nowait(None)

    async def run(self) -> int:
        try:
            reserved = reuse_port_socket(self._settings.host, self._settings.port, listen=False)
        except OSError as exc:
            log.error("cannot bind %s:%d: %s", self._settings.host, self._settings.port, exc)
            return START_FAILED
        port = reserved.getsockname()[1]
        self._children = [
            _Child(i, child_settings(self._settings, i, port))
            for i in range(self._settings.processes)
        ]
        try:
            if not self._stopping:
                for child in self._children:
                    self._start(child)
                log.info("%d gateway processes on port %d", len(self._children), port)
            code = await self._watch()
        finally:
            stopped = await self._stop_all()
            reserved.close()
        return max(code, stopped)

    def _start(self, child: _Child) -> None:
        child.restart = None
        process = self._spawn.Process(
            target=self._target,
            args=(child.settings, os.getpid()),
            name=f"microbatch-gateway-{child.index}",
            daemon=True,  # the interpreter's exit terminates any we failed to stop
        )
        process.start()
        child.process, child.started_s = process, time.monotonic()
        loop = asyncio.get_running_loop()
        loop.add_reader(process.sentinel, self._exited, child)
        log.info("gateway process %d started (pid %s)", child.index, process.pid)

    def _exited(self, child: _Child) -> None:
        if child.process is not None:
            asyncio.get_running_loop().remove_reader(child.process.sentinel)
        self._events.put_nowait(child)

    async def _watch(self) -> int:
        """Restart children that die, until a stop or a child that could not start."""
        while (child := await self._events.get()) is not None:
            process = child.process
            if process is None or self._stopping:
                continue
            process.join()
            code = process.exitcode
            if code in (REFUSED, START_FAILED):
                log.error(
                    "gateway process %d could not start (%s); stopping all",
                    child.index,
                    describe_exit(code),
                )
                child.process = None  # reported: nothing to stop
                return int(code)
            if time.monotonic() - child.started_s >= STABLE_S:
                child.backoff.reset()
            delay = child.backoff.next_s()
            log.error(
                "gateway process %d (pid %s) died (%s); restarting it in %.1f s",
                child.index,
                process.pid,
                describe_exit(code),
                delay,
            )
            child.process = None
            self._restart_later(child, delay)
        return 0

    def _restart_later(self, child: _Child, delay_s: float) -> None:
        child.restart = asyncio.get_running_loop().call_later(delay_s, self._restart, child)

    def _restart(self, child: _Child) -> None:
        try:
            self._start(child)
        except OSError as exc:  # out of processes or descriptors, for now: try again later
            delay = child.backoff.next_s()
            log.error(
                "gateway process %d: restart failed (%s); again in %.1f s", child.index, exc, delay
            )
            self._restart_later(child, delay)

    async def _stop_all(self) -> int:
        """SIGTERM every child, wait for it to drain (SIGKILL past the grace): 0 when every
        one stopped cleanly, else 1."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        live: list[tuple[_Child, BaseProcess]] = []
        for child in self._children:
            if child.restart is not None:
                child.restart.cancel()
            if child.process is not None:
                loop.remove_reader(child.process.sentinel)
                child.process.terminate()
                live.append((child, child.process))
        deadline = time.monotonic() + STOP_GRACE_S
        code = 0
        for child, process in live:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("gateway process %d did not drain in time; killing it", child.index)
                process.kill()
                await asyncio.to_thread(process.join)
            if process.exitcode not in (0, -signal.SIGTERM):
                log.error("gateway process %d: %s", child.index, describe_exit(process.exitcode))
                code = 1
        return code
