"""Tenants' lanes in Redis: the registry of a model's lanes, reading several streams each
with a count of its own, and a bucket's queue state counted over its lanes."""

from __future__ import annotations

from collections.abc import Sequence

from common.keys import Keys
from common.store import Store, pipeline
from common.streams import GROUP, GroupInfo, StreamEntry, as_text, entries_of


async def read_groups(store: Store, consumer: str, counts: dict[str, int]) -> list[StreamEntry]:
    """New entries from several streams, a count of its own from each: one round trip of
    XREADGROUPs that do not block (the streams share a Cluster slot)."""
    by_count: dict[int, list[str]] = {}
    for stream, count in counts.items():
        by_count.setdefault(count, []).append(stream)
    pipe = pipeline(store)
    for count, group in by_count.items():
        pipe.xreadgroup(GROUP, consumer, dict.fromkeys(group, ">"), count=count)
    out: list[StreamEntry] = []
    for reply in await pipe.execute():
        for stream, items in reply or []:
            out.extend(entries_of(stream, items))
    return out


def merged(a: GroupInfo, b: GroupInfo) -> GroupInfo:
    """Two streams' states as one queue's (a bucket's stream and a tenant's lane of it)."""

    def both(x: int | None, y: int | None) -> int | None:
        return None if x is None or y is None else x + y

    oldest = [ms for ms in (a.oldest_ms, b.oldest_ms) if ms is not None]
    return GroupInfo(
        a.length + b.length,
        a.pending + b.pending,
        both(a.lag, b.lag),
        min(oldest) if oldest else None,
        both(a.entries_read, b.entries_read),
    )


async def lane_tenants(store: Store, keys: Keys, model: str) -> dict[str, float]:
    """The tenants with lanes for a model, and their weights."""
    raw = await store.hgetall(keys.lanes(model))
    return {as_text(k): float(as_text(v)) for k, v in (raw or {}).items()}


async def queue_length(store: Store, keys: Keys, model: str, buckets: Sequence[int]) -> int:
    """A model's entries waiting or running, over its bucket streams, its tenants' lanes and
    its generation workers' affinity streams: one round trip after the lanes and the
    workers are known (they share a Cluster slot)."""
    tenants = await lane_tenants(store, keys, model)
    workers = await store.hgetall(keys.load(model)) or {}
    pipe = pipeline(store)
    for bucket in buckets:
        pipe.xlen(keys.request(model, bucket))
        for tenant in tenants:
            pipe.xlen(keys.lane(model, bucket, tenant))
    for worker in map(as_text, workers):
        for each in (None, *tenants):
            pipe.xlen(keys.affinity(model, worker, each))
    return sum(int(n) for n in await pipe.execute())
