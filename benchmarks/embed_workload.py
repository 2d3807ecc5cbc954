"""The embedding benchmark's workload: fixed-seed texts whose token counts are checked, not assumed.

The texts come from `common.cli.loadgen.workload` (the generator `microbatch bench` uses), so every
tool in the repository loads the same mixes. Each text is then tokenized with the served
model's own tokenizer, special tokens included and no truncation, and a count outside the mix's
ranges stops the run: a benchmark of 512-position inputs must really send them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from tokenizers import Tokenizer

from common.cli import loadgen

MODEL_NAME = "all-MiniLM-L6-v2"


@dataclass(frozen=True, slots=True)
class Workload:
    mix: str  # a key of common.cli.loadgen.MIXES
    texts: list[str]  # in arrival order (random, fixed seed)
    token_ids: list[np.ndarray]  # per text, with [CLS] and [SEP], as the gateway sends them

    @property
    def tokens(self) -> list[int]:
        """Each text's real token count."""
        return [len(ids) for ids in self.token_ids]

    def bodies(self) -> list[bytes]:
        """One OpenAI-style request body per text, in arrival order."""
        return [orjson.dumps({"input": t, "model": MODEL_NAME}) for t in self.texts]


def load_tokenizer(model_path: Path) -> Tokenizer:
    """The model's fast tokenizer with its file's padding and truncation (128) switched off."""
    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def make_workload(mix: str, n: int, tokenizer: Tokenizer, seed: int = 0) -> Workload:
    """`n` texts of the mix `mix`; raises if any text's token count falls outside the mix."""
    texts = loadgen.workload(mix, n, seed=seed)
    ids = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts)]
    ranges = [(low, high) for _, low, high in loadgen.MIXES[mix]]
    for text, row in zip(texts, ids, strict=True):
        if not any(low <= len(row) <= high for low, high in ranges):
            raise RuntimeError(f"{mix} text has {len(row)} tokens, outside {ranges}: {text[:60]!r}")
    return Workload(mix, texts, ids)
