"""Fair shares between tenants where a worker reads: how many entries to take from each lane.

With a tenants file, each tenant's requests wait in lanes of their own (a stream per bucket);
untenanted traffic keeps the bucket streams (lane ""). A worker reads what it can start soon,
so the order it reads the lanes in is the order tenants are served: this policy splits each
read's room between the lanes by weight, and keeps a virtual-token counter per lane (tokens
read over its weight, as in "Fairness in Serving LLMs", OSDI 2024): a lane more than
`SLACK_TOKENS` ahead of the least served backlogged lane sits out until the others catch up,
so lanes whose requests are larger do not take more of the worker. A lane that comes back
from idle starts at the least served backlogged lane's count (no credit for idle time),
and a lane alone is never held back (work-conserving). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from common.protocol import GenerateEntry, RequestEntry

SLACK_TOKENS = 2048.0  # how far ahead of the least served backlogged lane a lane may run


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
        self._backlogged: set[str] = set()  # lanes whose last read found entries

    @property
    def lanes(self) -> dict[str, float]:
        return dict(self._weights)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The lanes and their weights (a new lane starts level with the least served)."""
        floor = self._floor()
        self._weights = {lane: w for lane, w in weights.items() if w > 0}
        for lane in self._weights:
            self._served.setdefault(lane, 0.0 if floor is None else floor)
        self._backlogged &= set(self._weights)

    def counts(self, room: int) -> dict[str, int]:
        """Entries to read from each lane now: the room split by weight (one at least)
        between the lanes not more than `SLACK_TOKENS` ahead of the least served."""
        floor = self._floor()
        eligible = {
            lane: w
            for lane, w in self._weights.items()
            if floor is None or self._served[lane] - floor <= SLACK_TOKENS
        }
        total = sum(eligible.values())
        return {lane: max(1, math.floor(room * w / total)) for lane, w in eligible.items()}

    def read(self, asked: Iterable[str], costs: Mapping[str, int]) -> None:
        """What a read found: `costs` (tokens) per lane among those `asked`; a lane asked
        that gave nothing is idle until a read finds it backlogged again."""
        floor = self._floor()
        for lane in asked:
            cost = costs.get(lane, 0)
            if lane not in self._weights:
                continue
            if cost <= 0:
                self._backlogged.discard(lane)
                continue
            if lane not in self._backlogged:
                if floor is not None:  # back from idle: no credit for the idle time
                    self._served[lane] = max(self._served[lane], floor)
                self._backlogged.add(lane)
            self._served[lane] += cost / self._weights[lane]

    def _floor(self) -> float | None:
        """The least served backlogged lane's count; None when no lane is backlogged."""
        served = [self._served[lane] for lane in self._backlogged if lane in self._served]
        return min(served) if served else None


class FairOrder:
    """The order a worker's batches take held rows in: virtual finish tags (self-clocked fair
    queueing). A row's tag is its lane's last tag, or the virtual time when the lane was
    idle, plus its tokens over the lane's weight; the virtual time is the largest tag a
    batch has taken. One lane alone: tags rise in arrival order, so nothing changes; several:
    a light lane's rows take their place among a heavy lane's backlog by share, not behind
    it."""

    def __init__(self) -> None:
        self._now = 0.0
        self._last: dict[str, float] = {}

    def tag(self, lane: str, tokens: int, weight: float) -> float:
        tag = max(self._now, self._last.get(lane, 0.0)) + max(1, tokens) / weight
        self._last[lane] = tag
        return tag

    def taken(self, tags: Iterable[float]) -> None:
        self._now = max(self._now, *tags)
