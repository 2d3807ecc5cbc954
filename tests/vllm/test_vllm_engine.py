"""`engine vllm`: vLLM's engine under the queue, through a real gateway and a real worker.

Collected only where vLLM is installed (tests/conftest.py, `collect_ignore`); run with
`pytest tests/vllm tests/integration/test_generation_faults.py` in that venv (docs/architecture.md).
One deployment for the module (vLLM's engine takes tens of seconds to start): redis-server,
a worker with `engine vllm` in float32, a paged-engine worker of the same model under another
name, and a gateway; clients no one here wrote (`openai`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import Processes, RedisServer, wait_ready, wait_until
from tests.integration.test_generation import metric
from worker.generate.tiny_model import TinyShape, write_tiny_model

pytestmark = pytest.mark.process

VLLM, OWN = "tiny-vllm", "tiny-own"
EOS_IGNORED = {"ignore_eos": True}  # vLLM's extension, which microbatch takes too
PROMPTS = ["kalo mine sati", "vobe ta", "ri nasu keli po", "mo"]


class Deployment:
    def __init__(self, base_url: str, metrics_url: str) -> None:
        self.base_url = base_url
        self.metrics_url = metrics_url
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def deployment(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    # vLLM's CPU attention takes head sizes of 32 and up: two heads of 64
    shape = TinyShape(hidden=128, heads=2, kv_heads=1, max_positions=2048)
    model = write_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-llama", shape)
    procs = Processes(tmp_path_factory.mktemp("vllm-procs"), cold=True)
    common = {"redis_url": module_redis.url, "model": model, "dtype": "float32"}
    from tests.conftest import free_port

    port = free_port()
    procs.start("worker", served_model_name=VLLM, engine="vllm", kv_cache_tokens=16_384,
                metrics_port=port, **common)  # fmt: skip
    procs.start("worker", served_model_name=OWN, **common)
    gateway = procs.start("gateway", **common)
    try:
        wait_ready(gateway, timeout=600, models=2)
        yield Deployment(gateway.base_url, f"http://127.0.0.1:{port}/metrics")
    finally:
        procs.stop_all()


def assert_engine_freed(deployment: Deployment) -> None:
    """The worker holds nothing within seconds (not the tens a 1,900-token answer takes),
    and answers the next request."""
    wait_until(
        lambda: metric(deployment.metrics_url, "microbatch_running_sequences"),
        10,
        "the worker holding nothing",
        until=lambda n: n == 0,
    )
    after = deployment.client.completions.create(model=VLLM, prompt="mo", max_tokens=4)
    assert after.choices[0].finish_reason in ("length", "stop")


def test_greedy_answers_are_the_paged_engines_token_for_token(deployment: Deployment) -> None:
    for prompt in PROMPTS:
        answers = [
            deployment.client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body=EOS_IGNORED
            )  # type: ignore[call-overload]
            for model in (VLLM, OWN)
        ]
        vllm, own = (a.choices[0] for a in answers)
        assert vllm.text == own.text, prompt
        assert vllm.finish_reason == own.finish_reason == "length"
        assert answers[0].usage == answers[1].usage


def test_scores_are_the_paged_engines(deployment: Deployment) -> None:
    asked = dict(prompt="kalo mine sati", max_tokens=6, temperature=0, logprobs=3, echo=True)
    vllm, own = (
        deployment.client.completions.create(model=m, **asked).choices[0]  # type: ignore[call-overload]
        for m in (VLLM, OWN)
    )
    assert vllm.logprobs is not None and own.logprobs is not None
    assert vllm.logprobs.tokens == own.logprobs.tokens
    assert vllm.logprobs.token_logprobs[0] is None  # the prompt's first token has none
    for a, b in zip(vllm.logprobs.token_logprobs[1:], own.logprobs.token_logprobs[1:], strict=True):
        assert a == pytest.approx(b, abs=1e-3)
    for a, b in zip(vllm.logprobs.top_logprobs[1:], own.logprobs.top_logprobs[1:], strict=True):
        assert a.keys() == b.keys()


def test_seeded_choices_repeat_and_differ_from_each_other(deployment: Deployment) -> None:
    asked = dict(
        model=VLLM,
        prompt="vobe ta",
        max_tokens=16,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body=EOS_IGNORED,
    )
    first = deployment.client.completions.create(**asked)  # type: ignore[call-overload]
    again = deployment.client.completions.create(**asked)  # type: ignore[call-overload]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3  # choice c draws from seed + c


def test_logit_bias_and_stop_sequences_are_honoured(deployment: Deployment) -> None:
    tokens = httpx.post(
        f"{deployment.base_url}/tokenize", json={"model": VLLM, "prompt": " sati"}, timeout=10
    ).json()["tokens"]
    forced = deployment.client.completions.create(
        model=VLLM, prompt="mo", max_tokens=5, temperature=0, extra_body=EOS_IGNORED, logprobs=1,
        logit_bias={str(tokens[-1]): 100},
    )  # type: ignore[call-overload]  # fmt: skip
    scored = forced.choices[0].logprobs
    assert scored is not None and len(scored.tokens) == 5 and len(set(scored.tokens)) == 1
    assert forced.choices[0].text == scored.tokens[0] * 5
    free = deployment.client.completions.create(
        model=VLLM, prompt="mo", max_tokens=24, temperature=0, extra_body=EOS_IGNORED
    )  # type: ignore[call-overload]
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = deployment.client.completions.create(
        model=VLLM, prompt="mo", max_tokens=24, temperature=0, extra_body=EOS_IGNORED, stop=[stop]
    )  # type: ignore[call-overload]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_a_json_schema_is_enforced_by_vllms_guidance_backend(deployment: Deployment) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # compact, as a tool call's arguments
    }
    for seed in range(5):
        answer = deployment.client.chat.completions.create(
            model=VLLM, messages=[{"role": "user", "content": "answer"}], max_tokens=64,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )  # fmt: skip
        value = json.loads(answer.choices[0].message.content or "")
        assert (
            set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
        )


def test_a_streamed_chat_of_two_choices_ends_each_once(deployment: Deployment) -> None:
    finished: dict[int, str] = {}
    text = {0: "", 1: ""}
    for chunk in deployment.client.chat.completions.create(
        model=VLLM, messages=[{"role": "user", "content": "hi"}], max_tokens=12, n=2, seed=3,
        temperature=1.0, stream=True,
    ):  # fmt: skip
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert choice.index not in finished
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1}
    assert all(text.values())


def test_a_passed_deadline_is_a_504_and_frees_the_engine(deployment: Deployment) -> None:
    started = time.monotonic()
    late = httpx.post(
        f"{deployment.base_url}/v1/completions",
        json={"model": VLLM, "prompt": "mo", "max_tokens": 1900, "ignore_eos": True},
        headers={"x-microbatch-timeout-ms": "1500"},
        timeout=30,
    )
    assert late.status_code == 504, late.text
    assert time.monotonic() - started < 10
    assert_engine_freed(deployment)


def test_a_client_that_leaves_mid_stream_frees_the_engine(deployment: Deployment) -> None:
    body = {"model": VLLM, "prompt": "mo", "max_tokens": 1900, "stream": True, **EOS_IGNORED}
    with (
        httpx.Client(base_url=deployment.base_url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line) >= 3
    # the gateway marks the request cancelled; the worker cancels the choice, which aborts
    # its vLLM request
    assert_engine_freed(deployment)


def test_best_of_returns_the_likeliest_candidates(deployment: Deployment) -> None:
    asked = dict(model=VLLM, prompt="vobe ta", max_tokens=8, temperature=1.0, seed=5, n=3)
    candidates = deployment.client.completions.create(**asked, logprobs=0)  # type: ignore[call-overload]
    best = deployment.client.completions.create(**asked | {"n": 1}, best_of=3)  # type: ignore[call-overload]

    def total(choice: object) -> float:
        return sum(choice.logprobs.token_logprobs)  # type: ignore[attr-defined]

    likeliest = max(candidates.choices, key=total)
    assert [c.text for c in best.choices] == [likeliest.text]


def test_vllms_own_figures_reach_the_workers_metrics(deployment: Deployment) -> None:
    prompt = "kalo mine sati vobe ta ri nasu keli po " * 12  # several whole blocks
    for _ in range(2):  # the second finds the first's blocks in vLLM's prefix cache
        deployment.client.completions.create(model=VLLM, prompt=prompt, max_tokens=2)
    queried = metric(deployment.metrics_url, "microbatch_prefix_cache_queried_tokens_total")
    hits = metric(deployment.metrics_url, "microbatch_prefix_cache_hit_tokens_total")
    assert queried > 0 and hits > 0, (queried, hits)
