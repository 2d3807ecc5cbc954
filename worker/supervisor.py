"""`Supervisor`: how a worker's parts report a task that died of a bug.

Every part that runs background work (the loop's batches, the publisher's publishes, the
consumer's reader, reclaimer and watchers) reports an unexpected death here and nowhere
else. The first one is kept (`crashed`), the worker's stop is set and the loop woken, so the
process drains, exits non-zero and peers reclaim what it held, instead of reading on into
work nobody will ever finish.
"""

from __future__ import annotations

import asyncio
import logging

from worker.inbox import Inbox

log = logging.getLogger("microbatch.worker")


class Supervisor:
    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox
        self.stop = asyncio.Event()
        self.crashed: BaseException | None = None

    def watch(self, stop: asyncio.Event) -> None:
        """The stop event a crash sets: the one the worker's caller stops it with."""
        self.stop = stop

    def failed(self, exc: BaseException) -> None:
        if self.crashed is None:
            log.critical("a worker task failed; stopping", exc_info=exc)
            self.crashed = exc
        self.stop.set()
        self._inbox.wake()

    def ended(self, exc: BaseException | None) -> None:
        """`spawn_supervised`'s `on_death` for a task the worker cannot live without."""
        if exc is not None:
            self.failed(exc)
