"""The models this gateway can serve, read from the registry workers keep in Redis.

Refreshed in the background: registered models, their tokenizers (loaded once per hash),
live workers from the heartbeats, and queue depth per bucket, so the request path reads
plain attributes and issues no extra Redis command.
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
        since_ms = int(time.time() * 1000) - self._settings.worker_stale_ms
        models: dict[str, ModelEntry] = {}
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
            entry = ModelEntry(info, tokenizer)
            entry.live_workers = len(
                await streams.live_workers(self._store, self._keys, name, since_ms)
            )
            bucket_streams = [self._keys.request(name, b) for b in self._settings.buckets]
            entry.depth = sum(await streams.stream_lengths(self._store, bucket_streams))
            models[name] = entry
        self.models = models

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
