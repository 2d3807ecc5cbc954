"""Rerankers, classifiers and the TEI/Cohere/Jina routes against a real gateway serving three
models at once: a random-weight cross-encoder, a random-weight three-label classifier (both
written by `microbatch tiny-model`'s code), and the bundled MiniLM with sentence-transformers
prompts and matryoshka dimensions declared. Answers are checked against sentence-transformers
itself, and through clients no one here wrote (cohere, huggingface_hub, openai)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Processes, RedisServer, wait_ready

pytestmark = pytest.mark.process  # a module-scoped deployment of processes
QUERY = "where do micro-batches wait before a worker runs them"
DOCUMENTS = [
    "Entries wait on a Redis stream, one per length bucket, until a worker reads them.",
    "Bananas grow in the tropics.",
    "A worker pads each batch to its own longest member " * 12,
    "queue",
    "The gateway tokenizes each request and writes it, with its deadline, to the stream; "
    "workers read with consumer groups, so a crashed worker's entries are reclaimed.",
]
LABELS = ("negative", "neutral", "positive")
PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from worker.encode.tiny_classifier import write_tiny_classifier
    from worker.models import default_model_path

    root = tmp_path_factory.mktemp("encoders")
    reranker = write_tiny_classifier(root / "tiny-reranker")
    classifier = write_tiny_classifier(root / "tiny-classifier", LABELS, seed=1)
    # the bundled MiniLM, declaring prompts (a default one) and matryoshka dimensions
    embedder = root / "minilm-prompts"
    shutil.copytree(default_model_path(), embedder, ignore=shutil.ignore_patterns("*.safetensors"))
    (embedder / "model.safetensors").symlink_to(default_model_path() / "model.safetensors")
    st = {"prompts": PROMPTS, "default_prompt_name": "passage"}
    (embedder / "config_sentence_transformers.json").write_text(json.dumps(st))
    config = json.loads((embedder / "config.json").read_text())
    (embedder / "config.json").write_text(
        json.dumps({**config, "matryoshka_dimensions": [128, 256]})
    )
    return {"reranker": reranker, "classifier": classifier, "embedder": embedder}


@pytest.fixture(scope="module")
def bases(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, models):
    """Gateway URLs by default model: the embedder's (every model), the classifier's."""
    processes = Processes(tmp_path_factory.mktemp("rerank"))
    settings = {"redis_url": redis_server.url, "prefix": "mbrr", "max_wait_ms": 5}
    try:
        processes.start(
            "worker", model=models["reranker"], served_model_name="reranker", **settings
        )
        processes.start(
            "worker", model=models["classifier"], served_model_name="classifier", **settings
        )
        processes.start(
            "worker", model=models["embedder"], served_model_name="embedder", **settings
        )
        gateway = processes.start(
            "gateway", model="embedder", max_inputs_per_request=64, **settings
        )
        second = processes.start("gateway", model="classifier", **settings)
        wait_ready(gateway, models=3)
        wait_ready(second, models=3)
        yield {"embedder": gateway.base_url, "classifier": second.base_url}
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def base(bases) -> str:
    return bases["embedder"]


def post(base: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def logits_one_by_one(path: Path, texts: list[str]) -> np.ndarray:
    """transformers itself, one text at a time (sentence-transformers 6's CrossEncoder takes
    pairs only)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return np.concatenate(
            [model(**tokenizer(t, return_tensors="pt")).logits.numpy() for t in texts]
        )


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def cross_encoder(path: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu")


def test_models_lists_every_kind(base: str) -> None:
    data = {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}
    assert data["reranker"]["kind"] == "classifier" and data["reranker"]["labels"] == ["LABEL_0"]
    assert data["classifier"]["labels"] == list(LABELS)
    assert data["embedder"]["kind"] == "embedding" and data["embedder"]["matryoshka"] is True


def test_rerank_scores_equal_cross_encoder_predict_for_concurrent_mixed_lengths(
    base: str, models
) -> None:
    import torch

    ce = cross_encoder(models["reranker"])
    queries = [QUERY, "bananas", "how are entries reclaimed", "x"] * 2
    bodies = [
        {"model": "reranker", "query": q, "documents": DOCUMENTS[i % 5 :] + DOCUMENTS[: i % 5]}
        for i, q in enumerate(queries)
    ]

    async def send_all():
        async with httpx.AsyncClient(timeout=60) as client:
            calls = [client.post(f"{base}/v1/rerank", json=b) for b in bodies]
            calls += [
                client.post(f"{base}/v1/rerank", json={**b, "raw_scores": True}) for b in bodies
            ]
            return await asyncio.gather(*calls)

    answers = asyncio.run(send_all())
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    shared = {a.headers["X-Microbatch-Batch-Size"] for a in answers}
    assert max(int(s) for s in shared) > len(DOCUMENTS), "requests never shared a batch"
    for k, answer in enumerate(answers):
        body = bodies[k % len(bodies)]
        pairs = [(body["query"], d) for d in body["documents"]]
        if k < len(bodies):
            want = ce.predict(pairs)
        else:
            want = ce.predict(pairs, activation_fn=torch.nn.Identity())
        results = answer.json()["results"]
        got = np.zeros(len(pairs), dtype=np.float64)
        for r in results:
            got[r["index"]] = r["relevance_score"]
            assert r["document"]["text"] == body["documents"][r["index"]]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)


