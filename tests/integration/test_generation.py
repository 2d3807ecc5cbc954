"""Generation end to end: gateway → Redis → continuous-batching worker, the tiny causal LM.

Real redis-server, real `microbatch` processes, a random-weight Llama written by
`microbatch tiny-model`; the reference is transformers' own `generate()` on each prompt alone.
"""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.conftest import (
    Processes,
    RedisServer,
    eventually,
    free_port,
    wait_ready,
    wait_until,
)

pytestmark = pytest.mark.process  # a module-scoped deployment of processes


def serve_tiny(processes: Processes, redis_url: str, model: Path, prefix: str):
    """One worker (its metrics on a port) and one gateway serving the tiny model."""
    metrics_port = free_port()
    # float32, whatever the host: the tests hold answers to float32 generate() token for token
    settings = {"redis_url": redis_url, "model": model, "prefix": prefix, "dtype": "float32"}
    worker = processes.start("worker", metrics_port=metrics_port, **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    return gateway.base_url, f"http://127.0.0.1:{metrics_port}/metrics", worker


@pytest.fixture(scope="module")
def served(module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """Shared by the tests that leave the worker as they found it. Its own key prefix, and a
    worker that re-registers and recreates its groups, keep it serving through the flushes
    other tests make of the shared Redis."""
    processes = Processes(tmp_path_factory.mktemp("generation"))
    try:
        yield serve_tiny(processes, module_redis.url, tiny_model, "mbgen")
    finally:
        processes.stop_all()


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples whose line starts with `name` (0 before any is
    observed); a name the worker does not declare at all fails, so a renamed metric cannot
    pass an `== 0` or a `before`/`after` difference silently."""
    text = httpx.get(url, timeout=5).text
    family = re.sub(r"(_total|_count|_sum|_bucket)?(\{.*)?$", "", name)
    declared = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert family in declared or f"{family}_total" in declared, f"{name}: no such metric"
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def complete(client: httpx.AsyncClient, delay_s: float = 0.0, **body) -> dict:
    await asyncio.sleep(delay_s)
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(base: str, **body) -> list[dict | str]:
    events: list[dict | str] = []
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def reference_greedy(
    model_path: Path, prompts: list[list[int]], max_new: list[int]
) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    out = []
    for prompt, n in zip(prompts, max_new, strict=True):
        ids = torch.tensor([prompt])
        generated = model.generate(ids, max_new_tokens=n, do_sample=False)
        out.append(generated[0, len(prompt) :].tolist())
    return out


def test_greedy_outputs_of_staggered_concurrent_requests_match_generate_run_alone(
    served, tiny_model: Path
) -> None:
    base, metrics_url, _ = served
    rng = np.random.default_rng(3)
    lengths = [3, 9, 17, 30, 45, 64, 90, 120, 150, 200, 260, 330, 7, 55]
    prompts = [rng.integers(3, 500, size=n).tolist() for n in lengths]
    max_new = [int(m) for m in rng.integers(8, 60, size=len(prompts))]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            return await asyncio.gather(
                *(
                    complete(
                        client,
                        # arrive while earlier ones are generating: on a fast host (AMX) the
                        # tiny model finishes a request in tens of ms, so arrivals are close
                        delay_s=0.004 * i,
                        prompt=p,
                        max_tokens=n,
                        temperature=0,
                        return_token_ids=True,
                    )
                    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))
                )
            )

    steps_before = metric(metrics_url, 'microbatch_batch_size_count{bucket="decode"')
    tokens_before = metric(metrics_url, 'microbatch_batch_size_sum{bucket="decode"')
    answers = asyncio.run(run())
    expected = reference_greedy(tiny_model, prompts, max_new)
    for answer, want, prompt in zip(answers, expected, prompts, strict=True):
        choice = answer["choices"][0]
        assert choice["token_ids"] == want, f"prompt of {len(prompt)} tokens diverged"
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        assert answer["usage"]["completion_tokens"] == len(want)
    # Sequences shared decode steps: more tokens were generated than steps were run.
    steps = metric(metrics_url, 'microbatch_batch_size_count{bucket="decode"') - steps_before
    tokens = metric(metrics_url, 'microbatch_batch_size_sum{bucket="decode"') - tokens_before
    assert tokens / steps > 2, f"mean sequences per step {tokens / steps:.2f}: no batching"


def test_seeded_sampling_gives_the_same_text_whatever_the_batch_mates(served) -> None:
    base, _, _ = served
    body = {"prompt": "kalo mine rusa", "max_tokens": 40, "temperature": 0.9, "top_p": 0.95}
    alone = httpx.post(f"{base}/v1/completions", json={**body, "seed": 7}, timeout=60).json()

    async def crowded() -> list[dict]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            mates = [
                complete(client, prompt=f"sati vobe {i} " * (i + 1), max_tokens=50, temperature=1.0)
                for i in range(8)
            ]
            return await asyncio.gather(complete(client, 0.02, **body, seed=7), *mates)

    together = asyncio.run(crowded())[0]
    other_seed = httpx.post(f"{base}/v1/completions", json={**body, "seed": 8}, timeout=60).json()
    assert together["choices"][0]["text"] == alone["choices"][0]["text"]
    assert other_seed["choices"][0]["text"] != alone["choices"][0]["text"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "kalo mine rusa", "max_tokens": 30, "temperature": 0},
        {"prompt": "日本 语 한 🙂 and more", "max_tokens": 50, "temperature": 0.8, "seed": 1},
        {"prompt": [5, 6, 7, 8], "max_tokens": 60, "temperature": 0, "stop": ["a", "e"]},
    ],
)
def test_streamed_chunks_join_to_exactly_the_whole_text_and_done_ends_the_stream(
    served, body: dict
) -> None:
    base, _, _ = served
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    events = stream_events(base, **body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    if "stop" in body:
        assert whole["finish_reason"] == "stop" or not set("ae") & set(whole["text"])
        assert "a" not in whole["text"] and "e" not in whole["text"]


def test_a_stop_sequence_ends_generation_and_is_not_returned(served) -> None:
    base, _, _ = served
    body = {"prompt": "kalo mine rusa", "max_tokens": 30, "temperature": 0}
    free = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    stop = free["text"][5:8]  # a sequence the free run is known to produce
    cut = httpx.post(f"{base}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == free["text"][: free["text"].index(stop)]


def test_include_usage_adds_a_usage_event_before_done(served) -> None:
    base, _, _ = served
    events = stream_events(
        base, prompt="kalo", max_tokens=10, temperature=0, stream_options={"include_usage": True}
    )
    usage = events[-2]
    assert isinstance(usage, dict) and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 10


def test_a_client_that_disconnects_mid_stream_frees_its_slot(served) -> None:
    base, metrics_url, _ = served
    before = metric(metrics_url, "microbatch_generated_tokens_total")
    body = {"prompt": "kalo mine", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        for i, _line in enumerate(response.iter_lines()):
            if i >= 6:
                break  # leave after a few events: the connection closes here
    wait_until(
        lambda: metric(metrics_url, "microbatch_running_sequences"),
        5,
        "no running sequences",
        until=lambda n: n == 0,
    )
    generated = metric(metrics_url, "microbatch_generated_tokens_total") - before
    assert generated < 900, f"{generated} tokens generated for a client that left"
    assert metric(metrics_url, "microbatch_cancelled_total") >= 1


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"prompt": "x " * 600, "max_tokens": 500}, 400, r"\d+ tokens and max_tokens is 500"),
        ({"prompt": [5] * 1020, "max_tokens": 10}, 400, r"context of 1024"),
        ({"prompt": "hi", "n": 17}, 422, "n"),
        ({"prompt": "hi", "temperature": -1}, 422, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 422, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": "hi", "logprobs": 21}, 422, "logprobs"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": [[1, 2], [99999]]}, 400, "vocabulary"),
        ({"max_tokens": 5}, 422, "prompt"),
    ],
)
def test_bad_completion_requests_get_a_clear_4xx(
    served, body: dict, status: int, says: str
) -> None:
    base, _, _ = served
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert re.search(says, error["message"]) or says in (error.get("param") or ""), error


def test_embeddings_on_a_causal_lm_are_refused_with_a_pointer(served) -> None:
    base, _, _ = served
    response = httpx.post(f"{base}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert response.status_code == 400
    assert "/v1/completions" in response.json()["error"]["message"]


def test_chat_completions_render_the_models_own_template(served, tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, _, _ = served
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "kalo mine rusa?"},
    ]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = list(encoded["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert choice["token_ids"] == out[0, len(prompt) :].tolist()
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["refusal"] is None  # OpenAI's schema requires the key
    assert choice["message"]["content"] == tokenizer.decode(
        choice["token_ids"], skip_special_tokens=True
    )


def test_a_streamed_chat_names_the_role_first_and_joins_to_the_whole_answer(served) -> None:
    base, _, _ = served
    body = {"messages": [{"role": "user", "content": "sati"}], "max_tokens": 30, "temperature": 0}
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    events: list = []
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"messages": []}, 422, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            422,
            "tools",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
            400,
            "context of 1024",
        ),
    ],
)
def test_bad_chat_requests_get_a_clear_4xx(served, body: dict, status: int, says: str) -> None:
    base, _, _ = served
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert re.search(says, error["message"]) or says in (error.get("param") or ""), error


def test_the_worker_drains_running_generations_on_sigterm(
    redis_url: str, processes: Processes, tiny_model: Path
) -> None:
    base, metrics_url, worker = serve_tiny(processes, redis_url, tiny_model, "mb")

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            calls = [
                complete(client, prompt=f"ka {i}", max_tokens=200, temperature=0) for i in range(4)
            ]
            tasks = [asyncio.create_task(c) for c in calls]
            await eventually(
                lambda: metric(metrics_url, "microbatch_running_sequences"),
                30,
                "all four generating",
                until=lambda running: running >= 4,
            )
            worker.signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    answers = asyncio.run(run())
    assert all(a["choices"][0]["finish_reason"] in ("length", "stop") for a in answers)
    assert worker.wait(30) == 0


def test_sequences_preempted_for_the_kv_budget_finish_exactly_as_if_never_paused(
    redis_url: str, processes: Processes, tiny_model: Path
) -> None:
    """A KV budget for about two sequences and six at once: the newest are paused, later
    recomputed from prompt plus output, and the text is still generate()'s, token for token."""
    metrics_port = free_port()
    settings = {
        "redis_url": redis_url,
        "model": tiny_model,
        "kv_cache_tokens": 300,
        "dtype": "float32",  # the reference is float32 generate()
    }
    processes.start("worker", metrics_port=metrics_port, **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (20, 40, 60, 30, 50, 10)]
    max_new = [80, 60, 70, 90, 50, 100]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:
            return await asyncio.gather(
                *(
                    complete(client, prompt=p, max_tokens=n, temperature=0, return_token_ids=True)
                    for p, n in zip(prompts, max_new, strict=True)
                )
            )

    answers = asyncio.run(run())
    expected = reference_greedy(tiny_model, prompts, max_new)
    assert [a["choices"][0]["token_ids"] for a in answers] == expected
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    assert metric(metrics_url, "microbatch_preemptions_total") > 0


def test_a_chats_next_turn_is_served_from_the_prefix_cache_and_says_so(
    served, tiny_model: Path
) -> None:
    """The second turn carries the first's prompt and answer: its prefill reuses both, the
    usage reports them as OpenAI does (prompt_tokens_details.cached_tokens), the metrics
    count them, and the answer is still generate()'s."""
    base, metrics_url, _ = served
    system = list(range(100, 180))  # 80 tokens: five full blocks
    first = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": system, "max_tokens": 20, "temperature": 0, "return_token_ids": True},
        timeout=60,
    ).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] % 16 == 0
    hits_before = metric(metrics_url, "microbatch_prefix_cache_hit_tokens_total")
    history = [*system, *first["choices"][0]["token_ids"], 30, 31, 32]
    second = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": history, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
        timeout=60,
    ).json()
    answer = first["choices"][0]["token_ids"]
    computed = len(system) + len(answer) - 1  # the last answer token was never fed back
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed // 16 * 16
    hits = metric(metrics_url, "microbatch_prefix_cache_hit_tokens_total") - hits_before
    assert hits == computed // 16 * 16
    assert metric(metrics_url, "microbatch_prefix_cache_queried_tokens_total") >= len(history)
    assert second["choices"][0]["token_ids"] == reference_greedy(tiny_model, [history], [8])[0]


def test_a_generation_queue_admits_by_tokens_and_one_request_asks_for_a_bounded_number(
    redis_url: str, processes: Processes, tiny_model: Path
) -> None:
    limits = {"max_tokens_per_request": 700, "max_queued_tokens": 1500}
    settings = {"redis_url": redis_url, "model": tiny_model, **limits}
    processes.start("worker", **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    base = gateway.base_url
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    too_many = httpx.post(f"{base}/v1/completions", json={**body, "n": 3}, timeout=30)
    assert too_many.status_code == 400, too_many.text  # 3 x 304 tokens: past 700
    error = too_many.json()["error"]
    assert error["param"] == "max_tokens" and "max_tokens_per_request" in error["message"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            calls = [client.post("/v1/completions", json=body) for _ in range(10)]
            return await asyncio.gather(*calls)

    answers = asyncio.run(burst())  # 304 tokens each: four fit in 1,500, ten do not
    statuses = sorted(r.status_code for r in answers)
    assert 200 in statuses and 503 in statuses, statuses
    refused = next(r for r in answers if r.status_code == 503)
    assert "max_queued_tokens 1500" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert statuses.count(200) <= 5, statuses  # never far past the budget
