"""What one generation entry asks of vLLM's engine, and what its streamed deltas mean here
(`worker/generate/vllm_options.py`): pure translation, tested without vLLM installed."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from common.protocol import GenerateEntry, pack_tokens
from common.response_format import WHITESPACE
from worker.generate.vllm_engine import kv_cache_bytes
from worker.generate.vllm_options import picks, prompt_scores, sampling_options, token_scores

pytestmark = pytest.mark.unit


@dataclass
class Lp:
    """vLLM's `Logprob`, as its outputs carry it."""

    logprob: float
    rank: int | None


def entry(**fields: object) -> GenerateEntry:
    base: dict = dict(
        id="g", request_id="r", model="m", tokens=pack_tokens([5, 6, 7, 8]), max_tokens=30,
        deadline_ms=1, priority=1, reply_to="s", enqueued_ms=0, temperature=0.0, top_p=1.0,
        seed=-1, stop=[], stream=False,
    )  # fmt: skip
    return GenerateEntry(**(base | fields))


def test_every_option_that_changes_the_output_reaches_vllm() -> None:
    every = entry(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=0.25, repetition_penalty=1.1, seed=11, min_tokens=3,
        stop_token_ids=pack_tokens([9, 10]), ignore_eos=True,
        bias_tokens=pack_tokens([3, 4]), bias_values=np.array([2.5, -100], "<f4").tobytes(),
        logprobs=3, prompt_logprobs=2, stop=["\n\n"],
    )  # fmt: skip
    assert sampling_options(every, choice=2, context=2048) == {
        "n": 1,
        "temperature": pytest.approx(0.7),
        "top_p": pytest.approx(0.9),
        "top_k": 40,
        "min_p": pytest.approx(0.05),
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": pytest.approx(1.1),
        "seed": 13,  # choice c of a seeded entry draws from seed + c, as the paged engine
        "max_tokens": 30,
        "min_tokens": 3,
        "stop_token_ids": [9, 10],
        "ignore_eos": True,
        "logit_bias": {3: 2.5, 4: -100.0},
        "logprobs": 3,
        "prompt_logprobs": 2,
        "detokenize": False,
    }  # stop strings are matched here, on the same detokenized text as the paged engine's


def test_defaults_ask_vllm_for_nothing_extra() -> None:
    options = sampling_options(entry(), choice=0, context=2048)
    assert options["seed"] is None and options["logit_bias"] is None
    assert options["logprobs"] is None and options["prompt_logprobs"] is None
    assert options["stop_token_ids"] == [] and "structured_json" not in options


def test_seed_zero_and_zero_alternatives_are_asked_for_not_dropped() -> None:
    # logprobs 0 is the chosen token's own score: what best_of ranks its candidates by
    options = sampling_options(entry(seed=0, logprobs=0, prompt_logprobs=0), 1, context=2048)
    assert (options["seed"], options["logprobs"], options["prompt_logprobs"]) == (1, 0, 0)


def test_logit_bias_ids_and_values_must_pair() -> None:
    unpaired = entry(bias_tokens=pack_tokens([3, 4]), bias_values=np.array([1], "<f4").tobytes())
    with pytest.raises(ValueError):
        sampling_options(unpaired, 0, context=2048)


def test_max_tokens_fits_the_context_and_a_scored_prompt_asks_for_one() -> None:
    assert sampling_options(entry(max_tokens=5000), 0, context=100)["max_tokens"] == 96
    assert sampling_options(entry(max_tokens=5000), 0, context=5)["max_tokens"] == 1
    # vLLM generates at least one token; `Sequence.advance` drops it for max_tokens 0
    assert sampling_options(entry(max_tokens=0), 0, context=100)["max_tokens"] == 1


def test_a_response_format_goes_as_the_schema_our_own_grammar_enforces() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    options = sampling_options(
        entry(response_format="json_schema", json_schema=json.dumps(schema)), 0, 2048
    )
    assert options["structured_json"] == schema | {"x-guidance": {"whitespace_pattern": WHITESPACE}}
    own = schema | {"x-guidance": {"whitespace_flexible": False}}  # a tool call's compact JSON
    options = sampling_options(
        entry(response_format="json_schema", json_schema=json.dumps(own)), 0, 2048
    )
    assert options["structured_json"] == own
    options = sampling_options(entry(response_format="json_object"), 0, 2048)
    assert options["structured_json"]["type"] == "object"


