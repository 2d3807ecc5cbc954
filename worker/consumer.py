"""`Consumer`: an intake and its loop run together, until stopped or, in burst mode, until idle.

It starts the intake's reader, the reclaimer and the cancellation watcher as supervised tasks
beside the loop; any of them dying of a bug stops the whole worker (`crashed`), so the process
exits non-zero and peers reclaim what it held. `run_until_idle` (arq's burst mode) reads what
the streams hold now, answers it and returns: scenario tests drive a worker in-process with an
injected runner and never sleep on timing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from common.tasks import spawn_supervised
from worker.compute_threads import ComputeThreads
from worker.intake import Intake, Loop
from worker.reclaim import Reclaimer

log = logging.getLogger("microbatch.worker")


class RunningLoop(Loop, Protocol):
    """A loop the consumer drives: the embedding loop or the generation loop."""

    batches_run: int

    @property
    def busy(self) -> bool:
        """Whether it holds or computes anything."""
        ...

    async def run(self, stop: asyncio.Event, reading: Callable[[], bool]) -> None:
        """Schedule until `stop` and, after it, until everything held is answered."""
        ...

    async def finish(self) -> None:
        """Wait for whatever still computes."""
        ...


class Consumer:
    def __init__(self, intake: Intake, loop: RunningLoop, compute: ComputeThreads) -> None:
        self.intake = intake
        self.loop = loop
        self.crashed: BaseException | None = None  # a task died of a bug: exit non-zero
        self._compute = compute
        self._stop = asyncio.Event()
        intake.on_crash = self._crash
        self._reclaimer = Reclaimer(
            intake.store,
            intake.name,
            intake.streams,
            claim_idle_ms=intake.settings.claim_idle_ms,
            accept=intake.accept,
            room=loop.room,
            owned=intake.owned,
            hung=loop.hung,
            orphans=intake.orphaned_streams,
        )

    @property
    def name(self) -> str:
        return self.intake.name

    def _crash(self, exc: BaseException) -> None:
        if self.crashed is None:
            log.critical("a worker task failed; stopping", exc_info=exc)
            self.crashed = exc
        self._stop.set()

    def _ended(self, exc: BaseException | None) -> None:
        if exc is not None:
            self.intake.crash(exc)

    def _idle(self) -> bool:
        return not self.loop.busy and not self.intake.publishing

    async def run_until_idle(self) -> None:
        """Answer what the streams hold now, then return (burst mode)."""
        await self.run(asyncio.Event(), until_idle=True)

    async def run(self, stop: asyncio.Event, *, until_idle: bool = False) -> None:
        """Consume until `stop`; then finish and ack everything held, and return."""
        self._stop = stop
        intake = self.intake
        await intake.ensure_groups(stop)
        await intake.poll_cancellations()  # know who left before reading their entries
        await self._reclaimer.drain_own_pending()
        idle = self._idle if until_idle else None
        reader = spawn_supervised("reader", intake.read_loop(stop, idle), self._ended)
        tasks = [
            reader,
            spawn_supervised("reclaimer", self._reclaimer.run(stop), self._ended),
            spawn_supervised("cancellations", intake.watch_cancellations(stop), self._ended),
            spawn_supervised(
                "orphans",
                self._reclaimer.adopt_orphans(stop, intake.settings.worker_stale_ms / 2000),
                self._ended,
            ),
        ]
        try:
            await self.loop.run(stop, reading=lambda: not reader.done())
        except BaseException as exc:
            self._crash(exc)  # a crashed loop must end the process, not leave it hanging
            raise
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.finish()
            await intake.flush()
            self._compute.shutdown()
            await intake.leave()
