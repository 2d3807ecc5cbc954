"""The soak's client side: bounded request loops, one record per request, what they add up
to, and the goals judged from that.

Imported by `benchmarks/soak.py` (which starts the stack and injects the faults); never run
on its own. Four kinds of request loop back to back until told to stop, each
request with a 20 s deadline (`X-Microbatch-Timeout-Ms`) and a client-side bound past it, so
nothing can hang the run:

- `embed`: one text to `noop`; the answer must hold one 384-d vector;
- `bulk`: 300 texts to `noop`; 300 vectors, indices 0..299 in order;
- `rerank`: a query and 8 documents to `reranker`; 8 results, each document once;
- `chat`: a streamed chat completion from `chat` (`max_tokens` 32, greedy, `return_token_ids`,
  `include_usage`); its events are parsed: `[DONE]`, an error event's code, the token ids of
  every chunk, which must number the usage's `completion_tokens` (else the text has a hole).

Accepted: every request the gateway did not refuse up front (any 503 or 429 is a refusal,
counted by code, as is a connection it never took). A stream that ends with an error event
(worker_failed) is counted as gapped, by code; only one that ends without [DONE] and without
an error, or whose ids fall short, has a silent hole.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

DEADLINE_MS = 20_000
GRACE_S = 1.0  # an answer this long after its deadline is late
CLIENT_TIMEOUT_S = 30.0  # httpx's bound on each connect / read / write
REQUEST_BOUND_S = 40.0  # the whole request, streams included
HEADERS = {"X-Microbatch-Timeout-Ms": str(DEADLINE_MS)}
BULK_TEXTS = 300
DOCUMENTS = [
    "batches wait on a Redis stream per length bucket",
    "the gateway answers from its own reply stream",
    "bananas are yellow",
    "a worker that dies leaves its entries pending for a peer",
    "append-only files survive a restart",
    "streams are trimmed as replies are read",
    "the deadline travels with every entry",
    "cats sleep most of the day",
]
PROMPTS = ["hello", "where do batches wait?", "tell me about redis streams", "kalo mine"]
# The gateway refused these at admission (or never saw them): not accepted, counted by code.
NOT_REACHED = {"connect_error", "connect_timeout", "pool_timeout", "closed_by_gateway_shutdown"}


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times in seconds since the run's start."""

    kind: str
    start: float
    end: float = 0.0
    status: int = 0  # HTTP status; 0: no HTTP answer (then `code` names the client's failure)
    code: str | None = None  # the error body's `error.code`, or the client-side failure
    message: str = ""
    wrong: bool = False  # a 200 whose content does not fit the request
    done: bool = False  # streams: `data: [DONE]` arrived
    stream_error: str | None = None  # streams: the code of an error event
    hole: bool = False  # streams: fewer or more token ids than the usage's completion_tokens
    reference: bool | None = None  # streams: ids equal the greedy non-streamed answer

    @property
    def accepted(self) -> bool:
        """The gateway did not refuse it at admission: no 503/429, and it reached the gateway."""
        return self.status not in (429, 503) and self.code not in NOT_REACHED

    @property
    def late(self) -> bool:
        return self.end - self.start > DEADLINE_MS / 1000 + GRACE_S

    @property
    def gapped(self) -> bool:
        """A stream that ended without [DONE] or with an error event."""
        return (
            self.kind == "chat"
            and self.status == 200
            and (not self.done or bool(self.stream_error))
        )

    @property
    def silent_hole(self) -> bool:
        """A stream whose text is incomplete with nothing to say so: no [DONE] and no error
        event, or token ids that do not add up to the completion the usage reports."""
        if self.kind != "chat" or self.status != 200 or self.stream_error:
            return False
        return not self.done or self.hole


def _error(body: bytes) -> tuple[str, str]:
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return "non_json", body[:120].decode(errors="replace")
    return str(error.get("code")), str(error.get("message", ""))[:200]


def _checked_vectors(answer: dict, n: int) -> bool:
    data = answer.get("data") or []
    indices = [d.get("index") for d in data]
    return indices == list(range(n)) and all(len(d.get("embedding", ())) == 384 for d in data)


