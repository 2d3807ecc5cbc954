"""Sampling controls work end to end, each checked so that ignoring it would fail the test.

Real redis-server, gateway and worker serving the tiny random-weight Llama; the reference is
a plain greedy loop over transformers' own logits for the same model folder, the processor
applied as OpenAI and vLLM define it. The random model rarely repeats a token on its own, so
the penalty tests lean on one token with a logit bias first: its repeats are what the
penalties must push back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Processes, RedisServer
from tests.integration.test_generation import serve_tiny

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

PROMPT = np.random.default_rng(11).integers(3, 500, size=12).tolist()
LEAN = 8.0  # a logit bias on token 7 that makes plain greedy repeat it
Processor = Callable[["torch.Tensor", list[int]], "torch.Tensor"]  # noqa: F821


@pytest.fixture(scope="module")
def base(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    processes = Processes(tmp_path_factory.mktemp("sampling"))
    try:
        url, _, _ = serve_tiny(processes, redis_server.url, tiny_model, "mbsample")
        yield url
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def eos_of(model) -> int:
    return int(model.generation_config.eos_token_id)


def complete(base: str, **options) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{base}/v1/completions", json={**body, **options}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def tokens(base: str, **options) -> list[int]:
    return complete(base, **options)["token_ids"]


def reference_greedy(model, n: int, process: Processor) -> list[int]:
    """Greedy decoding over the model's full forward each step, `process` applied to the
    last logits; stops after EOS, as the server does."""
    import torch

    ids, out = list(PROMPT), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(process(logits, out).argmax())
        out.append(token)
        ids.append(token)
        if token == eos_of(model):
            break
    return out


def test_logit_bias_bans_a_token_and_forces_another(base: str) -> None:
    plain = tokens(base)
    banned = plain[0]
    without = tokens(base, logit_bias={str(banned): -100})
    assert banned not in without
    forced = tokens(base, logit_bias={"7": 100})
    assert forced == [7] * 16


def test_frequency_and_presence_penalties_match_a_reference(base: str, model) -> None:
    frequency, presence = 1.5, 0.5

    def penalize(logits, out):
        logits[7] += LEAN
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        return logits

    lean = {"logit_bias": {"7": LEAN}}
    penalized = tokens(base, **lean, frequency_penalty=frequency, presence_penalty=presence)
    assert penalized == reference_greedy(model, 16, penalize)
    assert penalized.count(7) < tokens(base, **lean).count(7)


def test_repetition_penalty_matches_a_reference(base: str, model) -> None:
    """transformers' rule (and vLLM's): over prompt and output tokens, a positive logit is
    divided by the penalty, a negative one multiplied."""
    penalty = 1.8

    def penalize(logits, out):
        logits[7] += LEAN
        seen = sorted(set(PROMPT) | set(out))
        values = logits[seen]
        logits[seen] = values.where(values < 0, values / penalty).where(
            values >= 0, values * penalty
        )
        return logits

    lean = {"logit_bias": {"7": LEAN}}
    penalized = tokens(base, **lean, repetition_penalty=penalty)
    assert penalized == reference_greedy(model, 16, penalize)
    assert penalized.count(7) < tokens(base, **lean).count(7)


def test_eos_ends_unless_ignored_and_not_before_min_tokens(base: str, model) -> None:
    towards_eos = {str(eos_of(model)): 100}
    ended = complete(base, logit_bias=towards_eos)
    assert ended["finish_reason"] == "stop" and ended["token_ids"] == [eos_of(model)]
    ignored = complete(base, logit_bias=towards_eos, ignore_eos=True)
    assert ignored["finish_reason"] == "length" and len(ignored["token_ids"]) == 16
    held = complete(base, logit_bias=towards_eos, min_tokens=5)
    assert held["finish_reason"] == "stop"
    assert len(held["token_ids"]) == 6 and eos_of(model) not in held["token_ids"][:5]


def test_a_stop_token_id_ends_generation_without_its_text(base: str) -> None:
    stopped = complete(base, logit_bias={"7": 100}, stop_token_ids=[7])
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == [7] and stopped["text"] == ""


def test_top_k_and_min_p_keep_only_the_likeliest_token_when_asked(base: str) -> None:
    greedy = tokens(base)
    sampled = {"temperature": 1.0, "seed": 5}
    assert tokens(base, **sampled) != greedy, "sampling gave the greedy text: no test"
    assert tokens(base, **sampled, top_k=1) == greedy
    assert tokens(base, **sampled, min_p=1.0) == greedy


@pytest.mark.parametrize(
    ("options", "status", "param"),
    [
        ({"logit_bias": {"seven": 1}}, 400, "logit_bias"),
        ({"logit_bias": {"²": 1}}, 400, "logit_bias"),  # a Unicode digit: int() raises on it
        ({"logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ({"logit_bias": {"7": 101}}, 400, "logit_bias"),
        ({"stop_token_ids": [100000]}, 400, "stop_token_ids"),
        ({"min_tokens": 17}, 400, "min_tokens"),
        ({"top_k": -2}, 422, "top_k"),
        ({"presence_penalty": 2.5}, 422, "presence_penalty"),
        ({"min_p": 1.5}, 422, "min_p"),
    ],
)
def test_an_option_out_of_range_is_refused_naming_it(
    base: str, options: dict, status: int, param: str
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, **options}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_options_at_the_edge_of_their_range_answer_and_leave_the_worker_serving(
    base: str,
) -> None:
    """A temperature or penalty of 5e-324 overflows the logits to inf (softmax: NaN). The
    Schemathesis fuzz found one such request killing the worker; each is an answer now, a
    tiny temperature the greedy one."""

    def complete(**options: object) -> httpx.Response:
        body = {"prompt": [5, 9, 30], "max_tokens": 6, "ignore_eos": True, **options}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=30)

    greedy = complete(temperature=0)
    assert greedy.status_code == 200, greedy.text
    tiny = complete(temperature=5e-324, seed=1)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    for options in (
        {"repetition_penalty": 5e-324, "temperature": 1.0, "seed": 2},
        {"repetition_penalty": 5e-324, "top_p": 5e-324, "temperature": 0.7, "seed": 3},
        {"temperature": 5e-324, "min_p": 1.0, "top_k": 1, "seed": 4},
    ):
        answer = complete(**options)
        assert answer.status_code == 200, (options, answer.text)
    assert (
        complete(temperature=0).json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    )
