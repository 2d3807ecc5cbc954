"""`Backoff`: capped exponential delays between retries of a Redis command, shared by all loops.

One rule everywhere (50 ms, doubling, at most 2 s; back to the start after a success), so a
Redis outage costs every loop the same bounded retry rate and none spins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

FIRST_S = 0.05
CAP_S = 2.0


@dataclass(slots=True)
class Backoff:
    first_s: float = FIRST_S
    cap_s: float = CAP_S
    delay_s: float = FIRST_S

    def __post_init__(self) -> None:
        self.delay_s = self.first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    def next_s(self) -> float:
        """The delay to wait now; the next one doubles, up to the cap."""
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, self.cap_s)
        return delay

    async def wait(self, log: logging.Logger, what: str, exc: BaseException) -> None:
        """Log the failure and sleep the next delay."""
        delay = self.next_s()
        log.warning("%s failed (%s); retrying in %.2fs", what, exc, delay)
        await asyncio.sleep(delay)


async def until_ok(
    op: Callable[[], Awaitable[object]],
    stop: asyncio.Event,
    log: logging.Logger,
    what: str,
    backoff: Backoff | None = None,
) -> bool:
    """Run `op` until Redis answers or `stop` is set; whether it succeeded. Only a Redis
    error is retried: anything else is the caller's bug or configuration, raised at once."""
    backoff = backoff or Backoff()
    while not stop.is_set():
        try:
            await op()
            return True
        except RedisError as exc:
            await backoff.wait(log, what, exc)
    return False