def test_top_n_and_document_objects(base: str) -> None:
    body = post(
        base,
        "/v1/rerank",
        model="reranker",
        query=QUERY,
        documents=[{"text": d} for d in DOCUMENTS],
        top_n=2,
        return_documents=False,
    ).json()
    assert len(body["results"]) == 2 and "document" not in body["results"][0]
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "reranker"


def test_tei_rerank_shape_on_the_shared_path(base: str) -> None:
    jina = post(base, "/rerank", model="reranker", query=QUERY, documents=DOCUMENTS).json()
    tei = post(base, "/rerank", model="reranker", query=QUERY, texts=DOCUMENTS, return_text=True)
    assert tei.status_code == 200, tei.text
    assert isinstance(tei.json(), list)
    assert [t["index"] for t in tei.json()] == [r["index"] for r in jina["results"]]
    for t in tei.json():
        assert t["text"] == DOCUMENTS[t["index"]]
    by_index = {r["index"]: r["relevance_score"] for r in jina["results"]}
    assert all(abs(t["score"] - by_index[t["index"]]) < 1e-6 for t in tei.json())


def test_cohere_client_reranks_unchanged(base: str, models) -> None:
    import cohere

    with httpx.Client(timeout=60) as http:
        client = cohere.ClientV2(api_key="unused", base_url=base, httpx_client=http)
        answer = client.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=3)
    want = cross_encoder(models["reranker"]).predict([(QUERY, d) for d in DOCUMENTS])
    assert [r.index for r in answer.results] == list(np.argsort(-want, kind="stable")[:3])
    for r in answer.results:
        assert abs(r.relevance_score - want[r.index]) < 1e-5


def test_classify_and_predict_follow_the_models_labels(base: str, models) -> None:
    ce = cross_encoder(models["classifier"])
    texts = ["this is wonderful", "a b c " * 30, "meh"]
    logits = logits_one_by_one(models["classifier"], texts)
    want = softmax(logits)
    body = post(base, "/classify", model="classifier", input=texts).json()
    got = np.array([d["probs"] for d in body["data"]])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert [d["label"] for d in body["data"]] == [LABELS[i] for i in want.argmax(1)]
    raw = post(base, "/classify", model="classifier", input=texts, activation=False).json()
    np.testing.assert_allclose([d["probs"] for d in raw["data"]], logits, atol=1e-5, rtol=0)
    # TEI: one text answers a flat list, best first; a [text, text] list is one pair
    one = post(base, "/predict", model="classifier", inputs=texts[0]).json()
    assert [p["label"] for p in one] == [LABELS[i] for i in np.argsort(-want[0])]
    pair = post(base, "/predict", model="classifier", inputs=["premise", "hypothesis"]).json()
    want_pair = ce.predict([("premise", "hypothesis")], apply_softmax=True)[0]
    assert abs(pair[0]["score"] - want_pair.max()) < 1e-5
    many = post(base, "/predict", model="classifier", inputs=texts, raw_scores=True).json()
    assert len(many) == 3 and abs(many[1][0]["score"] - logits[1].max()) < 1e-5


def test_huggingface_inference_client_on_the_tei_routes(base: str, bases, models) -> None:
    from huggingface_hub import InferenceClient
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(models["embedder"]), device="cpu")
    vector = InferenceClient(model=f"{base}/embed").feature_extraction("hello there")
    want = reference.encode(["hello there"], prompt_name="passage", normalize_embeddings=True)
    np.testing.assert_allclose(np.asarray(vector).reshape(1, -1), want, atol=1e-5)
    root = InferenceClient(model=base).feature_extraction("hello there", prompt_name="query")
    want_q = reference.encode(["hello there"], prompt_name="query", normalize_embeddings=True)
    np.testing.assert_allclose(np.asarray(root).reshape(1, -1), want_q, atol=1e-5)
    # TEI serves one model: a gateway whose default model is the classifier, as TEI would
    classifier_base = bases["classifier"]
    labels = InferenceClient(model=f"{classifier_base}/predict").text_classification(
        "this is wonderful"
    )
    want_c = softmax(logits_one_by_one(models["classifier"], ["this is wonderful"]))
    top = labels[0] if isinstance(labels, list) else labels
    assert top.label == LABELS[int(want_c[0].argmax())]
    assert abs(top.score - float(want_c[0].max())) < 1e-5


