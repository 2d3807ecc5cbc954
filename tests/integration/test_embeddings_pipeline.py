"""Embeddings end to end: real redis-server, real gateway and worker processes, the real model."""

from __future__ import annotations

import asyncio
import base64
import functools
import random
from collections import defaultdict
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.conftest import Processes, RedisServer, wait_ready
from worker.models import default_model_path

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

WORDS = [
    "batch",
    "queue",
    "token",
    "stream",
    "worker",
    "gateway",
    "model",
    "latency",
    "throughput",
    "padding",
    "mask",
    "vector",
    "redis",
    "embedding",
    "request",
    "reply",
    "deadline",
    "bucket",
    "consumer",
    "group",
    "cluster",
    "scale",
    "tensor",
]


@functools.cache
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def text_of(n_tokens: int, rng: random.Random) -> str:
    """A text of about `n_tokens` tokens ([CLS] and [SEP] included), never more."""
    tok = tokenizer()
    words = [rng.choice(WORDS) for _ in range(n_tokens)]
    while len(tok.encode(" ".join(words)).ids) > n_tokens:
        words.pop()
    return " ".join(words)


@pytest.fixture(scope="module")
def cluster(module_redis: RedisServer, tmp_path_factory) -> Iterator[Processes]:
    """One gateway and one worker process with the default model on a real Redis."""
    module_redis.flush()
    procs = Processes(tmp_path_factory.mktemp("cluster"))
    common = {"redis_url": module_redis.url, "max_wait_ms": 20}
    procs.start("worker", **common)
    gateway = procs.start("gateway", **common)
    wait_ready(gateway)
    yield procs
    procs.stop_all()


def gateway_url(procs: Processes) -> str:
    return next(p for p in procs.started if p.name in ("gateway", "serve")).base_url


async def post_all(
    url: str, bodies: list[dict], headers: dict | None = None
) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(
            *(client.post("/v1/embeddings", json=b, headers=headers) for b in bodies)
        )


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_mixed_lengths_sent_concurrently_equal_the_reference_encoded_alone(
    cluster: Processes, reference_model
) -> None:
    rng = random.Random(7)
    lengths = [5, 9, 17, 33, 60, 100, 127, 129, 180, 250, 256, 300, 400, 470, 500] * 2
    rng.shuffle(lengths)
    texts = [text_of(n, rng) for n in lengths]
    responses = asyncio.run(post_all(gateway_url(cluster), [{"input": t} for t in texts]))
    assert all(r.status_code == 200 for r in responses), [
        r.text for r in responses if r.status_code != 200
    ]
    shared = [int(r.headers["x-microbatch-batch-size"]) for r in responses]
    assert max(shared) > 1, "concurrent requests should have shared batches"
    for text, response in zip(texts, responses, strict=True):
        got = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
        alone = reference_model.encode([text], convert_to_numpy=True, normalize_embeddings=False)[0]
        assert cosine(got, alone) >= 0.99999, (
            len(tokenizer().encode(text).ids),
            cosine(got, alone),
        )


def test_sixty_four_concurrent_requests_batch_together_and_never_mix_buckets(
    cluster: Processes,
) -> None:
    rng = random.Random(11)
    lengths = [
        rng.choice([rng.randint(5, 120), rng.randint(140, 250), rng.randint(300, 500)])
        for _ in range(64)
    ]
    texts = [text_of(n, rng) for n in lengths]
    responses = asyncio.run(post_all(gateway_url(cluster), [{"input": t} for t in texts]))
    assert [r.status_code for r in responses] == [200] * 64
    members: dict[str, list[int]] = defaultdict(list)
    for text, r in zip(texts, responses, strict=True):
        n_tokens = r.json()["usage"]["prompt_tokens"]
        assert n_tokens == len(tokenizer().encode(text).ids)
        expected_bucket = next(b for b in (128, 256, 512) if n_tokens <= b)
        assert int(r.headers["x-microbatch-bucket"]) == expected_bucket
        members[r.headers["x-microbatch-batch-id"]].append(expected_bucket)
    sizes = [len(v) for v in members.values()]
    assert max(sizes) > 1
    assert all(len(set(buckets)) == 1 for buckets in members.values()), members


def test_every_input_form_gives_the_same_vectors_in_input_order(cluster: Processes) -> None:
    url = gateway_url(cluster)
    texts = ["the first text", "a second, rather longer text about queues"]
    ids = [tokenizer().encode(t).ids for t in texts]
    single = [
        httpx.post(f"{url}/v1/embeddings", json={"input": t}, timeout=60).json() for t in texts
    ]
    as_list = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).json()
    as_tokens = httpx.post(f"{url}/v1/embeddings", json={"input": ids}, timeout=60).json()
    one_token_list = httpx.post(f"{url}/v1/embeddings", json={"input": ids[1]}, timeout=60).json()
    as_b64 = httpx.post(
        f"{url}/v1/embeddings", json={"input": texts, "encoding_format": "base64"}, timeout=60
    ).json()
    expected = [np.array(s["data"][0]["embedding"]) for s in single]
    for body in (as_list, as_tokens):
        assert [d["index"] for d in body["data"]] == [0, 1]
        for want, got in zip(expected, body["data"], strict=True):
            assert cosine(want, np.array(got["embedding"])) >= 0.99999
    assert cosine(expected[1], np.array(one_token_list["data"][0]["embedding"])) >= 0.99999
    for want, got in zip(expected, as_b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(got["embedding"]), dtype="<f4")
        assert cosine(want, decoded) >= 0.99999
    assert as_list["object"] == "list" and as_list["model"] == "all-MiniLM-L6-v2"
    assert as_list["usage"]["prompt_tokens"] == sum(len(i) for i in ids)


