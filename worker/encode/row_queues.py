"""`RowQueues`: an embedding worker's rows waiting for a batch, one queue per length bucket.

Each row is kept twice: by key (what a batch takes) and as the `Waiting` the policy reads,
in the order batches grow through a queue (length, then arrival), so no decision sorts the
whole queue: rows that arrived since the last decision are merged in, only where they did.
A redelivered entry's rows (a worker may have died computing them) wait apart, for batches
of one row each that run with nothing else computing: a poison input that kills its process
takes no batch-mate with it again. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from worker.encode.assembly import Assembly
from worker.encode.batching import Batch, Waiting, in_order
from worker.lane_shares import FairOrder

TAKEN_KEPT = 4096  # taken rows whose places are remembered, for batches taken back
Row = tuple[Assembly, int]  # an entry's assembly, and the row's index in the entry


class RowQueues:
    def __init__(self, buckets: Iterable[int]) -> None:
        self._queues: dict[int, dict[int, Row]] = {b: {} for b in buckets}
        self._views: dict[int, list[Waiting]] = {b: [] for b in self._queues}
        self._unsorted: set[int] = set()  # buckets with rows appended since the last sort
        self._alone: list[tuple[int, Waiting]] = []  # redelivered rows: (bucket, row), in order
        self._seq = itertools.count()
        self._fair = FairOrder()
        self._order: dict[int, float] = {}  # key -> a queued row's place in the fair order
        # a taken row's place, kept a while: a batch taken back (`put_back`) keeps its places
        self._taken: dict[int, float] = {}

    @property
    def held(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, bucket: int, assembly: Assembly) -> None:
        """Every row of a new entry, queued, each given its place in the tenants' fair order."""
        held, keys = assembly.held, []
        for i, row in enumerate(assembly.rows):
            key = next(self._seq)
            self._order[key] = self._fair.tag(held.lane, len(row), held.weight)
            keys.append((key, (assembly, i)))
        self.put_back(bucket, keys)

    def put_back(self, bucket: int, rows: Iterable[tuple[int, Row]]) -> None:
        """Rows queued (again) under their keys, where they wait by length and arrival."""
        queue, views = self._queues[bucket], self._views[bucket]
        before = len(views)
        for key, row in rows:
            assembly, index = row
            queue[key] = row
            arrived_s, priority = assembly.held.arrived_s, assembly.entry.priority
            order = self._order.get(key)
            if order is None:  # a taken row back: its old place, else a new one
                order = self._taken.pop(key, None)
                if order is None:
                    order = self._fair.tag(assembly.held.lane, 1, assembly.held.weight)
                self._order[key] = order
            waiting = Waiting(key, len(assembly.rows[index]), arrived_s, priority, order)
            if assembly.held.alone:
                self._alone.append((bucket, waiting))
            else:
                views.append(waiting)
        if len(views) > before:
            self._unsorted.add(bucket)

    def in_order(self) -> dict[int, list[Waiting]]:
        """Each bucket's queue in length order; new rows were appended, so the sort merges
        two ordered runs (linear), and only where rows arrived."""
        for bucket in self._unsorted:
            self._views[bucket] = in_order(self._views[bucket])
        self._unsorted.clear()
        return self._views

    def take(self, bucket: int, keys: Iterable[int], started: bool = True) -> list[Row]:
        """These rows, off the queue (the order of the rest stays). A batch queued behind
        the running one (`started` False) moves the fair order's virtual time only when it
        starts (`started`): a row that arrives meanwhile is placed by the batch in service,
        so a light tenant's row can still go before the queued batch (which is revoked for
        it) instead of after it, a whole batch later."""
        queue, keys = self._queues[bucket], list(keys)
        rows = [queue.pop(key) for key in keys]
        if keys:
            places = [self._order.pop(key, 0.0) for key in keys]
            if started:
                self._fair.taken(places)
            self._taken.update(zip(keys, places, strict=True))
            while len(self._taken) > TAKEN_KEPT:  # oldest first: dicts keep insertion order
                del self._taken[next(iter(self._taken))]
        gone = set(keys)
        self._views[bucket] = [w for w in self._views[bucket] if w.key not in gone]
        if self._alone:
            self._alone = [(b, w) for b, w in self._alone if b != bucket or w.key not in gone]
        return rows

    def started(self, keys: Iterable[int]) -> None:
        """A batch queued behind the running one started: the virtual time moves past it."""
        places = [self._taken[k] for k in keys if k in self._taken]
        if places:
            self._fair.taken(places)

    def ahead_of(self, assembly: Assembly) -> float:
        """The earliest place in the fair order of an entry's queued rows."""
        bucket = assembly.held.bucket
        return min(
            (self._order[k] for k, (a, _) in self._queues[bucket].items() if a is assembly),
            default=float("inf"),
        )

    def latest(self, keys: Iterable[int]) -> float:
        """The latest place in the fair order among taken rows (-inf: none remembered)."""
        return max((self._taken[k] for k in keys if k in self._taken), default=float("-inf"))

    def lone(self) -> Batch | None:
        """The next redelivered row, as a batch of its own; None when there is none."""
        if not self._alone:
            return None
        bucket, row = self._alone[0]
        return Batch(bucket, (row.key,), row.n_tokens, row.n_tokens, "alone")

    def drop(self, assembly: Assembly) -> int:
        """An entry's queued rows, off the queue for good; how many there were."""
        bucket = assembly.held.bucket
        keys = [k for k, (a, _) in self._queues[bucket].items() if a is assembly]
        self.take(bucket, keys)
        return len(keys)
