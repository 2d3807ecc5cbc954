"""One batch driven from where it stands to its end: validate, feed its lines, finalize.

Whatever gateway holds the batch's lease runs this; a gateway that dies leaves the record
and every result so far in Redis, and the next driver starts again here, skipping the lines
that have a result. Lines go through the app in process (`post_local`) at background
priority, a window of them at a time: the window halves when the queue refuses a line
(503, 429) and grows by one per answer, so a file never floods the queue ahead of online
traffic. A line refused for load, or past its deadline while the batch's window is open,
is tried again; any other status is its result. The completion window is every line's
deadline; cancel stops the feed and hangs up on the lines in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from common import metrics
from common.backoff import Backoff
from common.tasks import spawn_supervised
from gateway.batch_gate import DepthGate
from gateway.batch_lines import Line, assemble, read_lines, result_line, unfinished_line
from gateway.batch_records import BatchRecords
from gateway.files import FileStore, expiry, file_meta
from gateway.local_call import LocalAnswer

log = logging.getLogger("microbatch.batches")

RETRIED = (429, 503, 504)  # load or time, not the line: it runs again
CHECK_EVERY_S = 0.5  # how often a driver rereads the record (a cancel) and saves its counts
FINALIZE_PAGE = 1000  # lines whose results are read and written out at once

Post = Callable[[str, bytes, dict[str, str], asyncio.Event], Awaitable[LocalAnswer]]
ModelProblem = Callable[[str, str | None], str | None]  # (endpoint, model) -> what is wrong
ModelName = Callable[[str, str | None], str]  # (endpoint, model or None) -> the model it means


@dataclass(frozen=True, slots=True)
class RunLimits:
    window: int
    max_lines: int
    max_timeout_ms: int
    output_ttl_s: int


@dataclass(slots=True)
class Window:
    """How many lines may be in the queue at once (additive increase, halved on refusal)."""

    limit: int
    size: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.size = float(min(self.limit, 16))

    def answered(self) -> None:
        self.size = min(float(self.limit), self.size + 1.0 / max(1.0, self.size) * 4)

    def refused(self) -> None:
        self.size = max(1.0, self.size / 2)


def now_s() -> int:
    return int(time.time())


class BatchRun:
    def __init__(
        self,
        batch_id: str,
        records: BatchRecords,
        files: FileStore,
        post: Post,
        model_problem: ModelProblem,
        limits: RunLimits,
        lost: asyncio.Event,
        gate: DepthGate,
        model_name: ModelName,
    ) -> None:
        self.id = batch_id
        self._records, self._files, self._post = records, files, post
        self._model_problem, self._limits = model_problem, limits
        self._lost = lost  # set when the lease is gone: another gateway drives it now
        self._gate, self._model_name = gate, model_name
        self._gone = asyncio.Event()  # hangs up on the lines in flight
        self._counts = {"completed": 0, "failed": 0}
        self._checked = 0.0
        self._record: dict[str, str] = {}

    async def drive(self) -> None:
        record = await self._records.get(self.id)
        if record is None or record["status"] in ("completed", "failed", "expired", "cancelled"):
            return
        self._record = record
        endpoint = record["endpoint"]
        try:
            data = await self._files.content(record["input_file_id"])
        except FileNotFoundError:
            await self._fail("input_file_missing", "the input file was deleted")
            return
        lines, problems = read_lines(
            data, endpoint, self._limits.max_lines, lambda m: self._model_problem(endpoint, m)
        )
        if problems:
            await self._fail_with([p.object() for p in problems])
            return
        if record["status"] == "validating":
            await self._records.update(
                self.id, status="in_progress", in_progress_at=now_s(), total=len(lines)
            )
        if record["status"] != "finalizing":
            done = await self._records.done(self.id)
            self._counts["completed"] = sum(done.values())
            self._counts["failed"] = len(done) - self._counts["completed"]
            await self._feed([line for line in lines if line.custom_id not in done])
        if not self._lost.is_set():
            await self._finalize(lines)

    async def _fail(self, code: str, message: str) -> None:
        await self._fail_with([{"code": code, "message": message, "param": None, "line": None}])

    async def _fail_with(self, problems: list[dict[str, Any]]) -> None:
        errors = orjson.dumps({"object": "list", "data": problems}).decode()
        await self._records.update(self.id, status="failed", failed_at=now_s(), errors=errors)
        await self._records.finished(self.id, self._limits.output_ttl_s)

    async def _stopping(self) -> bool:
        """Whether to feed no more: cancelled, expired, or the lease lost (the record is
        reread at most every CHECK_EVERY_S, and the counts saved then)."""
        if self._lost.is_set() or time.time() >= int(self._record["expires_at"]):
            return True
        if time.monotonic() - self._checked >= CHECK_EVERY_S:
            self._checked = time.monotonic()
            await self._records.update(self.id, **self._counts)
            self._record = await self._records.get(self.id) or self._record
        return bool(self._record.get("cancelling_at"))

    async def _feed(self, pending: list[Line]) -> None:
        window = Window(self._limits.window)
        inflight: set[asyncio.Task[None]] = set()
        try:
            endpoint = self._record["endpoint"]
            for line in pending:
                while len(inflight) >= int(window.size):
                    inflight = await _settle(inflight)
                    if await self._stopping():
                        return
                while not await self._gate.wait(
                    self._model_name(endpoint, line.model), CHECK_EVERY_S
                ):
                    if await self._stopping():
                        return
                if await self._stopping():
                    return
                task = spawn_supervised(f"{self.id} line", self._run_line(line, window), _noted)
                inflight.add(task)
            while inflight:
                inflight = await _settle(inflight)
                if await self._stopping():
                    return
        finally:
            if inflight:
                self._gone.set()  # hang up: each route cancels what it queued
                await asyncio.gather(*inflight, return_exceptions=True)
            await self._records.update(self.id, **self._counts)

    async def _run_line(self, line: Line, window: Window) -> None:
        endpoint, expires = self._record["endpoint"], int(self._record["expires_at"]) * 1000
        backoff = Backoff()
        request_id = f"{self.id}-{line.index}"
        while not self._gone.is_set():
            left_ms = expires - int(time.time() * 1000)
            if left_ms <= 0:
                return  # expired: finalize writes it as batch_expired
            headers = {
                "content-type": "application/json",
                "x-request-id": request_id,
                "x-microbatch-priority": "background",
                "x-microbatch-timeout-ms": str(min(left_ms, self._limits.max_timeout_ms)),
            }
            answer = await self._post(endpoint, line.body, headers, self._gone)
            if self._gone.is_set():
                return  # hung up: whatever came back is not this line's result
            if answer.status in RETRIED:
                metrics.batch_lines_total.labels("retried").inc()
                window.refused()
                await asyncio.sleep(backoff.next_s())
                continue
            window.answered()
            answered, out = result_line(self.id, line, answer.status, request_id, answer.body)
            await self._records.save_result(self.id, line.custom_id, answered, out)
            self._counts["completed" if answered else "failed"] += 1
            metrics.batch_lines_total.labels("answered" if answered else "failed").inc()
            return

    async def _finalize(self, lines: list[Line]) -> None:
        record = await self._records.get(self.id) or self._record
        await self._records.update(self.id, status="finalizing", finalizing_at=now_s())
        done = await self._records.done(self.id)
        cancelled = bool(record.get("cancelling_at"))
        expired = not cancelled and any(line.custom_id not in done for line in lines)
        ids = await self._write_files(lines, done, cancelled, record["owner"])
        status = "cancelled" if cancelled else "expired" if expired else "completed"
        completed = sum(done.values())
        await self._records.update(
            self.id,
            status=status,
            **{f"{status}_at": now_s()},
            completed=completed,
            failed=len(done) - completed,
            **ids,
        )
        await self._records.finished(self.id, self._limits.output_ttl_s)
        log.info(
            "batch %s %s: %d answered, %d failed", self.id, status, completed, len(done) - completed
        )

    async def _write_files(
        self, lines: list[Line], done: dict[str, bool], cancelled: bool, owner: str
    ) -> dict[str, str]:
        """The output and error files, written a page of lines at a time (a 50,000-line
        batch's results were read and assembled whole, twice its output in memory); every
        line without a result gets one saying why (`done` learns it failed)."""
        code, why = (
            ("batch_cancelled", "the batch was cancelled before this line ran")
            if cancelled
            else ("batch_expired", "the batch's completion window ended before this line ran")
        )
        hex_id, expires = self.id.removeprefix("batch_"), expiry(self._limits.output_ttl_s)
        file_ids = {"output_file_id": f"file-{hex_id}o", "error_file_id": f"file-{hex_id}e"}
        writers = {name: self._files.writer(fid, expires) for name, fid in file_ids.items()}
        for start in range(0, len(lines), FINALIZE_PAGE):
            page = lines[start : start + FINALIZE_PAGE]
            results = await self._records.results(
                self.id, [line.custom_id for line in page if line.custom_id in done]
            )
            for line in page:
                if line.custom_id not in done:
                    results[line.custom_id] = unfinished_line(self.id, line, code, why)
                    done[line.custom_id] = False
            output, errors = assemble(page, results, done)
            await writers["output_file_id"].write(output)
            await writers["error_file_id"].write(errors)
        ids = {}
        for name, writer in writers.items():
            if not writer.size:
                await writer.discard()
                continue
            filename = f"{self.id}_{name.removesuffix('_file_id')}.jsonl"
            meta = file_meta(file_ids[name], writer.size, filename, "batch_output", owner)
            await writer.commit(replace(meta, expires_at=expires))  # the writer's own expiry
            ids[name] = file_ids[name]
        return ids


async def _settle(inflight: set[asyncio.Task[None]]) -> set[asyncio.Task[None]]:
    """The lines still running once one ends (or CHECK_EVERY_S passes); a line that died of
    an error (Redis gone while saving its result) ends its driver with it."""
    done, running = await asyncio.wait(
        inflight, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED
    )
    for task in done:
        task.result()
    return running


def _noted(exc: BaseException | None) -> None:
    """A line task's death is its driver's to see: the driver awaits every one."""
