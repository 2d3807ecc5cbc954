"""`spawn_supervised`: the only way to start a background task, so none dies silently.

Every task the project starts goes through here: an exception that ends one is logged and
handed to its owner's `on_death`, which fails whoever waits on it (and, for a task the
process cannot live without, marks the process not ready or stops it). The helper also holds
a reference to each task until it ends: asyncio keeps only weak ones, and a fire-and-forget
task nobody references can be collected mid-flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("microbatch.tasks")

OnDeath = Callable[[BaseException | None], None]
_alive: set[asyncio.Task[Any]] = set()


def only_logged(exc: BaseException | None) -> None:
    """The `on_death` of a task whose owner needs no word of its end: its own errors are
    handled inside it, and a bug that ends it has been logged here already."""


def spawn_supervised(
    name: str, coro: Coroutine[Any, Any, Any], on_death: OnDeath
) -> asyncio.Task[Any]:
    """Run `coro`; when it ends by anything but cancellation, call `on_death` with the
    exception that ended it (logged), or None when it returned."""
    task = asyncio.create_task(coro, name=name)
    _alive.add(task)

    def _done(t: asyncio.Task[Any]) -> None:
        _alive.discard(t)
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            log.error("background task %s died", name, exc_info=exc)
        on_death(exc)

    task.add_done_callback(_done)
    return task
