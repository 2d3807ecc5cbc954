"""Log probabilities, echo, scoring, n and best_of, end to end against a real server.

Real redis-server, gateway and worker serving the tiny random-weight Llama; the reference
for every log probability is a plain transformers forward over the same folder: the prompt
and what the server generated, `log_softmax` of its logits in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Processes, RedisServer
from tests.integration.test_generation import metric, serve_tiny

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

PROMPT = np.random.default_rng(5).integers(3, 500, size=10).tolist()
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    processes = Processes(tmp_path_factory.mktemp("logprobs"))
    try:
        url, metrics_url, _ = serve_tiny(processes, redis_server.url, tiny_model, "mblogp")
        yield url, metrics_url
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """Log-softmax at every position of a plain forward over `ids`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1).numpy()

    return logprobs


def post(base: str, route: str, **body) -> dict:
    response = httpx.post(f"{base}{route}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_logprobs_with_echo_equal_a_plain_forward(
    server, reference, tiny_model: Path
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    base, _ = server
    body = post(
        base,
        "/v1/completions",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        echo=True,
        return_token_ids=True,
        ignore_eos=True,
    )
    choice = body["choices"][0]
    generated = choice["token_ids"]
    logprobs = choice["logprobs"]
    ids = PROMPT + generated
    expected = reference(ids)  # position i scores token i + 1
    assert len(logprobs["token_logprobs"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        chosen = expected[i - 1, ids[i]]
        assert abs(logprobs["token_logprobs"][i] - chosen) < TOLERANCE, i
        # the chosen token and the 3 likeliest (fewer where two decode to the same text)
        top3_ids = np.argsort(expected[i - 1])[::-1][:3]
        top3 = expected[i - 1][top3_ids]
        values = list(logprobs["top_logprobs"][i].values())
        assert 2 <= len(values) <= 4
        for value in values:
            assert abs(value - chosen) < TOLERANCE or np.isclose(value, top3, atol=TOLERANCE).any()
        # and by token: each key is the text of the chosen token or of one of the 3 likeliest
        texts = {tokenizer.decode([int(t)], skip_special_tokens=False) for t in [*top3_ids, ids[i]]}
        assert set(logprobs["top_logprobs"][i]) <= texts, i
    # greedy: every generated token is its position's likeliest
    for i in range(len(PROMPT), len(ids)):
        assert logprobs["token_logprobs"][i] == max(logprobs["top_logprobs"][i].values())
    echoed = httpx.post(f"{base}/detokenize", json={"tokens": PROMPT}, timeout=30).json()
    assert choice["text"].startswith(echoed["prompt"])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_max_tokens_zero_with_echo_scores_the_prompt_without_generating(server, reference) -> None:
    base, _ = server
    body = post(
        base, "/v1/completions", prompt="kalo mine rusa", max_tokens=0, echo=True, logprobs=0
    )
    choice = body["choices"][0]
    assert choice["text"] == "kalo mine rusa"
    assert body["usage"]["completion_tokens"] == 0
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "kalo mine rusa"}, timeout=30).json()[
        "tokens"
    ]
    expected = reference(ids)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert np.allclose(got[1:], [expected[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-4)


def test_chat_logprobs_and_top_logprobs_equal_a_plain_forward(
    server, reference, tiny_model: Path
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    base, _ = server
    messages = [{"role": "user", "content": "kalo mine rusa?"}]
    body = post(
        base,
        "/v1/chat/completions",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        return_token_ids=True,
        ignore_eos=True,
    )
    choice = body["choices"][0]
    prompt = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=30).json()[
        "tokens"
    ]
    ids = prompt + choice["token_ids"]
    expected = reference(ids)
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None and len(content) == 6
    for j, token in enumerate(content):
        i = len(prompt) + j
        assert abs(token["logprob"] - expected[i - 1, ids[i]]) < TOLERANCE
        assert token["bytes"] == list(token["token"].encode())
        alternatives = [t["logprob"] for t in token["top_logprobs"]]
        likeliest = np.argsort(expected[i - 1])[::-1][:2]
        assert np.allclose(alternatives, expected[i - 1][likeliest], atol=TOLERANCE)
        # and by token, not by value only: each alternative is that token, decoded alone
        pieces = [tokenizer.decode([int(t)], skip_special_tokens=False) for t in likeliest]
        assert [t["token"] for t in token["top_logprobs"]] == pieces


def _events(base: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{route}", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[6:]) for line in lines]


def test_streamed_logprobs_add_up_to_the_whole_answers(server) -> None:
    base, _ = server
    body = {
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
    }
    whole = post(base, "/v1/completions", **body)["choices"][0]
    events = _events(base, "/v1/completions", {**body, "stream": True})
    text = "".join(e["choices"][0]["text"] for e in events)
    streamed = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for event in events:
        for key, values in event["choices"][0]["logprobs"].items():
            streamed[key] += values
    assert text == whole["text"]
    assert streamed == whole["logprobs"]


def test_n_choices_share_one_prefill_and_a_seed_reproduces_the_set(server) -> None:
    base, metrics_url = server
    prompt = np.random.default_rng(8).integers(3, 500, size=40).tolist()
    before = metric(metrics_url, "microbatch_prefill_tokens_total")
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "n": 4, "seed": 3}
    first = post(base, "/v1/completions", **body)
    prefilled = metric(metrics_url, "microbatch_prefill_tokens_total") - before
    assert prefilled == len(prompt), f"{prefilled} prompt tokens prefilled for one shared prompt"
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) > 1, texts  # four draws, not one copied
    assert [c["text"] for c in post(base, "/v1/completions", **body)["choices"]] == texts
    assert first["usage"]["prompt_tokens"] == len(prompt)


def test_n_over_several_prompts_is_indexed_prompt_major_and_streams(server) -> None:
    base, _ = server
    body = {"prompt": ["kalo", "mine ru"], "max_tokens": 4, "temperature": 0.8, "n": 2}
    whole = post(base, "/v1/completions", **body, seed=1)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    events = _events(base, "/v1/completions", {**body, "seed": 1, "stream": True})
    streamed: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert streamed == {c["index"]: c["text"] for c in whole["choices"]}


def test_best_of_returns_the_likeliest_candidates(server) -> None:
    base, _ = server
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    candidates = post(base, "/v1/completions", **body, n=5, logprobs=0)["choices"]
    totals = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in candidates}
    best = post(base, "/v1/completions", **body, n=2, best_of=5)["choices"]
    assert [c["index"] for c in best] == [0, 1]
    assert all(c["logprobs"] is None for c in best)  # asked for none: none shown
    expected = sorted(totals, key=totals.get, reverse=True)[:2]
    assert [c["text"] for c in best] == expected


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "echo"),
        ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3, "stream": True}, "streamed"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "logprobs",
        ),
    ],
)
def test_impossible_scoring_options_get_a_clear_4xx(server, route, body, says) -> None:
    base, _ = server
    response = httpx.post(f"{base}{route}", json=body, timeout=30)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert says in error["message"] or says in (error.get("param") or ""), error


def test_openais_client_reads_logprobs_echo_and_choices(server, closing) -> None:
    from openai import OpenAI

    base, _ = server
    client = closing.enter_context(OpenAI(base_url=f"{base}/v1", api_key="unused"))
    model = client.models.list().data[0].id
    scored = client.completions.create(
        model=model, prompt=[PROMPT], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == len(PROMPT) + 1 and logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "kalo"}],
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    content = chat.choices[1].logprobs.content
    assert content and len(content[0].top_logprobs) == 2
