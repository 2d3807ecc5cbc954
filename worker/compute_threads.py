"""The threads a worker computes on: one per stream, and only the first ever runs wide.

libgomp (torch's OpenMP on Linux) lets idle team threads spin for a while, which makes the
many small parallel regions of a forward pass fast, but only while the process has no more
OpenMP threads than cores; past that it barely spins, and every forward slows down. Each
thread that runs a multi-threaded region keeps a team of its own, so a lone batch on every
core must always run on the same thread (stream 0), and the model is loaded there too. On
2 cores, one text: 17 ms when one thread ever ran wide, 25-46 ms once two had.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ComputeThreads:
    def __init__(self) -> None:
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-0")]

    def ensure(self, streams: int) -> None:
        """At least `streams` threads (more are added, never removed)."""
        while len(self._pools) < streams:
            name = f"compute-{len(self._pools)}"
            self._pools.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=name))

    @property
    def first(self) -> ThreadPoolExecutor:
        """Stream 0: where the model loads and where a batch on every core runs."""
        return self._pools[0]

    def submit(self, stream: int, fn: Callable[..., T], *args, **kwargs) -> Future[T]:
        return self._pools[stream].submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)


def free_stream(busy: set[int], streams: int, wide: bool) -> int | None:
    """The stream a batch should run on: stream 0 for a wide one (all cores), else the
    highest free one, keeping stream 0 free for a lone batch; None if none fits."""
    if wide:
        return None if 0 in busy else 0
    free = [s for s in range(streams) if s not in busy]
    return max(free) if free else None
