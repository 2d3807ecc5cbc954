"""The cancel set, asked by the ids a worker holds (issue 34, item 9).

Cancellations live in one sorted set per model until their entry's deadline; a worker asks
it only about the entries it holds, so a poll costs what the worker holds, not what every
client that left ever cancelled.
"""

from __future__ import annotations

import asyncio
import time

from common import streams
from common.settings import Settings
from common.store import close_store, open_store
from worker.inbox import Inbox
from worker.liveness import Liveness


async def _poll(redis_url: str, held: list[str], cancelled: list[str], expired: list[str]):
    settings = Settings(redis_url=redis_url, model="noop")
    store = open_store(settings)
    keys = streams.Keys(settings.prefix)
    now = int(time.time() * 1000)
    try:
        await store.delete(keys.cancel("noop"))
        await streams.cancel(store, keys, "noop", cancelled, now + 60_000)
        await streams.cancel(store, keys, "noop", expired, now - 1)
        inbox = Inbox()

        async def register() -> None:
            return None

        liveness = Liveness(
            settings,
            store,
            inbox,
            model="noop",
            name="w",
            register=register,
            load=lambda: len(held),
            hung=lambda: False,
            held_ids=lambda: held,
            affine=False,
        )
        await liveness.poll_cancellations()
        return inbox, await store.zcard(keys.cancel("noop"))
    finally:
        await close_store(store)


def test_a_poll_posts_only_the_held_entries_that_are_cancelled(redis_url: str) -> None:
    others = [f"other.{i}" for i in range(20_000)]  # clients of other workers' entries
    inbox, size = asyncio.run(
        _poll(redis_url, ["mine.0", "mine.1"], [*others, "mine.1"], ["old.0", "old.1"])
    )
    assert inbox.cancelled == {"mine.1"}  # not the 20,001 ids of the whole set
    assert size == 20_001  # the expired cancellations were forgotten, the live ones kept
    assert inbox.version == 1


def test_a_poll_holding_nothing_posts_nothing_and_still_forgets_the_expired(
    redis_url: str,
) -> None:
    inbox, size = asyncio.run(_poll(redis_url, [], ["x.0"], ["old.0"]))
    assert inbox.cancelled == set() and inbox.version == 0
    assert size == 1


def test_the_embedded_store_answers_the_same_question_without_zmscore() -> None:
    from common.store import open_store as open_embedded

    async def ask() -> tuple[set[str], set[str]]:
        store = open_embedded(Settings(model="noop"))  # no redis_url: burner-redis in-process
        keys = streams.Keys("mb")
        await streams.cancel(store, keys, "noop", ["a.0", "c.0"], int(time.time() * 1000) + 60_000)
        held = await streams.cancelled_among(store, keys, "noop", ["a.0", "b.0"], 0)
        return held, await streams.cancelled_among(store, keys, "noop", [], 0)

    held, none = asyncio.run(ask())
    assert held == {"a.0"} and none == set()
