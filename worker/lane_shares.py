"""Fair shares between tenants where a worker reads: how many entries to take from each lane.

With a tenants file, each tenant's requests wait in lanes of their own (a stream per bucket);
untenanted traffic keeps the bucket streams (lane ""). A worker reads what it can start soon,
so the order it reads the lanes in is the order tenants are served: this policy splits each
read's room between the lanes by weight, and keeps a virtual-token counter per lane (tokens
read over its weight, as in "Fairness in Serving LLMs", OSDI 2024): each entry of a read's
room goes to the backlogged lane least served so far, so lanes whose requests are larger do
not take more of the worker, and weights hold even one entry at a time. A lane that comes
back from idle starts at the least served backlogged lane's count (no credit for idle time),
and a lane alone is never held back (work-conserving). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from common.protocol import GenerateEntry, RequestEntry


def cost_of(entry: RequestEntry | GenerateEntry) -> int:
    """An entry's tokens: its rows' or its prompt's, and the most a generation may add."""
    tokens = len(entry.tokens) // 4
    if isinstance(entry, GenerateEntry):
        tokens += entry.max_tokens * entry.n
    return tokens


class LaneShares:
    def __init__(self) -> None:
        self._weights: dict[str, float] = {}
        self._served: dict[str, float] = {}  # virtual tokens: tokens read / weight
        self._mean_cost: dict[str, float] = {}  # tokens per entry read, a moving mean
        self._backlogged: set[str] = set()  # lanes whose last read found entries
        # the least served backlogged lane's count when one last was: a lane back from idle
        # starts there, also when every lane's queue was empty a moment (an open-loop client)
        self._level = 0.0

    @property
    def lanes(self) -> dict[str, float]:
        return dict(self._weights)

    @property
    def tenanted(self) -> bool:
        """Whether any lane besides the bucket streams' exists (the read path asks per read)."""
        return len(self._weights) > 1

    def weight(self, lane: str) -> float:
        return self._weights.get(lane, 1.0)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The lanes and their weights (a new lane starts level with the least served)."""
        floor = self._floor()
        self._weights = {lane: w for lane, w in weights.items() if w > 0}
        for lane in self._weights:
            self._served.setdefault(lane, floor)
            self._mean_cost.setdefault(lane, 1.0)
        self._backlogged &= set(self._weights)

    def idle(self) -> set[str]:
        """The lanes a read last found empty."""
        return set(self._weights) - self._backlogged

    def counts(self, room: int) -> dict[str, int]:
        """Entries to read from each lane now. The room goes an entry at a time to the
        backlogged lane least served so far (counting each entry at its lane's mean cost
        over its weight), so the shares hold even when the room is one entry; every other
        lane is probed for the part it would have were it backlogged (one at least), so an
        idle lane's next entries are read as soon as they come, and cost no room until then.
        With no lane backlogged, each gets an equal part of the room."""
        backlogged = [lane for lane in self._weights if lane in self._backlogged]
        if not backlogged:
            return dict.fromkeys(self._weights, max(1, room // max(1, len(self._weights))))
        busy = sum(self._weights[lane] for lane in backlogged)
        out = {  # an idle lane's probe: its part of the room, were it backlogged too
            lane: 0 if lane in self._backlogged else max(1, round(room * w / (busy + w)))
            for lane, w in self._weights.items()
        }
        served = {lane: self._served[lane] for lane in backlogged}
        steps = {lane: self._mean_cost[lane] / self._weights[lane] for lane in backlogged}
        for lane, n in fill(served, steps, max(1, room)).items():
            out[lane] += n
        return {lane: n for lane, n in out.items() if n > 0}

    def read(
        self, asked: Iterable[str], costs: Mapping[str, int], entries: Mapping[str, int]
    ) -> None:
        """What a read found: `costs` (tokens) and `entries` per lane among those `asked`;
        a lane asked that gave nothing is idle until a read finds it backlogged again."""
        floor = self._floor()
        for lane in asked:
            if lane not in self._weights:
                continue
            count = entries.get(lane, 0)
            if count <= 0:
                self._backlogged.discard(lane)
                continue
            if lane not in self._backlogged:  # back from idle: no credit for the idle time
                self._served[lane] = max(self._served[lane], floor)
                self._backlogged.add(lane)
            cost = max(1, costs.get(lane, 0))
            self._served[lane] += cost / self._weights[lane]
            self._mean_cost[lane] += 0.2 * (cost / count - self._mean_cost[lane])

    def _floor(self) -> float:
        """The least served backlogged lane's count (when none is: as when one last was)."""
        served = [self._served[lane] for lane in self._backlogged if lane in self._served]
        if served:
            self._level = max(self._level, min(served))
        return self._level


def fill(served: Mapping[str, float], steps: Mapping[str, float], room: int) -> dict[str, int]:
    """`room` entries, one at a time, each to the lane whose count (`served`, plus `steps`
    for each entry it was given) is least, the first such lane on a tie: taken in bulk
    (`ahead`), then one at a time. Per read the loop alone cost 0.4 us an entry of room
    (28 us for 64, every read of a tenants' worker, measured)."""
    taken = ahead(served, steps, room)
    projected = {lane: served[lane] + taken[lane] * steps[lane] for lane in served}
    for _ in range(room - sum(taken.values())):
        lane = min(projected, key=projected.__getitem__)
        taken[lane] += 1
        projected[lane] += steps[lane]
    return taken


def ahead(served: Mapping[str, float], steps: Mapping[str, float], room: int) -> dict[str, int]:
    """What `fill` may take at once: each lane's entries counted below one step under the
    water level. Any entry counted below a bound comes before every entry at or above it,
    so these are the loop's first ones; one step under the level, they are at most the room,
    and leave the loop at most the largest step over each lane's step, summed."""
    if len(served) == 1:
        return {lane: room for lane in served}
    below = water_level(served, steps, room) - max(steps.values())
    taken = {
        lane: math.ceil((below - start) / steps[lane]) if below > start else 0
        for lane, start in served.items()
    }
    if sum(taken.values()) > room:  # rounding at the edge: all of it one at a time
        return dict.fromkeys(served, 0)
    return taken


def water_level(served: Mapping[str, float], steps: Mapping[str, float], room: int) -> float:
    """The count every lane would reach were `room` entries shared as a fluid: the level L
    where the lanes below it take sum((L - served) / step) = room."""
    rate = offset = level = 0.0
    lanes = sorted(served, key=served.__getitem__)
    for k, lane in enumerate(lanes):
        rate += 1 / steps[lane]
        offset += served[lane] / steps[lane]
        level = (room + offset) / rate
        if k + 1 < len(lanes) and level <= served[lanes[k + 1]]:
            break  # the next lane is above it: the level holds
    return level


class FairOrder:
    """The order a worker's batches take held rows in: virtual finish tags (self-clocked fair
    queueing). A row's tag is its lane's last tag, or the virtual time when the lane was
    idle, plus its tokens over the lane's weight; the virtual time is the largest tag a
    started batch has taken (one queued behind the running batch counts once it starts).
    One lane alone: tags rise in arrival order, so nothing changes; several: a light lane's
    rows take their place among a heavy lane's backlog by share, not behind it."""

    def __init__(self) -> None:
        self._now = 0.0
        self._last: dict[str, float] = {}

    def tag(self, lane: str, tokens: int, weight: float) -> float:
        tag = max(self._now, self._last.get(lane, 0.0)) + max(1, tokens) / weight
        self._last[lane] = tag
        return tag

    def taken(self, tags: Iterable[float]) -> None:
        self._now = max(self._now, *tags)
