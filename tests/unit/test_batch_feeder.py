"""`BatchFeeder` through its seam: the lease, a driver that dies, a lease lost or lapsed.

The records and the run are this test's own small stand-ins for `BatchRecords` and
`BatchRun` (the interfaces the feeder is given), so each rule is shown in milliseconds with
no Redis: the Redis side of the lease (SET NX PX, the renewal and release scripts) is proven
against a real server in tests/integration/test_batches.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.batch_feeder import BatchFeeder

LEASE_MS = 60


class Records:
    """Active batches and their leases, as `BatchRecords` keeps them in Redis."""

    def __init__(self, *batch_ids: str) -> None:
        self.active = list(batch_ids)
        self.leases: dict[str, str] = {}
        self.renewals = 0
        self.renewal: Callable[[], bool] = lambda: True  # or raise a RedisError

    async def active_records(self) -> list[dict[str, str]]:
        return [
            {"id": i, "status": "in_progress", "total": "2", "endpoint": "/v1/embeddings",
             "input_file_id": "file-1", "completion_window": "24h", "created_at": "1"}
            for i in self.active
        ]  # fmt: skip

    async def take_lease(self, batch_id: str, holder: str, ms: int) -> bool:
        return self.leases.setdefault(batch_id, holder) == holder

    async def renew_lease(self, batch_id: str, holder: str, ms: int) -> bool:
        self.renewals += 1
        return self.renewal() and self.leases.get(batch_id) == holder

    async def release_lease(self, batch_id: str, holder: str) -> None:
        if self.leases.get(batch_id) == holder:
            del self.leases[batch_id]


class Run:
    """A driver that fails on its first `failures` starts, then drives until its lease is
    lost or it is told the batch is done."""

    def __init__(self, failures: int = 0) -> None:
        self.starts = 0
        self.failures = failures
        self.finished = asyncio.Event()
        self.stopped_by_loss = False

    def __call__(self, batch_id: str, lost: asyncio.Event) -> Run:
        self._lost = lost
        return self

    async def drive(self) -> None:
        self.starts += 1
        if self.starts <= self.failures:
            raise RuntimeError("a driver bug")
        lost = asyncio.ensure_future(self._lost.wait())
        finished = asyncio.ensure_future(self.finished.wait())
        await asyncio.wait([lost, finished], return_when=asyncio.FIRST_COMPLETED)
        self.stopped_by_loss = self._lost.is_set()
        for waiter in (lost, finished):
            waiter.cancel()


async def _until(check: Callable[[], bool], seconds: float = 2.0) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.005)


async def _running(feeder: BatchFeeder, body: Callable[[], object]) -> None:
    stop, changed = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(feeder.run(stop, changed))
    try:
        await body()  # type: ignore[misc]
    finally:
        stop.set()
        changed.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_driver_that_dies_is_restarted_from_its_results_at_the_next_look() -> None:
    records, run = Records("batch_a"), Run(failures=2)
    feeder = BatchFeeder(records, run, "gw-1", LEASE_MS)  # type: ignore[arg-type]

    async def body() -> None:
        await _until(lambda: run.starts == 3)  # died twice, taken up again each time
        assert feeder.driving == ["batch_a"] and records.leases == {"batch_a": "gw-1"}
        assert REGISTRY.get_sample_value("microbatch_batches_driving") == 1
        run.finished.set()
        await _until(lambda: not feeder.driving)
        assert records.leases == {}  # handed back once driven

    asyncio.run(_running(feeder, body))


def test_a_batch_another_gateway_holds_is_not_driven_here() -> None:
    records, run = Records("batch_b"), Run()
    records.leases["batch_b"] = "gw-2"
    feeder = BatchFeeder(records, run, "gw-1", LEASE_MS)  # type: ignore[arg-type]

    async def body() -> None:
        await asyncio.sleep(LEASE_MS / 1000)  # several looks
        assert run.starts == 0 and feeder.driving == []
        assert REGISTRY.get_sample_value("microbatch_batches_driving") == 0

    asyncio.run(_running(feeder, body))


def test_a_renewal_refused_stops_the_driver() -> None:
    """Another gateway took the lease (it lapsed): this one must stop feeding at once."""
    records, run = Records("batch_c"), Run()
    feeder = BatchFeeder(records, run, "gw-1", LEASE_MS)  # type: ignore[arg-type]

    async def body() -> None:
        await _until(lambda: run.starts == 1 and records.renewals >= 1)
        records.leases["batch_c"] = "gw-2"
        await _until(lambda: run.stopped_by_loss)
        assert records.leases == {"batch_c": "gw-2"}  # not released: it is not ours

    asyncio.run(_running(feeder, body))


@pytest.mark.parametrize("outage_ms", [LEASE_MS // 3, LEASE_MS * 3])
def test_renewals_failing_past_the_lease_stop_the_driver_and_a_shorter_outage_does_not(
    outage_ms: int,
) -> None:
    records, run = Records("batch_d"), Run()
    now = [0.0]
    feeder = BatchFeeder(records, run, "gw-1", LEASE_MS, clock=lambda: now[0])  # type: ignore[arg-type]

    def failing() -> bool:
        raise RedisConnectionError("Redis is unreachable")

    async def body() -> None:
        await _until(lambda: run.starts == 1)
        records.renewal = failing
        seen = records.renewals
        await _until(lambda: records.renewals > seen)  # one renewal failed
        now[0] += outage_ms / 1000  # the outage lasts this long on the feeder's clock
        await _until(lambda: records.renewals > seen + 1)  # and the next one failed too
        await asyncio.sleep(LEASE_MS / 1000)
        assert run.stopped_by_loss is (outage_ms >= LEASE_MS)

    asyncio.run(_running(feeder, body))


class Stubborn(Run):
    """A driver stuck on lines that never come back (a post whose route no longer hears its
    client hang up): it ignores its lost lease and swallows the first cancellation too."""

    async def drive(self) -> None:
        self.starts += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.Event().wait()  # as a `finally` that awaits its lines in flight


def test_a_stopping_gateway_hands_its_batches_back_and_never_waits_on_a_driver_forever() -> None:
    async def scenario() -> None:
        records, polite, stubborn = Records("batch_e", "batch_f"), Run(), Stubborn()
        feeder = BatchFeeder(
            records,
            lambda batch_id, lost: (polite if batch_id == "batch_e" else stubborn)(batch_id, lost),  # type: ignore[arg-type]
            "gw-1",
            LEASE_MS,
        )
        stop, changed = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(feeder.run(stop, changed))
        await _until(lambda: polite.starts == 1 and stubborn.starts == 1)
        stop.set()
        changed.set()
        async with asyncio.timeout(10 * LEASE_MS / 1000):  # two leases' time at most
            await task
        assert polite.stopped_by_loss  # told its lease is gone: it stopped by itself
        assert records.leases == {"batch_f": "gw-1"}  # the stuck one's lapses on its own

    asyncio.run(scenario())
