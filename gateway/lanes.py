"""Tenants' lanes announced to the workers: the registry of which tenants queue a model's
work in streams of their own, and with what weight.

A gateway announces a lane before it writes the lane's first entry, and again every
`ANNOUNCE_EVERY_S` (a Redis restarted empty learns it back within that) or when the weight
changes. Workers read the registry and add the lanes they find to what they read. The first
announcement also writes to the model's lane news, which an idle worker's blocking read
watches: without it, a new tenant's first request waited out that read and the worker's
next look at the registry (up to two seconds at the defaults).
"""

from __future__ import annotations

import time

from common.keys import Keys
from common.store import Store, pipeline

ANNOUNCE_EVERY_S = 5.0
REGISTRY_TTL_S = 86_400  # renewed by every announcement; workers keep the lanes they know
NEWS_MAXLEN = 64  # only the newest matter: a worker woken by one reads the whole registry


class Lanes:
    def __init__(self, store: Store, keys: Keys) -> None:
        self._store, self._keys = store, keys
        self._announced: dict[tuple[str, str], tuple[float, float]] = {}  # -> (when, weight)

    def due(self, model: str, tenant: str, weight: float) -> bool:
        """Whether the lane is to be announced (again) before its next entry: checked
        without a coroutine, as every request of a tenant asks."""
        last = self._announced.get((model, tenant))
        return last is None or time.monotonic() - last[0] >= ANNOUNCE_EVERY_S or last[1] != weight

    async def announce(self, model: str, tenant: str, weight: float) -> None:
        """Write the lane to the registry: once `due` says so (the request path asks it)."""
        now = time.monotonic()
        last = self._announced.get((model, tenant))
        key = self._keys.lanes(model)
        pipe = pipeline(self._store)  # one round trip
        pipe.hset(key, tenant, repr(weight))
        pipe.expire(key, REGISTRY_TTL_S)  # a model no tenant sends to is forgotten
        if last is None:  # this gateway's first word of it: an idle worker looks now
            pipe.xadd(self._keys.lane_news(model), {"t": tenant}, maxlen=NEWS_MAXLEN)
        await pipe.execute()
        self._announced[(model, tenant)] = (now, weight)
