"""`LaneReader`: the streams a worker reads, and how, once tenants have lanes of their own.

A worker reads its model's bucket streams (and its affinity stream). With a tenants file, the
gateways queue each tenant's requests in lanes of their own (a lane per bucket, and per
worker for prompts routed by cache affinity) and list them in the model's lane registry;
the reader finds them there (every `REFRESH_S`), creates its group on each,
and from then on splits every read between the lanes by their fair shares
(`worker.lane_shares`). With no lanes it reads as it always did: one XREADGROUP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from common import lane_streams, streams
from common.keys import Keys
from common.store import Store
from worker.lane_shares import LaneShares

REFRESH_S = 1.0
UNTENANTED = ""  # the lane of the bucket streams


class LaneReader:
    def __init__(
        self,
        store: Store,
        keys: Keys,
        model: str,
        buckets: list[int],
        base: list[str],
        consumer: str,
        clock: Callable[[], float],
    ) -> None:
        self._store, self._keys, self._model, self._buckets = store, keys, model, buckets
        self._consumer, self._clock = consumer, clock
        # grows in place: the reclaimer holds this same list and sweeps the lanes too
        self.streams = list(base)
        self._lane_of = dict.fromkeys(base, UNTENANTED)  # stream -> its lane
        self._shares = LaneShares()
        self._shares.set_weights({UNTENANTED: 1.0})
        self._refreshed_s = float("-inf")
        self._entries: dict[str, int] = {}  # entries the last read took, per lane
        # a generation worker routed to by cache affinity reads each tenant's prompts routed
        # to it in a stream per tenant, in the tenant's lane
        self._affine = keys.affinity(model, consumer) in base
        self._news = keys.lane_news(model)
        self._news_group = False  # made at the first refresh, again after Redis lost it

    def lane_of(self, stream: str) -> str:
        return self._lane_of.get(stream, UNTENANTED)

    def weight(self, lane: str) -> float:
        return self._shares.weight(lane)

    async def refresh(self, force: bool = False) -> None:
        """The registry read again (at most every `REFRESH_S` unless `force`): new lanes
        joined, weights changed."""
        if not self._news_group:
            await streams.ensure_groups(self._store, [self._news])
            self._news_group = True
        if not force and self._clock() - self._refreshed_s < REFRESH_S:
            return
        tenants = await lane_streams.lane_tenants(self._store, self._keys, self._model)
        known = set(self._lane_of.values())
        new = [
            (stream, tenant)
            for tenant in tenants
            if tenant not in known
            for stream in self._lane_streams(tenant)
        ]
        if new:
            await streams.ensure_groups(self._store, [stream for stream, _ in new])
            for stream, tenant in new:
                self.streams.append(stream)
                self._lane_of[stream] = tenant
        self._shares.set_weights({UNTENANTED: 1.0, **tenants})
        self._refreshed_s = self._clock()

    def _lane_streams(self, tenant: str) -> list[str]:
        own = [self._keys.lane(self._model, bucket, tenant) for bucket in self._buckets]
        if self._affine:
            own.append(self._keys.affinity(self._model, self._consumer, tenant))
        return own

    async def read(
        self, room: int, block_ms: int | None
    ) -> tuple[list[streams.StreamEntry], set[str]]:
        """New entries, and the lanes the read asked; with no lanes, one read of all."""
        everything = dict.fromkeys(self.streams, ">")
        if block_ms is not None:  # a wait: a lane a gateway starts meanwhile ends it too
            everything[self._news] = ">"
        if not self._shares.tenanted:
            read = await streams.read_group(
                self._store, self._consumer, everything, count=room, block_ms=block_ms
            )
            return await self._without_news(read), set()
        counts = self._shares.counts(room)
        asked = {s: counts[lane] for s, lane in self._lane_of.items() if lane in counts}
        read = await lane_streams.read_groups(self._store, self._consumer, asked)
        lanes = {self._lane_of[s] for s in asked}
        if not read and block_ms is not None:  # nothing anywhere: wait for the next arrival
            read = await streams.read_group(
                self._store, self._consumer, everything, count=1, block_ms=block_ms
            )
            read = await self._without_news(read)
            lanes = set(self._shares.lanes)
        self._count(read)
        return read, lanes

    def lost_groups(self) -> None:
        """Redis lost its groups (restarted empty): the news group is made again too."""
        self._news_group = False

    async def _without_news(self, read: list[streams.StreamEntry]) -> list[streams.StreamEntry]:
        """The entries, less lane news: acked, and the registry read again at once."""
        news = [item.entry_id for item in read if item.stream == self._news]
        if not news:
            return read
        await self._store.xack(self._news, streams.GROUP, *news)
        self._refreshed_s = float("-inf")
        return [item for item in read if item.stream != self._news]

    def idle_lanes(self) -> set[str]:
        """Lanes a read last found empty (none while there are no tenants' lanes)."""
        if not self._shares.tenanted:
            return set()
        return self._shares.idle()

    async def probe(self) -> tuple[list[streams.StreamEntry], set[str]]:
        """One entry from each idle lane that has one (not waiting for any)."""
        lanes = self.idle_lanes()
        asked = dict.fromkeys((s for s, lane in self._lane_of.items() if lane in lanes), ">")
        read = await streams.read_group(self._store, self._consumer, asked, count=1, block_ms=None)
        self._count(read)
        return read, lanes

    def _count(self, read: list[streams.StreamEntry]) -> None:
        self._entries = {}
        for item in read:
            lane = self.lane_of(item.stream)
            self._entries[lane] = self._entries.get(lane, 0) + 1

    def served(self, asked: set[str], costs: Mapping[str, int]) -> None:
        """What a read took from each stream (tokens), counted against its lane's share."""
        by_lane: dict[str, int] = {}
        for stream, cost in costs.items():
            lane = self.lane_of(stream)
            by_lane[lane] = by_lane.get(lane, 0) + cost
        self._shares.read(asked, by_lane, self._entries)
