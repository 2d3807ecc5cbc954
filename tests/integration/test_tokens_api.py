"""`/tokenize`, `/detokenize` and `GET /v1/models/{id}` against a real gateway serving two
model kinds: the `noop` encoder (the default model's tokenizer) and the tiny causal LM."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from tests.conftest import Processes, RedisServer, wait_ready

pytestmark = pytest.mark.process  # a module-scoped deployment of processes
TEXT = "Micro-batching keeps the hardware busy."


@pytest.fixture(scope="module")
def base(module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    processes = Processes(tmp_path_factory.mktemp("tokens"))
    settings = {"redis_url": module_redis.url, "prefix": "mbtok"}
    try:
        processes.start("worker", model="noop", **settings)
        processes.start("worker", model=tiny_model, **settings)
        gateway = processes.start("gateway", model="noop", **settings)
        wait_ready(gateway, models=2)
        yield gateway.base_url
    finally:
        processes.stop_all()


def post(base: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=30)


def test_tokenize_uses_the_models_own_tokenizer_and_detokenize_inverts_it(base: str) -> None:
    from worker.models import default_model_path

    reference = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    reference.no_padding()  # its file pads to 128 for batches: one text has no padding
    answer = post(base, "/tokenize", model="noop", prompt=TEXT)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == reference.encode(TEXT).ids  # [CLS] ... [SEP]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    bare = post(base, "/tokenize", model="noop", prompt=TEXT, add_special_tokens=False).json()
    assert bare["tokens"] == reference.encode(TEXT, add_special_tokens=False).ids
    text = post(base, "/detokenize", model="noop", tokens=body["tokens"]).json()["prompt"]
    assert text == reference.decode(body["tokens"], skip_special_tokens=False)


def test_tokenize_renders_chat_messages_with_the_models_template(
    base: str, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sati"}]
    want = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    answer = post(base, "/tokenize", model=str(tiny_model), messages=messages)
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == want


def test_one_model_is_described_or_named_missing(base: str, tiny_model: Path) -> None:
    noop = httpx.get(f"{base}/v1/models/noop", timeout=10)
    assert noop.status_code == 200 and noop.json()["id"] == "noop"
    assert noop.json()["kind"] == "embedding"
    tiny = httpx.get(f"{base}/v1/models/{tiny_model}", timeout=10)
    assert tiny.status_code == 200 and tiny.json()["kind"] == "causal-lm"
    missing = httpx.get(f"{base}/v1/models/nope", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "noop"}, 422, "body"),
        (
            "/tokenize",
            {"model": "noop", "prompt": "a", "messages": [{"role": "user", "content": "a"}]},
            422,
            "body",
        ),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"model": "noop", "tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"model": "noop", "tokens": "abc"}, 422, "tokens"),
    ],
)
def test_bad_token_requests_are_refused_naming_the_field(
    base: str, path: str, body: dict, status: int, param: str
) -> None:
    answer = httpx.post(f"{base}{path}", json=body, timeout=10)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_model_is_served_under_the_names_given_to_it(
    redis_url: str, processes: Processes
) -> None:
    settings = {"redis_url": redis_url, "served_model_name": "mini,mini-alias"}
    processes.start("worker", model="noop", **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    for name in ("mini", "mini-alias"):
        answer = post(gateway.base_url, "/v1/embeddings", model=name, input="x")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name
    default = post(gateway.base_url, "/v1/embeddings", input="x")  # the gateway's default
    assert default.status_code == 200 and default.json()["model"] == "mini"
    assert post(gateway.base_url, "/v1/embeddings", model="noop", input="x").status_code == 404
    listed = httpx.get(f"{gateway.base_url}/v1/models", timeout=10).json()["data"]
    assert sorted(m["id"] for m in listed) == ["mini", "mini-alias"]
