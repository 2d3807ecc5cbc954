"""`Leases`: the entries this worker holds or computes, until their answer is published.

Plain bookkeeping shared by three parts, each in one direction: the intake takes a lease
when it hands an entry to the loop, the publisher releases it once the entry is acked (or
given up, for a peer to reclaim), and the reclaimer renews every lease still held, so a
slow but alive worker keeps its work. A stream entry id can repeat across streams, so a
lease is the pair (stream, stream entry id); each also remembers the request entry's own
id, which is what the gateway cancels by.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

Lease = tuple[str, str]  # (request stream, entry id)


class Leases:
    def __init__(self) -> None:
        self._held: dict[Lease, str] = {}  # lease -> the request entry's id
        self._spans: dict[Lease, object] = {}  # lease -> its entry's span, when traced

    def take(self, lease: Lease, entry_id: str, span: object = None) -> None:
        self._held[lease] = entry_id
        if span is not None:
            self._spans[lease] = span

    def release(self, leases: Iterable[Lease]) -> list[object]:
        """Forget the leases; the spans of those traced, for the publisher to end."""
        spans = []
        for lease in leases:
            self._held.pop(lease, None)
            if self._spans:
                span = self._spans.pop(lease, None)
                if span is not None:
                    spans.append(span)
        return spans

    def entry_ids(self) -> list[str]:
        """The request entries' ids held: what the cancel set is asked about."""
        return list(self._held.values())

    def __contains__(self, lease: object) -> bool:
        return lease in self._held

    def __len__(self) -> int:
        return len(self._held)

    def by_stream(self) -> dict[str, list[str]]:
        """Entry ids held, grouped by their stream: one renewal command per stream."""
        out: dict[str, list[str]] = defaultdict(list)
        for stream, entry_id in self._held:
            out[stream].append(entry_id)
        return dict(out)
