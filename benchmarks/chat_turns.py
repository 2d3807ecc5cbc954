"""Multi-turn chat: what the prefix cache buys, side by side in one run.

    .venv/bin/python benchmarks/generation.py --workload chat            # 16 x 6 turns
    .venv/bin/python benchmarks/generation.py --workload chat --shape tiny --conversations 4

The workload (fixed seed): conversations sharing one 512-token system prompt; each turn adds
a user message of 20-60 tokens and asks for a reply of 32-64 tokens (generated to length);
a conversation sends its next turn, its whole history (every earlier reply's token ids as
generated) plus the new message, as soon as the previous answer arrives. Arms:
  (e) microbatch, prefix caching on (the default);
  (f) microbatch, prefix caching off;
  (g) transformers' continuous batching, each turn added when the previous one finished;
  (h) microbatch, prefix caching on, two workers sharing the streams (no affinity routing).
Printed: generated tokens/s over the run, TTFT p50/p99 per turn index, the prompt-token hit
rate on turns >= 2 (usage.prompt_tokens_details.cached_tokens over prompt_tokens), and the
ratios judged: TTFT p50 on turns >= 2, off over on (goal 4x); tokens/s, on over off (2x).
  (i) the same as (h) with cache-aware routing off: each turn goes to whichever worker
      reads it first.
For the two-worker arms it also prints how often (sampled every 0.25 s) one worker ran
nothing while the other ran more than `affinity_max_imbalance` sequences.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.gen_server import completion_events, microbatch_server


@dataclass(frozen=True, slots=True)
class Chat:
    system: list[int]
    users: list[list[list[int]]]  # per conversation, per turn: the user message
    replies: list[list[int]]  # per conversation, per turn: tokens to generate


def chat_workload(conversations: int, turns: int, vocab: int, seed: int = 0) -> Chat:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, 512).tolist()
    users = [
        [rng.integers(3, vocab, int(rng.integers(20, 61))).tolist() for _ in range(turns)]
        for _ in range(conversations)
    ]
    replies = [[int(x) for x in rng.integers(32, 65, turns)] for _ in range(conversations)]
    return Chat(system, users, replies)


@dataclass(slots=True)
class Turn:
    conversation: int
    index: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    generated: int


def report(name: str, turns: list[Turn], span_s: float) -> dict:
    by_turn: dict[int, list[float]] = {}
    for t in turns:
        by_turn.setdefault(t.index, []).append(t.ttft_s * 1000)
    later = [t for t in turns if t.index >= 1]
    prompt = sum(t.prompt_tokens for t in later)
    return {
        "arm": name,
        "tokens_per_s": sum(t.generated for t in turns) / span_s,
        "ttft_p50_ms_by_turn": {i + 1: float(np.median(v)) for i, v in sorted(by_turn.items())},
        "ttft_p99_ms_by_turn": {
            i + 1: float(np.percentile(v, 99)) for i, v in sorted(by_turn.items())
        },
        "ttft_p50_ms_later": float(np.median([t.ttft_s * 1000 for t in later])),
        "ttft_p99_ms_later": float(np.percentile([t.ttft_s * 1000 for t in later], 99)),
        "hit_rate_later": sum(t.cached_tokens for t in later) / prompt if prompt else 0.0,
        "span_s": span_s,
    }


async def _conversation(client, chat: Chat, c: int, out: list[Turn]) -> None:
    history = list(chat.system)
    for i, (user, n) in enumerate(zip(chat.users[c], chat.replies[c], strict=True)):
        history += user
        body = {
            "prompt": history,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        sent, first, ids, usage = time.perf_counter(), None, [], {}
        async for event in completion_events(client, body):
            for choice in event.get("choices", []):
                ids += choice.get("token_ids") or []
                first = first or time.perf_counter()
            usage = event.get("usage") or usage
        if len(ids) != n:
            raise RuntimeError(f"asked for {n} tokens, got {len(ids)}")
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        out.append(Turn(c, i, first - sent, usage["prompt_tokens"], cached, n))
        history += ids


def arm_microbatch(path: Path, chat: Chat, log_dir: Path, name: str, **settings) -> dict:
    import httpx

    urls: list[str] = []
    with microbatch_server(path, log_dir, metrics=urls, **settings) as base:

        async def run() -> tuple[list[Turn], float, list[list[float]]]:
            turns: list[Turn] = []
            samples: list[list[float]] = []
            async with httpx.AsyncClient(base_url=base, timeout=1200) as client:
                t0 = time.perf_counter()
                sampler = asyncio.create_task(_sample_running(client, urls, samples))
                await asyncio.gather(
                    *(_conversation(client, chat, c, turns) for c in range(len(chat.users)))
                )
                sampler.cancel()
                return turns, time.perf_counter() - t0, samples

        turns, span, samples = asyncio.run(run())
    row = report(name, turns, span)
    if len(urls) > 1:  # one worker idle while another holds more than the bound
        bound = int(settings.get("affinity_max_imbalance", 4))
        lopsided = sum(1 for s in samples if min(s) == 0 and max(s) > bound)
        row["idle_beside_backlog"] = lopsided / max(1, len(samples))
    return row


async def _sample_running(client, urls: list[str], samples: list[list[float]]) -> None:
    """Every 0.25 s, each worker's running sequences (its gauge)."""
    while True:
        await asyncio.sleep(0.25)
        row = []
        for url in urls:
            text = (await client.get(url)).text
            row.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("microbatch_running_sequences{")
                )
            )
        samples.append(row)