def test_answers_carry_the_request_id_and_tuning_headers(cluster: Processes) -> None:
    r = httpx.post(
        f"{gateway_url(cluster)}/v1/embeddings",
        json={"input": "hello"},
        headers={"X-Request-ID": "trace-42", "X-Microbatch-Priority": "interactive"},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42"
    for header in ("batch-size", "bucket", "queue-ms", "compute-ms", "worker"):
        assert r.headers[f"x-microbatch-{header}"], header
    assert float(r.headers["x-microbatch-compute-ms"]) > 0


def test_the_official_openai_client_works_against_the_gateway(cluster: Processes, closing) -> None:
    from openai import OpenAI

    client = closing.enter_context(OpenAI(base_url=f"{gateway_url(cluster)}/v1", api_key="unused"))
    result = client.embeddings.create(model="all-MiniLM-L6-v2", input=["one", "two"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 384
    models = client.models.list()
    assert [m.id for m in models.data] == ["all-MiniLM-L6-v2"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"input": "word " * 600}, 413, "the limit for this model is 512"),
        ({"input": ""}, 400, "empty string"),
        ({"input": []}, 400, "empty list"),
        ({"input": [[]]}, 400, "empty token list"),
        ({"input": [[1, 2, 999999]]}, 400, "outside the vocabulary"),
        ({"input": 5}, 422, "input"),
        ({"input": ["a", 1]}, 422, "input"),
        ({}, 422, "input"),
        ({"input": "x", "model": "nope"}, 404, "'nope' is not served"),
        ({"input": "x", "encoding_format": "hex"}, 422, "encoding_format"),
        ({"input": "x", "dimensions": 12}, 400, "dimensions"),
    ],
)
def test_bad_input_gets_a_clear_openai_shaped_error(cluster: Processes, body, status, says) -> None:
    r = httpx.post(f"{gateway_url(cluster)}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_an_over_long_input_names_its_length_and_truncate_cuts_it(cluster: Processes) -> None:
    url = f"{gateway_url(cluster)}/v1/embeddings"
    text = "queue " * 700
    r = httpx.post(url, json={"input": text}, timeout=60)
    assert r.status_code == 413
    assert "702 tokens" in r.json()["error"]["message"]
    ok = httpx.post(url, json={"input": text, "truncate": True}, timeout=60)
    assert ok.status_code == 200
    assert ok.json()["usage"]["prompt_tokens"] == 512


def test_malformed_json_and_oversized_bodies_are_4xx(cluster: Processes) -> None:
    url = f"{gateway_url(cluster)}/v1/embeddings"
    bad = httpx.post(url, content=b'{"input": ', headers={"content-type": "application/json"})
    assert bad.status_code == 422
    assert "not valid JSON" in bad.json()["error"]["message"]
    huge = httpx.post(
        url, content=b"x" * (5 * 1024 * 1024), headers={"content-type": "application/json"}
    )
    assert huge.status_code == 413
    assert "4194304 bytes" in huge.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:
        for _ in range(80):
            yield b"y" * 65536

    chunked = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413


def test_health_readiness_models_and_metrics_routes(cluster: Processes) -> None:
    url = gateway_url(cluster)
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/readyz").json()
    assert ready["ready"] is True
    assert ready["models"]["all-MiniLM-L6-v2"]["live_workers"] == 1
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "all-MiniLM-L6-v2" and models["data"][0]["dim"] == 384
    metrics = httpx.get(f"{url}/metrics").text
    assert (
        'microbatch_requests_total{model="all-MiniLM-L6-v2",route="/v1/embeddings",status="200"}'
        in metrics
    )


def test_embedded_serve_returns_the_same_vectors_as_the_distributed_mode(
    cluster: Processes, processes: Processes
) -> None:
    texts = ["embedded and distributed agree", "word " * 300, "short"]
    serve = processes.start("serve", max_wait_ms=5)
    wait_ready(serve)
    embedded = httpx.post(f"{serve.base_url}/v1/embeddings", json={"input": texts}, timeout=60)
    distributed = httpx.post(
        f"{gateway_url(cluster)}/v1/embeddings", json={"input": texts}, timeout=60
    )
    assert embedded.status_code == distributed.status_code == 200
    for a, b in zip(embedded.json()["data"], distributed.json()["data"], strict=True):
        assert cosine(np.array(a["embedding"]), np.array(b["embedding"])) >= 0.99999
