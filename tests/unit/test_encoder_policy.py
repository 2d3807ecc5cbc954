"""Pure policy of the encoder routes and the classifier kind: score functions, rankings,
matryoshka vectors, what a model's config says, and the segment ids of a pair."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from common.errors import InvalidRequest
from common.protocol import ModelInfo, decode, encode
from gateway.routes.embeddings import base64_rows, vector_options
from gateway.scores import activate, ranking, shorten
from worker.models import is_classifier, read_activation, read_labels


def test_activate_matches_the_textbook_functions() -> None:
    logits = np.array([[0.0, 1.0, -2.0], [3.0, 3.0, 3.0]], dtype=np.float32)
    sig = activate(logits, "sigmoid")
    assert np.allclose(sig, 1 / (1 + np.exp(-logits)))
    soft = activate(logits, "softmax")
    assert np.allclose(soft.sum(1), 1) and np.allclose(soft[1], 1 / 3)
    assert np.array_equal(activate(logits, "identity"), logits)
    big = activate(np.array([[1000.0, 0.0]]), "softmax")  # no overflow
    assert np.allclose(big, [[1, 0]])
    with pytest.raises(ValueError):
        activate(logits, "tanh")


def test_ranking_is_best_first_ties_in_order_and_cut_at_top_n() -> None:
    assert ranking([0.1, 0.9, 0.5, 0.9], None) == [1, 3, 2, 0]
    assert ranking([0.1, 0.9, 0.5, 0.9], 2) == [1, 3]
    assert ranking([], 3) == []


def test_shorten_cuts_then_renormalizes() -> None:
    vectors = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    cut = shorten(vectors, 2, normalize=True)
    assert np.allclose(cut, [[0.6, 0.8]])
    assert np.allclose(shorten(vectors, None, normalize=False), vectors)
    assert np.allclose(np.linalg.norm(shorten(vectors, None, normalize=True)), 1)


def info(**changes) -> ModelInfo:
    base = dict(
        name="m",
        kind="embedding",
        dim=384,
        max_tokens=512,
        vocab_size=30522,
        tokenizer_sha256="x",
        chat_template="",
        bos_token="",
        eos_token="",
        aliases=[],
    )
    return ModelInfo(**{**base, **changes})


def test_vector_options_refuse_what_the_model_cannot_give() -> None:
    plain, normalized = info(), info(normalized=True)
    assert vector_options(plain, None, None) == (None, False)
    assert vector_options(normalized, None, None) == (None, False)  # already unit length
    assert vector_options(plain, None, True) == (None, True)
    assert vector_options(plain, 384, None) == (None, False)  # its own size: nothing to cut
    with pytest.raises(InvalidRequest, match="matryoshka"):
        vector_options(plain, 128, None)
    assert vector_options(info(matryoshka=True), 100, None) == (100, True)
    with pytest.raises(InvalidRequest, match="trained for"):
        vector_options(info(matryoshka=True, matryoshka_dims=[128, 256]), 100, None)
    with pytest.raises(InvalidRequest, match="more than"):
        vector_options(plain, 385, None)
    with pytest.raises(InvalidRequest, match="cannot undo"):
        vector_options(normalized, None, False)


def test_model_info_carries_a_classifiers_labels_and_an_embedders_options() -> None:
    labels = [f"L{i}" for i in range(300)]  # more than the stop-list limit: labels may be many
    message = info(kind="classifier", labels=labels, activation="softmax")
    assert decode(encode(message)) == message
    embedder = info(matryoshka=True, matryoshka_dims=[64, 128], prompts={"query": "q: "})
    assert decode(encode(embedder)) == embedder


def test_config_decides_kind_labels_and_score_function() -> None:
    reranker = {"architectures": ["BertForSequenceClassification"], "num_labels": 1}
    assert is_classifier(reranker) and not is_classifier({"architectures": ["BertModel"]})
    assert read_labels(reranker) == ("LABEL_0",) and read_activation(reranker) == "sigmoid"
    three = {"id2label": {"0": "neg", "1": "neu", "2": "pos"}}
    assert read_labels(three) == ("neg", "neu", "pos") and read_activation(three) == "softmax"
    raw = {
        **reranker,
        "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"},
    }
    assert read_activation(raw) == "identity"
    old = {
        **reranker,
        "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid",
    }
    assert read_activation(old) == "sigmoid"


def test_token_types_mark_the_second_segment() -> None:
    torch = pytest.importorskip("torch")
    from worker.encode.runners.encoder import token_types

    ids = torch.tensor([[101, 7, 8, 102, 9, 102, 0], [101, 7, 102, 0, 0, 0, 0]])
    assert token_types(ids, 102).tolist()[0][:6] == [0, 0, 0, 0, 1, 1]
    assert token_types(ids, 102).tolist()[1][:3] == [0, 0, 0]


@pytest.mark.parametrize(("rows", "dim"), [(5, 384), (3, 100), (4, 1), (0, 384), (1, 3)])
def test_base64_of_a_whole_matrix_cut_per_row_is_each_rows_own_base64(rows: int, dim: int) -> None:
    vectors = np.random.default_rng(rows + dim).standard_normal((rows, dim)).astype(np.float32)
    expected = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    got = base64_rows(vectors)
    assert got == expected
    assert all(
        np.array_equal(np.frombuffer(base64.b64decode(g), "<f4"), v)
        for g, v in zip(got, vectors, strict=True)
    )


def test_scores_and_vectors_are_per_row_and_float32() -> None:
    rows = np.array([[1.0, 2.0], [10.0, -10.0]], dtype=np.float32)
    soft = activate(rows, "softmax")  # each row against its own maximum
    assert soft.dtype == np.float32
    assert np.allclose(soft[0], np.exp([1, 2]) / np.exp([1, 2]).sum())
    assert np.allclose(soft[1], [1.0, 0.0], atol=1e-8)
    assert activate(np.array([[1.0]], dtype=np.float64), "identity").dtype == np.float32
    vectors = np.array([[3.0, 4.0, 12.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0]], np.float64)
    unit = shorten(vectors, None, normalize=True)
    assert unit.dtype == np.float32 and unit.flags["C_CONTIGUOUS"]
    assert np.allclose(np.linalg.norm(unit[:2], axis=1), 1)  # each row on its own
    assert np.array_equal(unit[2], [0, 0, 0])  # a zero vector stays zero, no NaN
    tiny = shorten(np.array([[1e-7, 0.0]]), None, normalize=True)
    assert np.allclose(tiny, [[1.0, 0.0]])  # a small vector is scaled up, not floored
    cut = shorten(vectors, 2, normalize=False)
    assert cut.shape == (3, 2) and cut.flags["C_CONTIGUOUS"] and cut.dtype == np.float32


def test_softmax_shifts_each_row_by_its_own_maximum_so_no_row_underflows() -> None:
    """Rows far apart in scale each get their own softmax, not NaN from a shared shift."""
    logits = np.array([[1000.0, 1000.0], [0.0, 0.0], [-1000.0, -1001.0]], dtype=np.float32)
    soft = activate(logits, "softmax")
    assert not np.isnan(soft).any()
    assert soft[:2].tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert np.allclose(soft[2], [1 / (1 + np.exp(-1.0)), 1 / (1 + np.exp(1.0))])