def arm_transformers_cb(model, chat: Chat) -> dict:
    """transformers' continuous batching (its own paged cache, no prefix reuse across
    requests), each conversation's next turn added when its previous one finished."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    histories = [list(chat.system) for _ in chat.users]
    pending: dict[str, tuple[int, int, float, int]] = {}
    turns: list[Turn] = []

    def send(c: int, i: int) -> None:
        histories[c] += chat.users[c][i]
        n = chat.replies[c][i]
        rid = manager.add_request(list(histories[c]), max_new_tokens=n, record_timestamps=True)
        pending[rid] = (c, i, time.perf_counter(), len(histories[c]))

    warm = manager.add_request(chat.system[:16], max_new_tokens=2)  # its start-up, untimed
    while (out := manager.get_result(timeout=600)) is not None and out.request_id != warm:
        pass
    t0 = time.perf_counter()
    for c in range(len(chat.users)):
        send(c, 0)
    while pending:
        out = manager.get_result(timeout=600)
        if out is None:
            raise RuntimeError("transformers' continuous batching stopped answering")
        c, i, sent, prompt = pending.pop(out.request_id)
        turns.append(Turn(c, i, out.timestamps[0] - sent, prompt, 0, len(out.generated_tokens)))
        histories[c] += list(out.generated_tokens)
        if i + 1 < len(chat.users[c]):
            send(c, i + 1)
    span = time.perf_counter() - t0
    manager.stop(block=True)
    return report("(g) transformers continuous batching", turns, span)


def print_chat(rows: list[dict], chat: Chat) -> None:
    turns = len(chat.users[0])
    print(
        f"{len(chat.users)} conversations x {turns} turns, system prompt {len(chat.system)} "
        f"tokens, {sum(map(sum, chat.replies))} reply tokens"
    )
    header = "".join(f"  turn {i + 1:>2}" for i in range(turns))
    print(f"{'TTFT p50 ms':42s}{header}")
    for row in rows:
        cells = "".join(f"{row['ttft_p50_ms_by_turn'][i + 1]:9.0f}" for i in range(turns))
        print(f"{row['arm']:42s}{cells}")
    for row in rows:
        idle = row.get("idle_beside_backlog")
        print(
            f"{row['arm']:42s} {row['tokens_per_s']:7.1f} tok/s  turns>=2: TTFT p50 "
            f"{row['ttft_p50_ms_later']:7.0f} ms p99 {row['ttft_p99_ms_later']:7.0f} ms  "
            f"hit rate {row['hit_rate_later']:.0%}"
            + ("" if idle is None else f"  idle beside a backlog {idle:.0%} of samples")
        )
    by = {r["arm"][:3]: r for r in rows}
    if "(e)" in by and "(f)" in by:
        on, off = by["(e)"], by["(f)"]
        ttft = off["ttft_p50_ms_later"] / on["ttft_p50_ms_later"]
        rate = on["tokens_per_s"] / off["tokens_per_s"]
        print(f"TTFT p50 turns>=2, caching off/on: {ttft:.2f}x (goal 4x)")
        print(f"tokens/s, caching on/off: {rate:.2f}x (goal 2x)")
    if "(e)" in by and "(g)" in by:
        print(f"tokens/s, (e)/(g): {by['(e)']['tokens_per_s'] / by['(g)']['tokens_per_s']:.2f}x")
    print(json.dumps(rows))
