"""`Liveness`: what a worker tells the fleet, and what the fleet tells it, on a timer.

It beats (the worker's sorted-set entry, its load for cache-aware routing, the `/healthz`
timestamp) only while the loop makes progress, so a hung batch fails readiness and peers
reclaim its entries; registers the model again when Redis lost it; reads the operator's live
batching settings, and asks the model's cancel set about the entries held, posting both to
the loop's inbox; finds the affinity streams of peers that died; and deregisters at the end.
It asks three questions, given as callables: how much the loop holds (`load`), whether it
is stuck (`hung`) and which request entries are held (`held_ids`, from the leases).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from common import affinity_streams, lane_streams, metrics, streams
from common.clock import wall_ms
from common.settings import Settings
from common.store import Store
from worker.inbox import Inbox
from worker.utilization import Utilization

log = logging.getLogger("microbatch.worker")


class Liveness:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        inbox: Inbox,
        *,
        model: str,
        name: str,
        register: Callable[[], Awaitable[None]],
        load: Callable[[], int],
        hung: Callable[[], bool],
        held_ids: Callable[[], list[str]],
        affine: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._store = store
        self._inbox = inbox
        self._keys = streams.Keys(settings.prefix)
        self._model = model
        self._name = name
        self._register = register
        self._load = load
        self._hung = hung
        self._held_ids = held_ids
        self._affine = affine  # reports its load and drains dead peers' affinity streams
        self._clock = clock
        self._last_beat_s = -float("inf")
        self._utilization = Utilization(settings.device)

    # ---- beating ---------------------------------------------------------------------------

    async def beat_while(self, stop: asyncio.Event) -> None:
        """Beat every `heartbeat_interval_ms` until `stop`."""
        period_s = self._settings.heartbeat_interval_ms / 1000
        while not stop.is_set():
            await self.beat_if_due()
            await _pause(stop, period_s)

    async def beat_if_due(self) -> None:
        """Beat only while the loop makes progress: a hung batch must fail readiness."""
        now = self._clock()
        if self._hung():
            if now - self._last_beat_s >= self._settings.worker_stale_ms / 1000:
                log.error("batch running past max_batch_ms: not beating, peers will reclaim")
                self._last_beat_s = now
            return
        if now - self._last_beat_s < self._settings.heartbeat_interval_ms / 1000:
            return
        self._last_beat_s = now
        metrics.worker_loop_beat_timestamp_seconds.set_to_current_time()  # /healthz reads it
        metrics.device_utilization.set(self._utilization.sample())
        try:
            self._inbox.post_overrides(
                await streams.live_batching(self._store, self._keys, self._model)
            )
            stale_ms = self._settings.gateway_stale_ms
            self._inbox.post_gone(
                await streams.gone_gateways(self._store, self._keys, wall_ms(), stale_ms)
            )
        except RedisError as exc:
            log.warning("reading live settings or gateways failed: %s", exc)
        try:
            registered = await streams.heartbeat(
                self._store,
                self._keys,
                self._model,
                self._name,
                wall_ms(),
                self._settings.worker_stale_ms,
                load=self._load() if self._affine else None,
            )
            if not registered:  # Redis lost its data (restart without persistence, flush)
                log.warning("model registration vanished; registering %s again", self._model)
                await self._register()
        except RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    async def leave(self) -> None:
        try:
            await streams.leave(self._store, self._keys, self._model, self._name)
        except RedisError:
            log.warning("could not deregister %s; it ages out of the registry", self._name)

    # ---- cancellation ----------------------------------------------------------------------

    async def watch_cancellations(self, stop: asyncio.Event) -> None:
        """Poll the model's cancel set about the entries held: those whose clients left."""
        period_s = self._settings.cancel_poll_ms / 1000
        while not stop.is_set():
            await self.poll_cancellations()
            await _pause(stop, period_s)

    async def poll_cancellations(self) -> None:
        try:
            ids = await streams.cancelled_among(
                self._store, self._keys, self._model, self._held_ids(), wall_ms()
            )
        except RedisError as exc:
            log.warning("reading cancellations failed: %s", exc)
            ids = set()
        self._inbox.post_cancelled(ids)

    # ---- dead peers ------------------------------------------------------------------------

    async def live_peers(self) -> set[str]:
        """Consumers of this model whose last beat is within `worker_stale_ms`."""
        since = wall_ms() - self._settings.worker_stale_ms
        beats = await streams.worker_beats(self._store, self._keys, self._model)
        return {peer for peer, beat in beats if beat >= since}

    async def orphaned_streams(self) -> list[str]:
        """Affinity streams of peers that left or stopped beating: theirs to drain, ours
        now. Once no gateway can route to one (silent for 60 x `worker_stale_ms`, as the
        registry forgets it) and its stream is empty, its stream and entry are deleted."""
        if not self._affine:
            return []
        now, stale_ms = wall_ms(), self._settings.worker_stale_ms
        live = await self.live_peers()
        loads = await affinity_streams.worker_loads(self._store, self._keys, self._model)
        out: list[str] = []
        dead = [p for p in loads if p != self._name and p not in live]
        if not dead:
            return out
        tenants = list(await lane_streams.lane_tenants(self._store, self._keys, self._model))
        for peer in dead:
            if loads[peer].beat_ms < now - 60 * stale_ms and await affinity_streams.forget_affinity(
                self._store, self._keys, self._model, peer, tenants
            ):
                continue
            out.append(self._keys.affinity(self._model, peer))
            out.extend(self._keys.affinity(self._model, peer, t) for t in tenants)
        return out


async def _pause(stop: asyncio.Event, period_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(period_s):
            await stop.wait()
