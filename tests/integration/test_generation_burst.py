"""Generation-worker scenarios driven in-process until idle (burst mode), on the tiny Llama.

A real redis-server holds the streams and the real paged engine computes; the worker is
composed as the CLI composes it, with `Consumer.run_until_idle` reading what the streams
hold, answering it and returning. Deterministic: no processes, no sleeps, no timing bets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from common import streams
from common.protocol import (
    DeadLetter,
    ErrorReply,
    GenerateEntry,
    GenerationChunk,
    decode,
    encode,
    pack_tokens,
)
from common.settings import Settings
from common.store import close_store, open_store
from tests.conftest import eventually
from worker.compute_threads import ComputeThreads
from worker.consumer import Consumer, compose
from worker.generate.engine import GenerationEngine
from worker.generate.loop import GenerationLoop
from worker.triage import EntryLimits

MODEL = "tiny"
REPLY = "mb:reply:gen-burst"
NAME = "gen-burst"


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_model: Path):
    from tokenizers import Tokenizer

    engine = GenerationEngine(tiny_model, kv_tokens=1024, block_size=4)
    return engine, Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def _entry(i: int, prompt: list[int], deadline_in_ms: int = 60_000, **options) -> GenerateEntry:
    now = int(time.time() * 1000)
    fields = dict(
        id=f"g.{i}",
        request_id=f"r{i}",
        model=MODEL,
        tokens=pack_tokens(prompt),
        deadline_ms=now + deadline_in_ms,
        priority=1,
        reply_to=REPLY,
        enqueued_ms=now,
        max_tokens=6,
        temperature=0.0,
        top_p=1.0,
        seed=-1,
        stop=[],
        stream=False,
        ignore_eos=True,
    )
    fields.update(options)
    return GenerateEntry(**fields)


@dataclass
class Outcome:
    replies: dict[str, list[GenerationChunk | ErrorReply]]  # every reply, per entry id
    steps: int
    left: int  # entries still in the request stream (acked ones are deleted)
    dead: list[DeadLetter]


async def _burst(
    redis_url: str,
    engine_and_tokenizer,
    entries: list[GenerateEntry],
    cancelled: tuple[str, ...] = (),
    delivered: int = 0,
) -> Outcome:
    """Queue `entries` (read `delivered` times already by this worker's past self), run a
    generation worker until idle."""
    engine, tokenizer = engine_and_tokenizer
    settings = Settings(redis_url=redis_url, model=MODEL, max_deliveries=3)
    store = open_store(settings)
    keys = streams.Keys(settings.prefix)
    stream = keys.request(MODEL, 128)
    try:
        await streams.ensure_groups(store, [stream])
        await streams.add_requests(store, [(stream, encode(e)) for e in entries])
        await streams.cancel(store, keys, MODEL, list(cancelled), int(time.time() * 1000) + 60_000)
        _deliver(redis_url, stream, delivered)
        consumer, loops = _generation_worker(settings, store, engine, tokenizer)
        await asyncio.wait_for(consumer.run_until_idle(), 60)
        assert consumer.crashed is None
        replies: dict[str, list[GenerationChunk | ErrorReply]] = {}
        for item in await streams.read_replies(store, REPLY, "0-0", count=10_000, block_ms=None):
            reply = decode(item.payload or b"")
            replies.setdefault(reply.id, []).append(reply)
        dead = await store.xrange(keys.dead(MODEL))
        return Outcome(
            replies,
            loops[0].steps_run,
            await store.xlen(stream),
            [decode(fields[b"m"]) for _, fields in dead],
        )
    finally:
        await close_store(store)


def _generation_worker(
    settings: Settings, store, engine: GenerationEngine, tokenizer
) -> tuple[Consumer, list[GenerationLoop]]:
    """A generation worker composed as the CLI composes it, and (once built) its loop."""
    limits = EntryLimits(
        model=MODEL,
        max_tokens=engine.context,
        vocab_size=engine.vocab_size,
        max_deliveries=3,
        generates=True,
    )
    compute = ComputeThreads()
    loops: list[GenerationLoop] = []

    def make_loop(wiring):
        loops.append(GenerationLoop(settings, wiring, engine, tokenizer, compute))
        return loops[-1]

    async def register() -> None:
        return None

    return compose(settings, store, limits, NAME, make_loop, register, compute), loops


def _deliver(redis_url: str, stream: str, times: int) -> None:
    """Read every entry `times` times as this worker's past self and never ack, as a worker
    killed mid-generation leaves them (each re-read counts a delivery)."""
    client = redis.Redis.from_url(redis_url)
    try:
        for n in range(times):
            client.xreadgroup("workers", NAME, {stream: ">" if n == 0 else "0"}, count=100)
    finally:
        client.close()


def _tokens(chunks: list) -> list[int]:
    return [t for c in chunks for t in np.frombuffer(c.tokens, "<u4").tolist()]


def test_each_prompt_is_answered_once_with_the_same_tokens_streamed_or_whole(
    redis_url: str, engine_and_tokenizer
) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
    whole = [_entry(0, prompts[0]), _entry(1, prompts[1])]
    streamed = _entry(2, prompts[2], stream=True)
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, [*whole, streamed]))
    assert sorted(outcome.replies) == ["g.0", "g.1", "g.2"]
    for entry in whole:
        [answer] = outcome.replies[entry.id]
        assert isinstance(answer, GenerationChunk)
        assert (answer.finish_reason, answer.completion_tokens) == ("length", 6)
    chunks = outcome.replies["g.2"]
    assert all(isinstance(c, GenerationChunk) for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))  # in order, no gap
    assert len({c.attempt for c in chunks}) == 1
    assert [c.finish_reason for c in chunks][-1] == "length"
    assert all(not c.finish_reason for c in chunks[:-1])
    # greedy: the stream carries exactly the tokens of the same prompt answered whole
    assert _tokens(chunks) == _tokens(outcome.replies["g.0"])
    assert outcome.left == 0


def test_n_choices_are_answered_and_the_entry_acked_once(
    redis_url: str, engine_and_tokenizer
) -> None:
    entry = _entry(0, [5, 6, 7], n=3, temperature=1.0, seed=7)
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, [entry]))
    finals = [c for c in outcome.replies["g.0"] if c.finish_reason]
    assert sorted(c.choice for c in finals) == [0, 1, 2]
    assert all(c.completion_tokens == 6 for c in finals)
    assert outcome.left == 0


def test_cancelled_and_expired_prompts_cost_no_step(redis_url: str, engine_and_tokenizer) -> None:
    gone = _entry(0, [5, 6, 7], enqueued_ms=int(time.time() * 1000) - 1000)  # waited; left
    late = _entry(1, [5, 6, 8], deadline_in_ms=-1)
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, [gone, late], ("g.0",)))
    assert outcome.steps == 0
    assert "g.0" not in outcome.replies  # its client left: nobody to answer
    [error] = outcome.replies["g.1"]
    assert isinstance(error, ErrorReply) and error.status == 504
    assert outcome.left == 0


def test_a_response_format_that_cannot_compile_is_answered_400_and_others_run(
    redis_url: str, engine_and_tokenizer
) -> None:
    bad = _entry(0, [5, 6], response_format="json_schema", json_schema='{"type": "nonsense"}')
    good = _entry(1, [5, 6])
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, [bad, good]))
    [error] = outcome.replies["g.0"]
    assert isinstance(error, ErrorReply) and error.status == 400
    assert "response_format" in error.message
    [answer] = outcome.replies["g.1"]
    assert isinstance(answer, GenerationChunk) and answer.finish_reason == "length"
    assert outcome.left == 0


def test_a_restarted_worker_generates_its_own_pending_prompts_again(
    redis_url: str, engine_and_tokenizer
) -> None:
    """Killed mid-generation, a worker's entries stay pending under its name; restarted
    under it, it drains them first and answers each once, streams without a gap."""
    entries = [_entry(0, [5, 6, 7], stream=True), _entry(1, [8, 9])]
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, entries, delivered=1))
    for entry in entries:
        finals = [c for c in outcome.replies[entry.id] if isinstance(c, GenerationChunk)]
        assert finals and finals[-1].finish_reason == "length"
        assert [c.index for c in finals] == list(range(len(finals)))
    assert outcome.left == 0 and outcome.dead == []


def test_a_prompt_delivered_past_max_deliveries_is_dead_lettered_with_an_answer(
    redis_url: str, engine_and_tokenizer
) -> None:
    """A prompt that killed the worker at every delivery (max_deliveries 3) is not run a
    fourth time: it goes to the dead letters with its delivery count, and its client gets a
    500 saying so instead of waiting out its deadline."""
    entries = [_entry(0, [5, 6, 7])]
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, entries, delivered=3))
    [error] = outcome.replies["g.0"]
    assert isinstance(error, ErrorReply)
    assert (error.status, error.code) == (500, "dead_lettered")
    [letter] = outcome.dead
    assert letter.deliveries == 4 and letter.worker == NAME
    assert outcome.steps == 0 and outcome.left == 0


def test_a_generation_for_a_gateway_that_left_stops_at_once(
    redis_url: str, engine_and_tokenizer
) -> None:
    """A gateway that stops (or stops beating) has nobody left to read what a worker
    generates for it: the worker drops the sequence instead of running it to max_tokens
    (up to 600 s of a GPU per orphan, before)."""
    engine, tokenizer = engine_and_tokenizer
    settings = Settings(
        redis_url=redis_url, model=MODEL, heartbeat_interval_ms=100, read_block_ms=100
    )
    long = _entry(0, [5, 6, 7], max_tokens=400, stream=True)

    async def scenario() -> tuple[int, int, int]:
        store = open_store(settings)
        keys = streams.Keys(settings.prefix)
        stream = keys.request(MODEL, 128)
        try:
            await streams.ensure_groups(store, [stream])
            await streams.keep_alive(store, keys, REPLY, 60, int(time.time() * 1000))
            await streams.add_requests(store, [(stream, encode(long))])
            consumer, loops = _generation_worker(settings, store, engine, tokenizer)
            stop = asyncio.Event()
            worker = asyncio.ensure_future(consumer.run(stop))
            await eventually(lambda: loops and loops[0].steps_run >= 5, 20, "generating")
            await streams.gateway_left(store, keys, REPLY, int(time.time() * 1000))
            await eventually(lambda: not loops[0].busy, 10, "the sequence dropped")
            steps = loops[0].steps_run
            stop.set()
            await asyncio.wait_for(worker, 10)
            finals = [
                r
                for item in await streams.read_replies(
                    store, REPLY, "0-0", count=1000, block_ms=None
                )
                if (r := decode(item.payload or b"")).finish_reason
            ]
            return steps, len(finals), await store.xlen(stream)
        finally:
            await close_store(store)

    steps, finals, left = asyncio.run(scenario())
    assert steps < 300, f"{steps} steps for a gateway that had left"
    assert finals == 0 and left == 0  # never finished; acked all the same


class _Broken:
    """A grammar whose mask raises, as a bug in one sequence's own processing would."""

    def mask(self, row) -> None:
        raise RuntimeError("this sequence's mask failed")

    def accept(self, token: int) -> None:
        return None

    def finished(self) -> bool:
        return False


def test_a_sequence_whose_own_sampling_fails_fails_alone_and_the_worker_goes_on(
    redis_url: str, engine_and_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.generate import loop as generation_loop
    from worker.generate.sampling import Sampling

    real_of = Sampling.of

    def of(entry, eos_ids, choice=0, constraint=None):  # type: ignore[no-untyped-def]
        broken = _Broken() if entry.id == "g.1" else constraint
        return real_of(entry, eos_ids, choice, broken)

    monkeypatch.setattr(generation_loop.Sampling, "of", staticmethod(of))
    good = [_entry(0, [5, 6, 7]), _entry(2, [8, 9, 10], n=2, temperature=0.8, seed=3)]
    bad = _entry(1, [5, 6, 7], n=2)  # both its choices share the broken grammar
    outcome = asyncio.run(_burst(redis_url, engine_and_tokenizer, [good[0], bad, good[1]]))
    [failed] = outcome.replies["g.1"]  # one answer for the entry, not one per choice
    assert isinstance(failed, ErrorReply) and (failed.status, failed.code) == (
        500,
        "inference_failed",
    )
    assert "this sequence's mask failed" in failed.message
    for entry in good:  # batch-mates of its step generate on, to their end
        finals = [r for r in outcome.replies[entry.id] if isinstance(r, GenerationChunk)]
        assert len(finals) == entry.n and all(c.completion_tokens == 6 for c in finals)
    assert outcome.left == 0 and outcome.dead == []  # answered and acked, not dead-lettered
