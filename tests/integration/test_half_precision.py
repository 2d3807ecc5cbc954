"""`dtype bfloat16` is honoured, never ignored: encoders and classifiers load their weights in
it and still answer float32 within a stated bound of the float32 answer. A causal LM loads in
the dtype asked, and `auto` is float32 for encoders and the host's native half precision for
generation (how close its tokens stay to transformers' is test_paged_engine's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.settings import Settings
from gateway.tokenize import ModelTokenizer
from worker.loading import load_model

TEXTS = [
    "micro-batching is neat",
    "a somewhat longer sentence about queues, deadlines and the padding of batches " * 6,
    "日本語のテキストも",
    "x",
]


def test_bfloat16_embeddings_are_float32_unit_vectors_near_the_reference(reference_model):
    half = load_model(Settings(model="all-MiniLM-L6-v2", dtype="bfloat16"))
    assert half.runner.dtype == "bfloat16"
    assert (half.runner.padded_width(17), half.runner.padded_width(510)) == (32, 512)
    tokenizer = reference_model.tokenizer
    rows = [np.asarray(tokenizer(t)["input_ids"], dtype=np.uint32) for t in TEXTS]
    got = np.stack(half.runner.embed(rows))
    want = reference_model.encode(TEXTS)
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # pooled in fp32
    cosines = (got * want).sum(1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.999
    assert np.abs(got - want).max() > 1e-6  # computed in bfloat16, not float32 after all


def test_a_bfloat16_reranker_scores_within_a_bound_of_float32(tmp_path: Path, monkeypatch):
    import worker.encode.collate as collation
    from worker.encode.tiny_classifier import write_tiny_classifier

    widths: list[int] = []
    real_collate = collation.collate

    def recording_collate(*args, **kwargs):
        ids, mask = real_collate(*args, **kwargs)
        widths.append(ids.shape[1])
        return ids, mask

    monkeypatch.setattr(collation, "collate", recording_collate)

    folder = write_tiny_classifier(tmp_path / "tiny-reranker")
    full = load_model(Settings(model=str(folder)))
    half = load_model(Settings(model=str(folder), dtype="bfloat16"))
    assert (full.kind, half.kind) == ("classifier", "classifier")
    files = full.files
    tokenizer = ModelTokenizer(files.tokenizer_json, max_tokens=512, vocab_size=files.vocab_size)
    documents = [("queue batch worker " * (i % 20 + 1)) + f"document {i}" for i in range(40)]
    rows = tokenizer.encode_pairs([("which queue", d) for d in documents], True)
    want = np.stack(full.runner.embed(rows))[:, 0]
    widths.clear()
    got = np.stack(half.runner.embed(rows))[:, 0]
    assert widths and all(w % 16 == 0 for w in widths)  # bfloat16 on a CPU: the kernel grid
    longest = max(len(r) for r in rows)
    assert half.runner.padded_width(longest) == widths[0]  # what the batch metrics count
    assert full.runner.padded_width(longest) == longest
    assert got.dtype == np.float32
    alone = np.stack([half.runner.embed([row])[0] for row in rows[:5]])[:, 0]
    assert np.abs(alone - got[:5]).max() <= 0.02  # the grid's padding is masked, not scored
    assert np.abs(got - want).max() <= 0.05  # logits of about +-0.5 here
    assert np.corrcoef(got, want)[0, 1] >= 0.99
    assert np.abs(got - want).max() > 1e-6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_causal_lm_loads_weights_and_cache_in_the_dtype_asked(tiny_model: Path, dtype: str):
    loaded = load_model(Settings(model=str(tiny_model), dtype=dtype, kv_cache_dtype="auto"))
    engine = loaded.runner
    assert loaded.dtype == dtype
    assert str(engine.model.dtype) == f"torch.{dtype}"  # type: ignore[union-attr]
    assert str(engine.store.stored) == f"torch.{dtype}"  # type: ignore[union-attr]


def test_auto_is_float32_for_encoders_and_the_hosts_choice_for_generation(tiny_model: Path):
    from worker.precision import host_hardware, serving_dtype

    native = serving_dtype("auto", causal_lm=True, device="cpu", hardware=host_hardware())
    generation = load_model(Settings(model=str(tiny_model)))
    assert generation.dtype == native
    assert str(generation.runner.model.dtype) == f"torch.{native}"  # type: ignore[union-attr]
    assert load_model(Settings(model="all-MiniLM-L6-v2")).dtype == "float32"


def test_packed_bfloat16_linears_compute_what_plain_ones_do_bit_for_bit(tiny_model: Path):
    """Where oneDNN runs bfloat16 natively a bfloat16 engine's linears are packed, and compute
    what plain ones do; elsewhere (and in float32) they stay plain."""
    import torch
    from torch import nn

    from worker.generate.engine import GenerationEngine
    from worker.generate.packed_linear import PackedLinear, packable

    torch.manual_seed(0)
    plain = nn.Linear(64, 96).to(torch.bfloat16)
    native = packable(plain, torch.device("cpu"))
    if native:
        for rows in (1, 3, 16, 40):  # laid out for 16 rows; any count computes the same
            x = torch.randn(2, rows, 64).to(torch.bfloat16)
            assert torch.equal(PackedLinear(plain)(x), plain(x))
    half = GenerationEngine(tiny_model, kv_tokens=64, dtype="bfloat16")
    plain_left = sum(type(m) is nn.Linear for m in half.model.modules())
    # seven projections in each of two layers, and the head
    assert (half.packed_linears, plain_left) == ((15, 0) if native else (0, 15))
    assert GenerationEngine(tiny_model, kv_tokens=64, dtype="float32").packed_linears == 0
