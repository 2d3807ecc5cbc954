"""The models this gateway can serve, read from the registry workers keep in Redis.

Refreshed in the background: registered models, their tokenizers (loaded once per hash),
live workers from the heartbeats, queue state per bucket (which also sets the queue gauges)
and each model's measured service rate, so the request path reads plain attributes and
issues no extra Redis command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from common import affinity_streams, metrics, streams
from common.protocol import ModelInfo, ModelKind, ProtocolError, decode
from common.settings import Settings
from common.status import ModelStatus, export_gauges, model_status
from common.store import Store
from common.tasks import only_logged, spawn_supervised
from common.wire_compat import TRACE_CONTEXT
from gateway.tokenize import ModelTokenizer

log = logging.getLogger("microbatch.gateway")


@dataclass(slots=True)
class ModelEntry:
    info: ModelInfo
    tokenizer: ModelTokenizer
    live_workers: int = 0
    depth: int = 0  # waiting + in progress, all buckets
    service_rate_per_s: float | None = None  # see DeliveryRate; None when not trustworthy
    cold_start_ms: int | None = None  # a worker's last measured start; None: never measured
    # every live worker reads entries that carry a trace context (a worker of the release
    # before would answer such an entry 503 version_mismatch): in a rolling update, traced
    # requests queue untraced entries until the last old worker is gone
    traced_entries: bool = False


Counters = dict[int, int]  # bucket -> XINFO GROUPS entries-read of its stream


@dataclass(slots=True)
class DeliveryRate:
    """Entries/s a model's workers take off its streams, from XINFO GROUPS `entries-read`.

    Only intervals with a backlog at both ends count: with nothing waiting, the delivery rate
    is the arrival rate, not what the workers can do. Busy intervals are pooled into chunks
    of at least `chunk_s` that end on a delivery (workers read a batch at a time, so one
    refresh interval may see a jump or nothing), and the rate is the lower median chunk rate
    over the last `window_s` rather than a mean or an EWMA: entries that expired in the
    queue are read and skipped in a rush, and that burst must not pass for capacity, or
    admission would let in more work that expires in turn. A rate measured within the window
    is reported even once the queue has emptied: the next burst lands between two refreshes.
    """

    window_s: float = 10.0
    chunk_s: float = 2.0
    # the previous refresh: (monotonic s, counters, backlog)
    _last: tuple[float, Counters, bool] | None = field(default=None, init=False)
    # the chunk being filled: [seconds, entries delivered]
    _open: list[float] = field(default_factory=lambda: [0.0, 0.0], init=False)
    # closed chunks in the window: (end monotonic s, entries/s)
    _chunks: deque[tuple[float, float]] = field(default_factory=deque, init=False)

    def observe(self, now_s: float, counters: Counters | None, backlog: bool) -> float | None:
        """Record one refresh; the rate to trust now, or None."""
        if not counters:  # the store cannot say (burner-redis, or Redis lost count)
            self._last = None
            self._open = [0.0, 0.0]
            self._chunks.clear()
            return None
        last, self._last = self._last, (now_s, counters, backlog)
        delivered = None
        if last is not None and last[2] and backlog and now_s > last[0]:
            delivered = _delivered(last[1], counters)
        if delivered is None:
            self._open = [0.0, 0.0]  # not saturated throughout: a chunk must be contiguous
        else:
            self._add(now_s, now_s - last[0], delivered)
        while self._chunks and self._chunks[0][0] < now_s - self.window_s:
            self._chunks.popleft()
        return self._rate()

    def _add(self, now_s: float, seconds: float, delivered: int) -> None:
        self._open[0] += seconds
        self._open[1] += delivered
        if self._open[0] >= self.chunk_s and delivered > 0:
            self._chunks.append((now_s, self._open[1] / self._open[0]))
            self._open = [0.0, 0.0]

    def _rate(self) -> float | None:
        """None while no chunk has closed: a batch longer than the window is not a zero rate."""
        return statistics.median_low(r for _, r in self._chunks) if self._chunks else None


def _delivered(then: Counters, now: Counters) -> int | None:
    """Entries delivered between two refreshes, over the buckets counted at both."""
    deltas = [now[b] - then[b] for b in now.keys() & then.keys()]
    if any(d < 0 for d in deltas):
        return None  # a counter went back: Redis lost its data, the interval says nothing
    return sum(deltas)


def _counters(state: ModelStatus) -> Counters | None:
    """Each bucket's counter; a bucket Redis cannot count is fine only while it is empty."""
    counters = {}
    for b in state.queues:
        if b.entries_read is not None:
            counters[b.bucket] = b.entries_read
        elif b.depth > 0:
            return None
    return counters


