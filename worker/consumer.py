"""`Consumer`: a worker's parts composed and run together, until stopped or, in burst mode,
until idle.

`compose` wires the parts one way each: the intake hands the loop what it reads (and takes
leases), the loop posts outcomes to the publisher (which releases them), the liveness part
and the reclaimer ask the loop only `held`, `hung` and `room`, and everyone reports a death
to the supervisor. `run` starts the reader, the reclaimer, the beat and the watchers as
supervised tasks beside the loop; any of them dying of a bug stops the whole worker
(`crashed`), so the process exits non-zero and peers reclaim what it held.
`run_until_idle` (arq's burst mode) reads what the streams hold now, answers it and returns:
scenario tests drive a worker in-process with an injected runner and never sleep on timing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from opentelemetry.trace import Tracer

from common.settings import Settings
from common.store import Store
from common.tasks import spawn_supervised
from worker.compute_threads import ComputeThreads
from worker.entry_spans import EntrySpans
from worker.held import Held
from worker.inbox import Inbox
from worker.intake import Intake, affine
from worker.leases import Leases
from worker.liveness import Liveness
from worker.publisher import Publisher
from worker.reclaim import Reclaimer
from worker.supervisor import Supervisor
from worker.triage import EntryLimits
from worker.wiring import Wiring


class RunningLoop(Protocol):
    """A loop the consumer drives: the embedding loop or the generation loop."""

    batches_run: int

    def hold(self, held: Held) -> None: ...

    def room(self) -> int: ...

    def hung(self) -> bool: ...

    @property
    def held(self) -> int:
        """What it holds now: its load, for cache-aware routing."""
        ...

    @property
    def busy(self) -> bool:
        """Whether it holds or computes anything."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Schedule until `stop` and, after it, until everything held is answered."""
        ...

    async def finish(self) -> None:
        """Wait for whatever still computes."""
        ...


def compose(
    settings: Settings,
    store: Store,
    limits: EntryLimits,
    name: str,
    make_loop: Callable[[Wiring], RunningLoop],
    register: Callable[[], Awaitable[None]],
    compute: ComputeThreads,
    clock: Callable[[], float] = time.monotonic,
    tracer: Tracer | None = None,
) -> Consumer:
    """The worker's parts for a loop `make_loop` builds, wired one way each, traced or not."""
    inbox, leases = Inbox(), Leases()
    supervisor = Supervisor(inbox)
    publisher = Publisher(settings, store, leases, supervisor, clock)
    spans = EntrySpans(tracer, name) if tracer is not None else None
    loop = make_loop(Wiring(name, limits.model, inbox, publisher, supervisor, spans))
    intake = Intake(
        settings, store, limits, name, loop=loop, inbox=inbox, leases=leases,
        publisher=publisher, clock=clock, spans=spans,
    )  # fmt: skip
    liveness = Liveness(
        settings,
        store,
        inbox,
        model=limits.model,
        name=name,
        register=register,
        load=lambda: loop.held,
        hung=loop.hung,
        held_ids=leases.entry_ids,
        affine=affine(settings, limits),
        clock=clock,
    )
    reclaimer = Reclaimer(
        store,
        intake,
        leases,
        claim_idle_ms=settings.claim_idle_ms,
        stale_ms=settings.worker_stale_ms,
        hung=loop.hung,
        orphans=liveness.orphaned_streams,
        live_peers=liveness.live_peers,
    )
    return Consumer(intake, loop, liveness, reclaimer, publisher, supervisor, compute)


class Consumer:
    def __init__(
        self,
        intake: Intake,
        loop: RunningLoop,
        liveness: Liveness,
        reclaimer: Reclaimer,
        publisher: Publisher,
        supervisor: Supervisor,
        compute: ComputeThreads,
    ) -> None:
        self.intake = intake
        self.loop = loop
        self._liveness = liveness
        self._reclaimer = reclaimer
        self._publisher = publisher
        self._supervisor = supervisor
        self._compute = compute

    @property
    def name(self) -> str:
        return self.intake.name

    @property
    def crashed(self) -> BaseException | None:
        """The bug a task died of, if one did: the process exits non-zero."""
        return self._supervisor.crashed

    def _idle(self) -> bool:
        return not self.loop.busy and not self._publisher.publishing

    async def run_until_idle(self) -> None:
        """Answer what the streams hold now, then return (burst mode)."""
        await self.run(asyncio.Event(), until_idle=True)

    async def run(self, stop: asyncio.Event, *, until_idle: bool = False) -> None:
        """Consume until `stop`; then finish and ack everything held, and return."""
        self._supervisor.watch(stop)
        ended = self._supervisor.ended
        await self.intake.ensure_groups(stop)
        await self._liveness.poll_cancellations()  # know who left before reading their entries
        await self._reclaimer.drain_own_pending()
        idle = self._idle if until_idle else None
        dead_peers_s = self.intake.settings.worker_stale_ms / 2000
        drained = asyncio.Event()  # everything held is answered (or given up): leases may lapse
        tasks = [
            spawn_supervised("reader", self.intake.read_loop(stop, idle), ended),
            spawn_supervised("reclaimer", self._reclaimer.run(stop, drained), ended),
            spawn_supervised("beat", self._liveness.beat_while(stop), ended),
            spawn_supervised("cancellations", self._liveness.watch_cancellations(stop), ended),
            spawn_supervised(
                "dead peers", self._reclaimer.take_from_dead_peers(stop, dead_peers_s), ended
            ),
        ]
        try:
            await self.loop.run(stop)
        except BaseException as exc:
            self._supervisor.failed(exc)  # a crashed loop must end the process, not hang it
            raise
        finally:
            await self.loop.finish()
            await self._publisher.flush()
            drained.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._compute.shutdown()
            await self._liveness.leave()
