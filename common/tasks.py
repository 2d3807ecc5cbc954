"""`spawn_supervised`: the only way to start a background task, so none dies silently."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("microbatch.tasks")


def spawn_supervised(
    name: str, coro: Coroutine[Any, Any, Any], on_death: Callable[[BaseException | None], None]
) -> asyncio.Task:
    """Run `coro`; if it ends by anything but cancellation, log it and call `on_death`."""
    task = asyncio.create_task(coro, name=name)

    def _done(t: asyncio.Task) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            log.error("background task %s died", name, exc_info=exc)
        on_death(exc)

    task.add_done_callback(_done)
    return task
