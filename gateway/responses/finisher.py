"""Background responses finished by whichever gateway is alive: no run waits on its creator.

Every gateway looks at the running list twice a second. A run whose last chunk ends it is
read whole and its `Response` written (at most once, whoever is first); a run past its
deadline with no end is failed and its entry cancelled. A client polling `GET` or reading
the stream finishes a run the same way, sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

from common.clock import wall_ms
from common.streams import id_order
from gateway.responses.events import Events, Identity
from gateway.responses.store import TERMINAL, ResponseStore, stored_reply
from gateway.tool_calls import ToolUse

log = logging.getLogger("microbatch.gateway")
EVERY_S = 0.5
GRACE_MS = 2000  # past its deadline, a worker may still be writing its last chunk


def identity_of(response_id: str, record: dict[str, str]) -> Identity:
    """A stored response's identity, as every gateway rebuilds it."""
    known = orjson.loads(record["identity"])
    tools = known["tools"]
    use = (
        None
        if tools is None
        else ToolUse(frozenset(tools["names"]), tools["forced"], tools["parallel"])
    )
    return Identity(
        response_id,
        int(record["created_at"]),
        known["request"],
        use,
        record.get("background") == "1",
    )


def identity_fields(who: Identity) -> dict[str, Any]:
    """What `identity_of` reads back."""
    tools = who.tools
    described = (
        None
        if tools is None
        else {"names": sorted(tools.names), "forced": tools.forced, "parallel": tools.parallel}
    )
    return {"request": who.request, "tools": described}


async def replay(responses: ResponseStore, who: Identity) -> Events:
    """The events of every chunk stored so far, in order; `final` set where they end it."""
    events = Events(who)
    events.opening()
    after = "0-0"
    while events.final is None:
        found = await responses.chunks(who.response_id, after)
        if not found:
            break
        for entry in found:
            after = entry.entry_id
            events.feed(stored_reply(entry.payload), id_order(after)[0] // 1000)
    return events


class Finisher:
    def __init__(
        self, responses: ResponseStore, cancel: Any, ttl_s: int, events_ttl_s: int
    ) -> None:
        self._responses, self._cancel = responses, cancel
        self._ttl_s, self._events_ttl_s = ttl_s, events_ttl_s

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for response_id, deadline_ms in await self._responses.running(64):
                await self.settle(response_id, deadline_ms)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), EVERY_S)

    async def settle(self, response_id: str, deadline_ms: int) -> dict[str, Any] | None:
        """Finish the run if its chunks end it or its deadline has passed; its final
        `Response`, or None while it runs."""
        record = await self._responses.get(response_id)
        if record is None or record.get("status") in TERMINAL:
            await self._responses.forget(response_id)
            return orjson.loads(record["object"]) if record and record.get("object") else None
        who = identity_of(response_id, record)
        events = await replay(self._responses, who)
        final = events.final
        if final is None and wall_ms() > deadline_ms + GRACE_MS:
            events.failed("the response did not finish within its deadline")
            final = events.final
            self._cancel(record["model"], [record["entry"]], deadline_ms)
        if final is not None:
            await self.finished(events)
        return final

    async def finished(self, events: Events) -> None:
        """Store a background run's end, as its events concluded it."""
        final, response_id = events.final, events.who.response_id
        assert final is not None
        if await self._responses.finish(
            response_id,
            final["status"],
            final,
            self._ttl_s,
            self._events_ttl_s,
            events.fold.worker,
        ):
            log.info("response %s %s", response_id, final["status"])
