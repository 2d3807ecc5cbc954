"""What a gateway's waiters hold, per model: admission weighs one model's backlog only."""

from __future__ import annotations

import asyncio

from gateway.replies import ReplyRouter


def test_waiting_rows_are_counted_per_model_and_released_when_forgotten() -> None:
    """The soak: chat requests refused 503 deadline_infeasible because a 300-text bulk
    embedding waiting on the same gateway counted against the chat model's queue."""

    async def scenario() -> list[int]:
        router = ReplyRouter(None, "mb:reply:g", block_ms=100, ttl_s=60, keys=None)  # type: ignore[arg-type]
        router.expect("bulk.0", "noop", rows=300)
        router.expect("chat.0", "chat")
        router.expect_stream("chat.1", asyncio.Queue(), "chat")
        seen = [router.waiting("noop"), router.waiting("chat"), router.waiting("other")]
        router.forget(["bulk.0", "chat.0", "chat.1", "chat.1"])  # twice: counted once
        return [*seen, router.waiting("noop"), router.waiting("chat")]

    assert asyncio.run(scenario()) == [300, 2, 0, 0, 0]