def test_a_deltas_tokens_carry_their_scores_ranked_and_the_first_its_prompts() -> None:
    # the second token ranked 7th: vLLM adds it beside the top 2
    logprobs = [
        {4: Lp(-0.1, 1), 9: Lp(-2.5, 2)},
        {8: Lp(-0.3, 1), 2: Lp(-1.0, 2), 6: Lp(-4.0, 7)},
    ]
    prompt = [
        None,
        {6: Lp(-3.0, 5), 1: Lp(-0.2, 1), 2: Lp(-1.2, 2)},
        {7: Lp(-0.5, 1), 3: Lp(-2.0, 2)},
    ]
    got = picks([4, 6], logprobs, 2, first=True, cached=16, prompt=([5, 6, 7], prompt), prompt_k=2)
    assert [p.token for p in got] == [4, 6]
    assert got[0].cached == 16 and got[1].cached == -1
    assert got[1].prompt is None
    first, second = got[0].scores, got[1].scores
    assert first is not None and second is not None
    assert first.logprobs.tolist() == pytest.approx([-0.1])
    assert first.top_ids.tolist() == [[4, 9]]
    assert second.logprobs.tolist() == pytest.approx([-4.0])
    assert second.top_ids.tolist() == [[8, 2]]
    assert second.top_logprobs[0].tolist() == pytest.approx([-0.3, -1.0])
    assert first.logprobs.dtype == np.float32 and first.top_logprobs.dtype == np.float32
    assert first.top_ids.dtype == np.uint32
    scored = got[0].prompt
    assert scored is not None
    assert scored.top_ids.shape == (3, 2) and scored.top_logprobs.shape == (3, 2)
    assert scored.logprobs.dtype == scored.top_logprobs.dtype == np.float32
    assert scored.top_ids.dtype == np.uint32
    assert np.isnan(scored.logprobs[0]) and np.isnan(scored.top_logprobs[0]).all()
    assert scored.logprobs[1:].tolist() == pytest.approx([-3.0, -0.5])  # its own tokens 6, 7
    assert scored.top_ids[1:].tolist() == [[1, 2], [7, 3]]


def test_a_delta_without_scores_asked_or_given_carries_none() -> None:
    assert picks([4], None, 2)[0].scores is None  # asked, but vLLM gave none: no crash
    assert picks([4], [{4: Lp(-0.5, 1)}], 0)[0].scores is not None  # k 0: its own score
    assert picks([4], [{4: Lp(-0.5, 1)}], -1)[0].scores is None
    assert picks([4], None, -1, cached=8)[0].cached == -1  # only a request's first delta
    got = picks([4, 5, 6], None, -1)
    assert [(p.token, p.scores, p.prompt, p.cached) for p in got] == [
        (4, None, None, -1),
        (5, None, None, -1),
        (6, None, None, -1),
    ]


def test_scores_must_pair_with_their_tokens() -> None:
    with pytest.raises(ValueError):
        token_scores([4, 5], [{4: Lp(-0.5, 1)}], 1)


def test_a_one_token_prompt_has_only_its_empty_first_score() -> None:
    scored = prompt_scores([5], [None], 3)
    assert scored.logprobs.shape == (1,) and np.isnan(scored.logprobs[0])
    assert scored.top_ids.shape == (1, 3)


def test_the_kv_cache_is_sized_from_the_models_shape() -> None:
    smollm2 = {  # SmolLM2-135M: 30 layers, 3 KV heads of 64
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576,
    }  # fmt: skip
    assert kv_cache_bytes(smollm2, 1, "bfloat16") == 30 * 2 * 3 * 64 * 2
    assert kv_cache_bytes(smollm2, 1000, "fp8_e4m3") == 1000 * 30 * 2 * 3 * 64
    assert kv_cache_bytes(smollm2 | {"head_dim": 128}, 1, "float32") == 30 * 2 * 3 * 128 * 4
