"""A consumer group's pending entries: who holds what, how often it was delivered, and the
commands that move or keep them (claims, lease renewals). Redis call sites, as in `streams`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from common.store import Store
from common.streams import GROUP, StreamEntry, as_text, entries_of, id_order


async def autoclaim(
    store: Store, stream: str, consumer: str, *, min_idle_ms: int, start: str, count: int
) -> tuple[str, list[StreamEntry], list[str]]:
    """XAUTOCLAIM one page: (next cursor, claimed entries, ids whose payload is gone)."""
    reply = await store.xautoclaim(
        stream, GROUP, consumer, min_idle_time=min_idle_ms, start_id=start, count=count
    )
    cursor, items = reply[0], reply[1]
    deleted = [as_text(i) for i in reply[2]] if len(reply) > 2 else []
    return as_text(cursor), entries_of(stream, items), deleted


async def delivery_counts(store: Store, stream: str, ids: Sequence[str]) -> dict[str, int]:
    """How often each pending id was delivered (XPENDING range), for dead-lettering."""
    if not ids:
        return {}
    first, last = min(ids, key=id_order), max(ids, key=id_order)
    rows = await store.xpending_range(stream, GROUP, min=first, max=last, count=len(ids) * 4)
    wanted = set(ids)
    counts = {}
    for row in rows:
        entry_id = as_text(row.get("message_id", row.get(b"message_id")))
        if entry_id in wanted:
            counts[entry_id] = int(row.get("times_delivered", row.get(b"times_delivered", 1)))
    return counts


async def renew_leases(store: Store, stream: str, consumer: str, ids: Sequence[str]) -> None:
    """Reset our own pending entries' idle time so no peer's XAUTOCLAIM takes them.

    On Redis, JUSTID does not count a delivery; burner-redis counts one, which matters only
    after a restart there, and the embedded store does not survive one.
    """
    if ids:
        await store.xclaim(stream, GROUP, consumer, 0, list(ids), idle=0, justid=True)


async def consumers(store: Store, stream: str) -> list[ConsumerInfo]:
    """The group's consumers on `stream` (XINFO CONSUMERS): pending count and idle time."""
    try:
        rows = await store.xinfo_consumers(stream, GROUP)
    except ResponseError as exc:
        if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
            return []
        raise
    return [
        ConsumerInfo(as_text(_field(r, "name")), int(_field(r, "pending")), int(_field(r, "idle")))
        for r in rows
    ]


def _field(row: dict, name: str) -> Any:
    """A field of a parsed XINFO/XPENDING row, keyed by text or by bytes."""
    return row[name] if name in row else row[name.encode()]


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    name: str
    pending: int
    idle_ms: int  # since it last read or claimed


async def claim_pending_of(
    store: Store, stream: str, owner: str, consumer: str, count: int
) -> tuple[list[StreamEntry], dict[str, int]]:
    """Up to `count` of `owner`'s pending entries, claimed for `consumer` now (XCLAIM, idle
    0): the entries, and each one's delivery count with this claim."""
    rows = await store.xpending_range(stream, GROUP, "-", "+", count, consumername=owner)
    # the claim below is one more delivery
    counts = {as_text(_field(r, "message_id")): int(_field(r, "times_delivered")) + 1 for r in rows}
    if not counts:
        return [], {}
    items = await store.xclaim(stream, GROUP, consumer, 0, list(counts))
    return entries_of(stream, items), counts