def _checked_rerank(answer: dict) -> bool:
    indices = sorted(r.get("index") for r in answer.get("results") or [])
    return indices == list(range(len(DOCUMENTS)))


FAILURES = (  # the client's own failures, by name (subclasses before their bases)
    (TimeoutError, "client_timeout"),
    (httpx.ConnectError, "connect_error"),
    (httpx.ConnectTimeout, "connect_timeout"),
    (httpx.PoolTimeout, "pool_timeout"),
    (httpx.ReadTimeout, "read_timeout"),
    (httpx.RemoteProtocolError, "remote_protocol_error"),
    (httpx.ReadError, "read_error"),
)


def _client_failure(exc: BaseException) -> str:
    return next((name for cls, name in FAILURES if isinstance(exc, cls)), type(exc).__name__)


@dataclass
class Load:
    """Loops of each kind against `url`; every request ends as a Record in `records`."""

    url: str
    t0: float  # time.monotonic() at the run's start
    references: dict[str, list[int]] = field(default_factory=dict)  # prompt -> greedy ids
    records: list[Record] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, loops: dict[str, int], stop: asyncio.Event) -> None:
        """Every loop until `stop`; returns once each has finished its request in flight."""
        limits = httpx.Limits(max_connections=sum(loops.values()) + 4)
        timeout = httpx.Timeout(CLIENT_TIMEOUT_S)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as client:
            await asyncio.gather(
                *(
                    self._loop(client, kind, n, stop)
                    for kind, count in loops.items()
                    for n in range(count)
                )
            )

    async def _loop(self, client: httpx.AsyncClient, kind: str, n: int, stop: asyncio.Event):
        send = {"embed": self._embed, "bulk": self._bulk, "rerank": self._rerank}.get(
            kind, self._chat
        )
        i = 0
        while not stop.is_set():
            record = Record(kind, self.now())
            try:
                await asyncio.wait_for(send(client, record, n * 100_000 + i), REQUEST_BOUND_S)
            except (httpx.HTTPError, TimeoutError, OSError) as exc:
                record.code, record.message = _client_failure(exc), str(exc)[:200]
            record.end = self.now()
            self.records.append(record)
            i += 1
            await asyncio.sleep(_pause(record))

    async def _post(self, client: httpx.AsyncClient, record: Record, path: str, body: dict):
        response = await client.post(path, json=body, headers=HEADERS)
        record.status = response.status_code
        if response.status_code != 200:
            record.code, record.message = _error(response.content)
            return None
        return response.json()

    async def _embed(self, client: httpx.AsyncClient, record: Record, i: int) -> None:
        body = {"model": "noop", "input": f"soak request {i}: where do batches wait?"}
        answer = await self._post(client, record, "/v1/embeddings", body)
        record.wrong = answer is not None and not _checked_vectors(answer, 1)

    async def _bulk(self, client: httpx.AsyncClient, record: Record, i: int) -> None:
        texts = [f"bulk {i} text {j} about queues" for j in range(BULK_TEXTS)]
        answer = await self._post(
            client, record, "/v1/embeddings", {"model": "noop", "input": texts}
        )
        record.wrong = answer is not None and not _checked_vectors(answer, BULK_TEXTS)

    async def _rerank(self, client: httpx.AsyncClient, record: Record, i: int) -> None:
        body = {
            "model": "reranker",
            "query": f"where do batches wait? ({i})",
            "documents": DOCUMENTS,
        }
        answer = await self._post(client, record, "/v1/rerank", body)
        record.wrong = answer is not None and not _checked_rerank(answer)

    async def _chat(self, client: httpx.AsyncClient, record: Record, i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        body = chat_body(prompt, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=HEADERS) as r:
            record.status = r.status_code
            if r.status_code != 200:
                record.code, record.message = _error(await r.aread())
                return
            ids, completion = await _read_events(r, record)
        if record.done and not record.stream_error:
            record.hole = completion is not None and len(ids) != completion
            if prompt in self.references:
                record.reference = ids == self.references[prompt]

    async def fetch_references(self) -> None:
        """Each prompt's greedy answer, whole and before any fault: what a stream should say."""
        async with httpx.AsyncClient(base_url=self.url, timeout=CLIENT_TIMEOUT_S) as client:
            for prompt in PROMPTS:
                r = await client.post(
                    "/v1/chat/completions", json=chat_body(prompt, stream=False), headers=HEADERS
                )
                if r.status_code == 200:
                    self.references[prompt] = r.json()["choices"][0].get("token_ids") or []


def chat_body(prompt: str, stream: bool) -> dict:
    messages = [{"role": "user", "content": prompt}]
    body = {"model": "chat", "messages": messages, "max_tokens": 32, "temperature": 0}
    body |= {"return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _read_events(response: httpx.Response, record: Record) -> tuple[list[int], int | None]:
    """The token ids of every chunk and the usage's completion_tokens; sets done/stream_error."""
    ids: list[int] = []
    completion = None
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            record.done = True
        elif line.startswith("data: {"):
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"] or {}
                record.stream_error = str(error.get("code"))
                record.message = str(error.get("message", ""))[:200]
            for choice in event.get("choices") or []:
                ids.extend(choice.get("token_ids") or [])
            if event.get("usage"):
                completion = event["usage"].get("completion_tokens")
    return ids, completion


def _pause(record: Record) -> float:
    """Back off after a refusal or a failed connection, so a loop never spins on errors."""
    return 0.5 if record.status in (0, 429, 503) else 0.0


def summarize(records: list[Record], faults: list[dict]) -> dict:
    """Every count the report prints, from the records (and when the gateway restarted)."""
    for fault in faults:
        if fault["fault"].startswith("restart gateway"):
            closed_by_shutdown(records, fault["t"] - 0.5, fault["t"] + fault["took_s"])
    accepted = [r for r in records if r.accepted]
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r.kind, Counter())[str(r.status) if r.status else r.code or "0"] += 1
    chats = [r for r in records if r.kind == "chat" and r.status == 200]
    return {
        "requests": len(records),
        "by_kind_and_status": {k: dict(sorted(c.items())) for k, c in sorted(by_kind.items())},
        "accepted": len(accepted),
        "refused_by_code": _count(r.code or str(r.status) for r in records if not r.accepted),
        "accepted_without_http_answer": _count(r.code for r in accepted if r.status == 0),
        "accepted_late": len([r for r in accepted if r.late]),
        "accepted_late_by_kind": _count(r.kind for r in accepted if r.late),
        "server_errors_by_code": _count(f"{r.status} {r.code}" for r in records if r.status >= 500),
        "client_errors_by_code": _count(
            f"{r.status} {r.code}" for r in records if 400 <= r.status < 500 and r.status != 429
        ),
        "wrong_answers_by_kind": _count(r.kind for r in records if r.wrong),
        "streams": len(chats),
        "streams_completed": len([r for r in chats if r.done and not r.stream_error]),
        "gapped_streams_by_code": _count(r.stream_error or "no_done" for r in chats if r.gapped),
        "silent_holes": len([r for r in chats if r.silent_hole]),
        "streams_differing_from_reference": len([r for r in chats if r.reference is False]),
        "first_message_by_code": _first_messages(records),
        # every request that did not end well: [kind, start s, seconds, status, code]
        "failures": [
            [
                r.kind,
                round(r.start, 1),
                round(r.end - r.start, 2),
                r.status,
                r.stream_error or r.code,
            ]
            for r in records
            if r.status != 200 or r.stream_error or r.wrong or r.silent_hole
        ][:5000],
        "latest_end_over_deadline_s": round(
            max((r.end - r.start for r in accepted), default=0.0) - DEADLINE_MS / 1000, 1
        ),
    }


def closed_by_shutdown(records: list[Record], start: float, end: float) -> None:
    """Relabel what the gateway's own shutdown dropped: a connection it closed with no answer
    held no request it had read (uvicorn finishes those before it exits), so not accepted."""
    for r in records:
        dropped = r.status == 0 and r.code in ("read_error", "remote_protocol_error")
        if dropped and start <= r.start <= end:
            r.code = "closed_by_gateway_shutdown"


def _count(values: Iterable[str | None]) -> dict[str, int]:
    return dict(sorted(Counter(str(v) for v in values).items()))


def _first_messages(records: list[Record]) -> dict[str, str]:
    """One message per failure code (the first seen), to say what each code meant here."""
    seen: dict[str, str] = {}
    for r in records:
        code = r.stream_error or r.code
        if code and code not in seen:
            seen[code] = r.message
    return dict(sorted(seen.items()))


def memory_report(series: list[tuple[float, int | None]], duration_s: float) -> dict:
    mb = [(t, v / 2**20) for t, v in series if v is not None]
    values = [v for _, v in mb]
    first = [v for t, v in mb if t < 60] or values[:1]
    last = [v for t, v in mb if duration_s - 60 <= t <= duration_s] or values[-1:]
    if not values:
        return {"samples": len(series), "missing": len(series)}
    return {
        "samples": len(series),
        "missing": len(series) - len(values),
        "min_mb": round(min(values), 2),
        "median_mb": round(statistics.median(values), 2),
        "max_mb": round(max(values), 2),
        "first_minute_median_mb": round(statistics.median(first), 2),
        "last_minute_median_mb": round(statistics.median(last), 2),
        "growth_mb": round(statistics.median(last) - statistics.median(first), 2),
    }


def goals(report: dict, flat_mb: float) -> list[tuple[str, bool, str]]:
    """(goal, met, detail) per promise. A stream ended by an error event told its client to
    retry: counted as gapped, by code, but only a silent hole breaks the promise."""
    s, m = report["summary"], report["memory"]
    lost, wrong = s["accepted_without_http_answer"], sum(s["wrong_answers_by_kind"].values())
    first, last = m.get("first_minute_median_mb"), m.get("last_minute_median_mb")
    one = f"{s['accepted']} accepted; no HTTP answer {lost or 0}, {wrong} wrong answers"
    late = f"{s['accepted_late']} late; slowest {s['latest_end_over_deadline_s']:+} s vs deadline"
    holes = f"{s['silent_holes']} of {s['streams']}; gapped {s['gapped_streams_by_code'] or 0}"
    return [
        ("every accepted request got exactly one answer", not lost and not wrong, one),
        ("nothing answered past its deadline (+1 s)", s["accepted_late"] == 0, late),
        ("no streamed answer has a silent hole", s["silent_holes"] == 0, holes),
        (
            f"Redis used_memory flat (last-minute median within {flat_mb} MB of the first's)",
            m.get("growth_mb") is not None and abs(m["growth_mb"]) <= flat_mb,
            f"first {first} MB, last {last} MB",
        ),
    ]


def print_summary(report: dict, flat_mb: float) -> None:
    s, m = report["summary"], report["memory"]
    statuses = sorted({k for c in s["by_kind_and_status"].values() for k in c})
    print(f"\n{'kind':<8}" + "".join(f"{k:>22}" for k in statuses) + f"{'total':>8}")
    for kind, counts in s["by_kind_and_status"].items():
        cells = "".join(f"{counts.get(k, 0):>22}" for k in statuses)
        print(f"{kind:<8}{cells}{sum(counts.values()):>8}")
    print(f"requests {s['requests']}, accepted {s['accepted']}, refused {s['refused_by_code']}")
    print(f"accepted but unanswered past their deadline: {s['accepted_late']} (must be 0)")
    print(f"accepted with no HTTP answer: {s['accepted_without_http_answer']}")
    print(f"5xx by code (a 503 is a refusal): {s['server_errors_by_code']}")
    print(f"4xx by code: {s['client_errors_by_code']}; wrong answers {s['wrong_answers_by_kind']}")
    print(
        f"streams {s['streams']}: completed {s['streams_completed']}, gapped by code "
        f"{s['gapped_streams_by_code']}, silent holes {s['silent_holes']}, differing from the "
        f"greedy reference {s['streams_differing_from_reference']} (of {report['references']})"
    )
    print(f"messages: {json.dumps(s['first_message_by_code'], indent=1)}")
    print(
        f"duplicate replies dropped by the gateway {report['duplicate_replies_dropped']:.0f}, "
        f"redeliveries {report['redeliveries']:.0f}, dead letters {report['dead_letters']:.0f}"
    )
    print(f"used_memory MB: {m}")
    print(f"processes that exited on their own: {report['crashes'] or 'none'}")
    for name, ok, detail in goals(report, flat_mb):
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
