"""The models this gateway can serve, read from the registry workers keep in Redis.

Refreshed in the background: registered models, their tokenizers (loaded once per hash),
live workers from the heartbeats, and queue state per bucket (which also sets the queue
gauges), so the request path reads plain attributes and issues no extra Redis command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from common import streams
from common.protocol import ModelInfo, ProtocolError, decode
from common.settings import Settings
from common.status import export_gauges, model_status
from common.store import Store
from gateway.tokenize import ModelTokenizer

log = logging.getLogger("microbatch.gateway")


@dataclass(slots=True)
class ModelEntry:
    info: ModelInfo
    tokenizer: ModelTokenizer
    live_workers: int = 0
    depth: int = 0  # waiting + in progress, all buckets


class Catalog:
    def __init__(self, store: Store, settings: Settings) -> None:
        self._store = store
        self._settings = settings
        self._keys = streams.Keys(settings.prefix)
        self.models: dict[str, ModelEntry] = {}
        self.redis_ok = False
        self._tokenizers: dict[tuple[str, int, int], ModelTokenizer] = {}
        self._last_refresh = 0.0
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._lock:
            try:
                await self._refresh()
                self.redis_ok = True
            except RedisError as exc:
                self.redis_ok = False
                log.warning("catalog refresh failed: %s", exc)
            self._last_refresh = time.monotonic()

    async def refresh_soon(self, min_interval_s: float = 0.25) -> None:
        """Refresh now unless one just ran: an unknown model may have just registered."""
        if time.monotonic() - self._last_refresh >= min_interval_s:
            await self.refresh()

    async def _refresh(self) -> None:
        registered = await streams.registered_models(self._store, self._keys)
        models: dict[str, ModelEntry] = {}
        statuses = []
        for name, raw in registered.items():
            try:
                info = decode(raw)
            except ProtocolError as exc:
                log.error("skipping malformed registry entry %r: %s", name, exc)
                continue
            if not isinstance(info, ModelInfo):
                continue
            tokenizer = await self._tokenizer(info)
            if tokenizer is None:
                continue
            state = await model_status(
                self._store,
                self._keys,
                name,
                info.kind,
                self._settings.buckets,
                self._settings.worker_stale_ms,
            )
            statuses.append(state)
            models[name] = ModelEntry(info, tokenizer, state.live_workers, state.depth)
        self.models = models
        export_gauges(statuses)

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