class Catalog:
    def __init__(self, store: Store, settings: Settings) -> None:
        self._store = store
        self._settings = settings
        self._keys = streams.Keys(settings.prefix)
        self.models: dict[str, ModelEntry] = {}
        self.redis_ok = False
        self._tokenizers: dict[tuple[str, int, int], ModelTokenizer] = {}
        self._last_refresh = 0.0
        self._inflight: asyncio.Task | None = None  # the refresh every caller now awaits
        self._skipped: dict[str, str] = {}  # model -> why its registry entry is unusable
        self._rates: dict[str, DeliveryRate] = {}
        self._traced: dict[str, bool] = {}  # per model: may entries carry trace context
        # given each generation model's live workers and their loads, every refresh
        # and those that read tenants' affinity streams in their lanes
        self.on_loads: Callable[[str, dict[str, int], frozenset[str]], None] | None = None

    async def refresh(self) -> None:
        """Read the registry again; single flight: a caller that comes while a refresh runs
        waits for that one instead of queueing its own (a burst of probes or of requests for
        an unknown model is one refresh, not one each)."""
        if self._inflight is None or self._inflight.done():
            self._inflight = spawn_supervised("catalog refresh", self._refresh_once(), only_logged)
        await asyncio.shield(self._inflight)

    async def _refresh_once(self) -> None:
        try:
            await self._refresh()
            self.redis_ok = True
        except RedisError as exc:
            self.redis_ok = False
            log.warning("catalog refresh failed: %s", exc)
        self._last_refresh = time.monotonic()

    async def refresh_soon(self, min_interval_s: float = 0.25) -> None:
        """Refresh now unless one ran within `min_interval_s`: an unknown model may have
        just registered, and a probe wants news no older than that."""
        if time.monotonic() - self._last_refresh >= min_interval_s:
            await self.refresh()

    async def _traced_entries(self, name: str, live: set[str], known: set[str]) -> bool:
        """Whether a model's entries may carry trace context: when every live worker reads
        it; with none live (scaled to zero), as when last seen (a worker that starts is most
        likely this release's, and an old one answers a traced entry 503, never loses it)."""
        if live:
            wires = await streams.wire_versions(self._store, self._keys, name, known)
            self._traced[name] = all(wires.get(w, 0) >= TRACE_CONTEXT for w in live)
        return self._traced.get(name, True)

    async def _refresh(self) -> None:
        registered = await streams.registered_models(self._store, self._keys)
        models: dict[str, ModelEntry] = {}
        statuses = []
        for name, raw in registered.items():
            try:
                info = decode(raw)
            except ProtocolError as exc:
                self._skip(name, f"malformed registry entry: {exc}")
                continue
            if not isinstance(info, ModelInfo):
                continue
            try:
                tokenizer = await self._tokenizer(info)
            except RedisError:
                raise  # Redis, not the entry: the whole refresh failed
            except Exception as exc:  # a tokenizer this `tokenizers` cannot parse: that entry's
                self._skip(name, f"its tokenizer cannot be loaded here: {exc}")
                continue
            if tokenizer is None:
                continue
            models[name], state = await self._entry(name, info, tokenizer)
            statuses.append(state)
        for entry in list(models.values()):
            for alias in entry.info.aliases:  # served_model_name: the registered name wins
                models.setdefault(alias, entry)
        self.models = models
        export_gauges(statuses)

    async def _entry(
        self, name: str, info: ModelInfo, tokenizer: ModelTokenizer
    ) -> tuple[ModelEntry, ModelStatus]:
        """One registered model as this refresh finds it: its queues, rate and workers (a
        generation model's loads read once, for its queue status and for routing)."""
        generates = info.kind == ModelKind.CAUSAL_LM
        loads = (
            await affinity_streams.worker_loads(self._store, self._keys, name) if generates else {}
        )
        settings = self._settings
        state = await model_status(
            self._store,
            self._keys,
            name,
            info.kind,
            settings.buckets,
            settings.worker_stale_ms,
            loads,
        )
        rate = self._rates.setdefault(name, DeliveryRate()).observe(
            time.monotonic(), _counters(state), any(b.lag > 0 for b in state.queues)
        )
        cold = await streams.cold_start_ms(self._store, self._keys, name)
        live = {w.name for w in state.workers if w.live}
        known = {w.name for w in state.workers}
        traced = await self._traced_entries(name, live, known)
        if self.on_loads is not None and generates:
            laned = await affinity_streams.laned_affinity_workers(self._store, self._keys, name)
            live_loads = {w: r.load for w, r in loads.items() if w in live}
            self.on_loads(name, live_loads, frozenset(laned & live))
        entry = ModelEntry(info, tokenizer, state.live_workers, state.depth, rate, cold, traced)
        return entry, state

    def _skip(self, name: str, why: str) -> None:
        """One model's bad entry costs that model only: skipped, logged once, counted."""
        metrics.registry_entries_skipped_total.labels(name).inc()
        if self._skipped.get(name) != why:
            log.error("model %r is not served by this gateway: %s", name, why)
            self._skipped[name] = why

    async def _tokenizer(self, info: ModelInfo) -> ModelTokenizer | None:
        key = (info.tokenizer_sha256, info.max_tokens, info.vocab_size)
        cached = self._tokenizers.get(key)
        if cached is None:
            text = await streams.load_tokenizer(self._store, self._keys, info.tokenizer_sha256)
            if text is None:
                log.error(
                    "tokenizer %s of %s is missing from the registry",
                    info.tokenizer_sha256,
                    info.name,
                )
                return None
            cached = await asyncio.to_thread(
                ModelTokenizer, text, max_tokens=info.max_tokens, vocab_size=info.vocab_size
            )
            self._tokenizers[key] = cached
        return cached

    async def run(self, stop: asyncio.Event, period_s: float = 1.0) -> None:
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
