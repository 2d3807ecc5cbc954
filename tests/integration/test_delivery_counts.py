"""Delivery counts of reclaimed entries, read from a real redis-server's pending list.

The count is what dead-letters a poison entry after `max_deliveries`; a count lost reads as
a first delivery, and a poison entry whose count is always 1 crashes workers forever.
"""

from __future__ import annotations

import asyncio

from common import pending, streams
from common.settings import Settings
from common.store import close_store, open_store


def test_delivery_counts_hold_when_batch_mates_ids_differ_in_length(redis_url: str) -> None:
    # One gateway pipeline puts many entries in one millisecond: ids 5-9 and 5-10 are usual.
    async def scenario() -> dict[str, int]:
        store = open_store(Settings(redis_url=redis_url))
        try:
            await streams.ensure_groups(store, ["s"])
            for seq in range(1, 12):
                await store.xadd("s", {streams.FIELD: b"x"}, id=f"5-{seq}")
            await store.xreadgroup(streams.GROUP, "dead", {"s": ">"}, count=20)
            await store.xclaim("s", streams.GROUP, "peer", 0, ["5-9", "5-10"])
            return await pending.delivery_counts(store, "s", ["5-9", "5-10"])
        finally:
            await close_store(store)

    assert asyncio.run(scenario()) == {"5-9": 2, "5-10": 2}
