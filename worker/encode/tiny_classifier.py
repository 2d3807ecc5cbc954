"""`write_tiny_classifier`: a small random-weight BERT cross-encoder or classifier.

Reranking and classification are tried and tested offline with it: a standard architecture
(BertForSequenceClassification), safetensors weights from a fixed seed, and the real WordPiece
tokenizer of the bundled embedding model, so pairs are tokenized as any BERT cross-encoder's
are. Nothing here is special to microbatch: sentence-transformers' `CrossEncoder` and
`AutoModelForSequenceClassification` load the folder like any other.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from worker.models import default_model_path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def write_tiny_classifier(
    path: Path,
    labels: tuple[str, ...] = (),
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
) -> Path:
    """A reranker (no labels: one relevance logit) or a classifier over `labels`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    path.mkdir(parents=True, exist_ok=True)
    source = default_model_path()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, path / name)
    names = labels or ("LABEL_0",)
    config = BertConfig(
        vocab_size=30522,  # the bundled tokenizer's
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 4,
        max_position_embeddings=max_positions,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
        architectures=["BertForSequenceClassification"],
        initializer_range=0.2,  # wider than the default 0.02: scores differ visibly
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
