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
from collections.abc import Callable
from typing import Any

import orjson
from redis.exceptions import RedisError

from common.backoff import Backoff
from common.clock import wall_ms
from common.streams import id_order
from gateway.backlog_store import Reservation
from gateway.quota_store import Charge
from gateway.responses.events import Events, Identity
from gateway.responses.store import TERMINAL, ResponseStore, stored_reply
from gateway.tool_calls import ToolUse

log = logging.getLogger("microbatch.gateway")
EVERY_S = 0.5
GRACE_MS = 2000  # past its deadline, a worker may still be writing its last chunk
PAGE = 64  # running responses read from the list at a time


def identity_of(response_id: str, record: dict[str, str]) -> Identity:
    """A stored response's identity, as every gateway rebuilds it."""
    known = orjson.loads(record["identity"])
    tools = known["tools"]
    use = (
        None
        if tools is None
        else ToolUse(
            frozenset(tools["names"]),
            tools["forced"],
            tools["parallel"],
            tools.get("family", "hermes"),  # stored before the family was: Hermes
        )
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
        else {
            "names": sorted(tools.names),
            "forced": tools.forced,
            "parallel": tools.parallel,
            "family": tools.family,
        }
    )
    return {"request": who.request, "tools": described}


async def replay(responses: ResponseStore, who: Identity) -> Events:
    """The events of every chunk stored so far, in order; `final` set where they end it."""
    events = Events(who)
    events.opening()
    await catch_up(responses, events, "0-0")
    return events


async def catch_up(responses: ResponseStore, events: Events, after: str) -> str:
    """Feed `events` every chunk stored past stream id `after`, until none is left or the
    response ends; the id of the last one read."""
    response_id = events.who.response_id
    while events.final is None and (found := await responses.chunks(response_id, after)):
        for entry in found:
            after = entry.entry_id
            events.feed(stored_reply(entry.payload), id_order(after)[0] // 1000)
    return after


class Finisher:
    """Follows every running background response, each from the last chunk it read, so a
    pass costs one read per response and what is new, never a response's whole history."""

    def __init__(
        self,
        responses: ResponseStore,
        cancel: Any,
        ttl_s: int,
        events_ttl_s: int,
        release: Callable[[Reservation], None] = lambda _: None,
        settle: Callable[[Charge, int], None] = lambda _, __: None,
    ) -> None:
        self._responses, self._cancel, self._release = responses, cancel, release
        self._settle = settle
        self._ttl_s, self._events_ttl_s = ttl_s, events_ttl_s
        self._following: dict[str, tuple[Events, str]] = {}  # id -> (its events, last read)

    async def run(self, stop: asyncio.Event) -> None:
        """Every pass looks at every running response, a page at a time: one that ended
        must be written before its chunks' time to live runs out. Redis unreachable (a
        restart, a failover) is waited out, never the end of the task."""
        backoff = Backoff()
        while not stop.is_set():
            try:
                await self._pass()
                backoff.reset()
            except RedisError as exc:
                await backoff.wait(log, "response finisher", exc)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), EVERY_S)

    async def _pass(self) -> None:
        start, seen = 0, set()
        while page := await self._responses.running(start, PAGE):
            for response_id, deadline_ms in page:
                seen.add(response_id)
                await self.settle(response_id, deadline_ms)
            start += PAGE
        for gone in self._following.keys() - seen:
            del self._following[gone]

    async def settle(self, response_id: str, deadline_ms: int) -> dict[str, Any] | None:
        """Finish the run if its chunks end it or its deadline has passed; its final
        `Response`, or None while it runs."""
        followed = self._following.get(response_id)
        if followed is None:
            record = await self._responses.get(response_id)
            if record is None or record.get("status") in TERMINAL:
                await self._responses.forget(response_id)
                return None
            events = Events(identity_of(response_id, record))
            events.opening()
            followed = (events, "0-0")
        events, after = followed
        after = await catch_up(self._responses, events, after)
        self._following[response_id] = (events, after)
        if events.final is None and wall_ms() > deadline_ms + GRACE_MS:
            events.failed("the response did not finish within its deadline")
            record = await self._responses.get(response_id)
            if record is not None:
                self._cancel(record["model"], [record["entry"]], deadline_ms)
        if events.final is not None:
            await self.finished(events)
            self._following.pop(response_id, None)
        return events.final

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
            record = await self._responses.get(response_id)  # what its tenant was held to
            if record is not None:
                self._hand_back(record, events)

    def _hand_back(self, record: dict[str, Any], events: Events) -> None:
        """A run's tenant gets back its backlog, and what it did not use of its tokens
        charge (its prompt and what it generated are kept)."""
        if record.get("reserved"):
            self._release(Reservation.of_fields(orjson.loads(record["reserved"])))
        if record.get("charged"):
            charged = orjson.loads(record["charged"])
            used = charged["prompt_tokens"] + events.fold.completion_tokens
            self._settle(Charge.of_fields(charged["charge"]), used)
