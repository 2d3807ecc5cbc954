"""`Inbox`: what a loop is told by the parts around it, and the loop's one place to wait.

The seam between a loop (embedding or generation) and the parts that feed it, in one
direction each: the liveness part posts the cancel set and the operator's live batching
settings, the intake says when reading is over, the loop's own `hold` wakes it; the loop
reads and waits, and says through `room_freed` when the reader may read again. Nobody
reaches into anybody's state: every exchange is a method here.
"""

from __future__ import annotations

import asyncio
import contextlib


class Inbox:
    def __init__(self) -> None:
        self._wake = asyncio.Event()  # something arrived, left, finished or changed
        self._room = asyncio.Event()  # the loop took or finished work: room to read
        self.cancelled: set[str] = set()  # entry ids whose clients stopped waiting
        self.gone: frozenset[str] = frozenset()  # reply streams of gateways that left or died
        self.version = 0  # bumps whenever `cancelled` or `gone` changes
        self.overrides: dict[str, str] = {}  # live batching settings (`microbatch tune`)
        self.reading = True  # false once the reader has stopped for good

    # ---- written by the parts around the loop --------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def post_cancelled(self, ids: set[str]) -> None:
        """The held entries found cancelled at the last poll; the loop wakes only when that
        grew."""
        if ids != self.cancelled:
            self.version += 1
        if ids - self.cancelled:
            self._wake.set()
        self.cancelled = ids

    def post_gone(self, reply_streams: frozenset[str]) -> None:
        """Reply streams whose gateway left or stopped beating: nobody will read their
        answers, so what is held for them is dropped like a cancellation."""
        if reply_streams != self.gone:
            self.version += 1
            if reply_streams - self.gone:
                self._wake.set()
            self.gone = reply_streams

    def unwanted(self, entry_id: str, reply_to: str) -> bool:
        """Whether nobody waits for this entry's answer any more."""
        return entry_id in self.cancelled or reply_to in self.gone

    def post_overrides(self, overrides: dict[str, str]) -> None:
        """Live settings as last read; replaced (and the loop woken) only when they differ,
        so the loop can tell a change by identity."""
        if overrides != self.overrides:
            self.overrides = overrides
            self._wake.set()

    def reading_ended(self) -> None:
        self.reading = False
        self._wake.set()

    # ---- the loop's side --------------------------------------------------------------------

    async def wait(self, timeout_s: float | None) -> None:
        """Until something changes or `timeout_s` passes. `asyncio.timeout`, not `wait_for`,
        which would start a task on every call (several per batch)."""
        self._wake.clear()
        await _wait(self._wake, timeout_s)

    def room_freed(self) -> None:
        self._room.set()

    # ---- the reader's side ------------------------------------------------------------------

    async def wait_room(self, timeout_s: float) -> None:
        """Until the loop frees room or `timeout_s` passes."""
        self._room.clear()
        await _wait(self._room, timeout_s)


async def _wait(event: asyncio.Event, timeout_s: float | None) -> None:
    if timeout_s is None:
        await event.wait()
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