def test_openai_embeddings_with_matryoshka_dimensions(base: str, models, closing) -> None:
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    client = closing.enter_context(OpenAI(base_url=f"{base}/v1", api_key="unused"))
    answer = client.embeddings.create(model="embedder", input=["a short text"], dimensions=128)
    reference = SentenceTransformer(str(models["embedder"]), device="cpu", truncate_dim=128)
    want = reference.encode(["a short text"], prompt_name="passage", normalize_embeddings=True)
    got = np.asarray(answer.data[0].embedding)
    assert got.shape == (128,)
    np.testing.assert_allclose(got, want[0], atol=1e-5)
    assert abs(np.linalg.norm(got) - 1) < 1e-5


def test_tei_tokenize_gives_spans(base: str) -> None:
    body = post(base, "/tokenize", inputs=["hello world"]).json()
    assert [t["id"] for t in body[0]] == [101, 7592, 2088, 102]
    assert body[0][0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert body[0][2] == {"id": 2088, "text": "world", "special": False, "start": 6, "stop": 11}
    prompted = post(base, "/tokenize", inputs="hi", prompt_name="query", add_special_tokens=False)
    assert [t["text"] for t in prompted.json()[0]] == ["query", ":", "hi"]


def test_truncation_direction_and_decode(base: str) -> None:
    long = " ".join(f"w{i}" for i in range(600))
    left = post(base, "/embed", inputs=long, truncate=True, truncation_direction="left")
    right = post(base, "/embed", inputs=long, truncate=True, truncation_direction="right")
    assert left.status_code == right.status_code == 200, left.text
    assert not np.allclose(left.json()[0], right.json()[0])
    text = post(base, "/decode", ids=[101, 7592, 2088, 102]).json()
    assert text == ["hello world"]
    kept = post(base, "/decode", ids=[[101, 7592, 102]], skip_special_tokens=False).json()
    assert kept == ["[CLS] hello [SEP]"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/rerank", {"model": "reranker", "query": QUERY, "documents": []}, 400, "documents"),
        (
            "/v1/rerank",
            {"model": "reranker", "query": QUERY, "documents": ["d"] * 65},
            400,
            "documents",
        ),
        (
            "/v1/rerank",
            {"model": "reranker", "query": QUERY, "documents": ["", "d"]},
            400,
            "documents[0]",
        ),
        (
            "/v1/rerank",
            {"model": "reranker", "query": QUERY, "documents": ["w " * 600]},
            413,
            "documents[0]",
        ),
        (
            "/v1/rerank",
            {"model": "reranker", "query": "w " * 600, "documents": ["d"], "truncate": True},
            413,
            "query",
        ),
        ("/v1/rerank", {"model": "embedder", "query": QUERY, "documents": ["d"]}, 400, "model"),
        ("/v1/rerank", {"model": "classifier", "query": QUERY, "documents": ["d"]}, 400, "model"),
        (
            "/v2/rerank",
            {"model": "reranker", "query": QUERY, "documents": ["d"], "relevant_spans": True},
            400,
            "relevant_spans",
        ),
        ("/classify", {"model": "embedder", "input": "x"}, 400, "model"),
        ("/predict", {"model": "classifier", "inputs": []}, 400, "inputs"),
        ("/v1/embeddings", {"model": "reranker", "input": "x"}, 400, "model"),
        (
            "/v1/embeddings",
            {"model": "embedder", "input": "x", "dimensions": 100},
            400,
            "dimensions",
        ),
        (
            "/v1/embeddings",
            {"model": "embedder", "input": "x", "dimensions": 999},
            400,
            "dimensions",
        ),
        (
            "/v1/embeddings",
            {"model": "embedder", "input": "x", "normalize": False},
            400,
            "normalize",
        ),
        ("/embed", {"inputs": "x", "prompt_name": "nope"}, 400, "prompt_name"),
        ("/rerank", {"query": QUERY, "texts": ["d"]}, 400, "model"),  # two classifiers here
        ("/embed", {"inputs": "x", "encoding_format": "base64"}, 422, "encoding_format"),
        (
            "/classify",
            {"model": "classifier", "input": "x", "truncate_prompt_tokens": 3},
            422,
            "truncate_prompt_tokens",
        ),
    ],
)
def test_bad_input_is_a_clear_4xx(base: str, path: str, body: dict, status: int, param: str):
    answer = post(base, path, **body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"]


def test_the_rerank_routes_truncate_when_asked(base: str) -> None:
    long = "w " * 600
    jina = post(base, "/v1/rerank", model="reranker", query=QUERY, documents=[long], truncate=True)
    assert jina.status_code == 200, jina.text
    # Cohere's v2 cuts documents to max_tokens_per_doc (4096 by default) and then to fit
    cohere = post(base, "/v2/rerank", model="reranker", query=QUERY, documents=[long])
    assert cohere.status_code == 200, cohere.text
    short = post(
        base,
        "/v2/rerank",
        model="reranker",
        query=QUERY,
        documents=[long, "w " * 4],
        max_tokens_per_doc=4,
    ).json()
    scores = {r["index"]: r["relevance_score"] for r in short["results"]}
    assert abs(scores[0] - scores[1]) < 1e-6  # both cut to the same four tokens
