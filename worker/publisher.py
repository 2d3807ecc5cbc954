"""`Publisher`: a worker's outbox — each reply sent with the ack of the entry it answers.

The loops and the intake hand it outcomes (replies, and the entries they settle) and never
wait on Redis for them: `post` publishes in the background, `ordered` posts reach Redis in
the order given (one sequence's streamed chunks), the rest side by side. It owns what
publishing needs and nobody else touches: retries with backoff, the reply streams' TTLs,
and releasing each entry's lease once it is acked. A publish that keeps failing leaves its
entries pending, so a peer or a restart redoes them: never lost, never acked unanswered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from redis.exceptions import RedisError

from common import streams
from common.backoff import Backoff
from common.clock import wall_ms
from common.settings import Settings
from common.store import Store
from common.tasks import spawn_supervised
from worker import entry_spans
from worker.leases import Leases
from worker.replies import Done, Reply
from worker.supervisor import Supervisor

log = logging.getLogger("microbatch.worker")
PUBLISH_ATTEMPTS = 5


class Publisher:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        leases: Leases,
        supervisor: Supervisor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._store = store
        self._leases = leases
        self._supervisor = supervisor
        self._clock = clock
        self._publishing: set[asyncio.Task] = set()
        self._order = asyncio.Lock()  # the lock queues ordered publishers FIFO
        self._reply_ttl_s = max(60, 2 * settings.request_timeout_ms // 1000)
        self._expired: dict[str, float] = {}  # reply stream -> when this worker set its TTL

    def post(
        self, replies: list[Reply], done: list[Done], *, until_ms: int = 0, ordered: bool = False
    ) -> None:
        """Publish in the background; `ordered` ones reach Redis in the order posted."""
        publish = self.publish(replies, done, until_ms)
        work = self._in_order(publish) if ordered else publish
        task = spawn_supervised("publish", work, self._supervisor.ended)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _in_order(self, publish: Coroutine[Any, Any, None]) -> None:
        async with self._order:
            await publish

    async def publish(self, replies: list[Reply], done: list[Done], until_ms: int = 0) -> None:
        """Reply then ack, retried with capped backoff until `until_ms` (the latest deadline
        of the entries answered: an answer computed is worth a Redis outage of seconds, and
        worthless past it) and at least `PUBLISH_ATTEMPTS` times. On failure the entries stay
        pending, so they are redone or, past their deadline, dropped by whoever takes them:
        never lost, never acked unanswered."""
        backoff = Backoff()
        expire = self._due_for_ttl({stream for stream, _ in replies})
        published = False
        try:
            attempt = 0
            while attempt < PUBLISH_ATTEMPTS or wall_ms() < until_ms:
                attempt += 1
                try:
                    await streams.complete(
                        self._store,
                        replies,
                        done,
                        reply_maxlen=self._settings.reply_maxlen,
                        reply_ttl_s=self._reply_ttl_s,
                        expire=expire,
                    )
                    now = self._clock()
                    self._expired.update(dict.fromkeys(expire, now))
                    published = True
                    return
                except RedisError as exc:
                    await backoff.wait(log, "publish", exc)
            log.error("gave up publishing %d replies; they stay pending for reclaim", len(done))
        finally:
            spans = self._leases.release(done)
            if spans:
                entry_spans.ended(spans, published)

    def _due_for_ttl(self, reply_streams: set[str]) -> list[str]:
        """Reply streams whose TTL this worker has not set in a quarter of it. A stream
        cannot expire sooner (its gateway sets the same TTL), so a reply never re-creates
        one without a TTL; the rest cost no EXPIRE per reply."""
        now, quarter = self._clock(), self._reply_ttl_s / 4
        if len(self._expired) > 4096:  # gateways come and go: forget the long-expired
            self._expired = {s: t for s, t in self._expired.items() if now - t < quarter}
        return [s for s in reply_streams if now - self._expired.get(s, -quarter) >= quarter]

    @property
    def publishing(self) -> bool:
        return bool(self._publishing)

    async def flush(self) -> None:
        """Wait for every publish in flight."""
        while self._publishing:
            await asyncio.gather(*list(self._publishing), return_exceptions=True)
