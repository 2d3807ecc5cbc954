"""`GenerationEngine`: a Hugging Face causal LM decoding many sequences at once with a KV cache.

Each running sequence owns one row of a preallocated cache `[rows, kv_heads, width, head_dim]`
per layer. All rows end at the same column, so one decode step writes one column and attends
over `[lo, col]`, where `lo` is the start of the longest row; each row's own start is masked.
Joining costs one prefill (newcomers of one length bucket together, left-padded) and a copy
of its keys and values into a free row; leaving costs moving the last row into the hole.
Nothing is recomputed between steps. The model's own forward runs unchanged: the engine only
passes a cache object, explicit positions and a ready 4-D mask, which transformers uses as is.

Called from the worker's single compute thread only; never from the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.protocol import Scores
from worker.generate.logprobs import prompt_scores, token_scores
from worker.generate.sampling import Sampling, sample
from worker.generate.scheduler import prefill_groups


@dataclass(frozen=True, slots=True)
class Admission:
    """A sequence to prefill: its prompt, plus what it generated before a preemption."""

    key: int
    tokens: np.ndarray
    sampling: Sampling
    logprobs: int = -1  # alternatives to report per generated token; -1: no scores
    prompt_logprobs: int = -1  # the same for its prompt tokens (needs every position's logits)
    same_as: int | None = None  # a newcomer of this step with the same tokens: share its prefill


@dataclass(frozen=True, slots=True)
class Picked:
    """What one step gave one sequence: its next token, and the scores it asked for."""

    token: int
    scores: Scores | None = None
    prompt: Scores | None = None  # its prompt's, from the prefill that admitted it


@dataclass(slots=True)
class _Row:
    key: int
    start: int  # first cache column this row uses
    length: int  # tokens in the cache
    last: int  # the newest token, not yet in the cache: the next decode input
    sampling: Sampling
    logprobs: int


class SlotCache:
    """The transformers cache protocol (`update`) over the engine's row buffers."""

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.n_layers = n_layers
        self.rows = 0  # rows taking part in the current forward
        self.col = 0  # the column the current decode writes
        self.lo = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__
    ):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[: self.rows, :, self.col] = key_states[:, :, 0]
        values[: self.rows, :, self.col] = value_states[:, :, 0]
        window = slice(self.lo, self.col + 1)
        return keys[: self.rows, :, window], values[: self.rows, :, window]


class PrefillCache:
    """Keeps a prefill's keys and values so the engine can copy them into rows."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__
    ):
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states


class GenerationEngine:
    def __init__(self, path: Path, *, device: str = "cpu", threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.to(self.device).eval()
        config = self.model.config.get_text_config(decoder=True)
        self.context = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self._kv_heads = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
        self._head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._n_layers = int(config.num_hidden_layers)
        self._pad_id = int(self.model.config.pad_token_id or 0)
        self.eos_ids = _eos_ids(self.model)
        self._cache = SlotCache(self._n_layers)
        self._rows: list[_Row] = []
        self._capacity = (0, 0)  # (rows, width) of the buffers

    # ---- state the scheduler reads --------------------------------------------------------

    def cache_positions(self) -> int:
        """Padded positions in use: rows x the longest row, what the KV budget bounds."""
        return len(self._rows) * max((row.length for row in self._rows), default=0)

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def retire(self, keys: Sequence[int]) -> None:
        """Free the rows of finished, cancelled or preempted sequences."""
        for key in keys:
            index = next((i for i, row in enumerate(self._rows) if row.key == key), None)
            if index is not None:
                self._remove_row(index)

    @torch.inference_mode()
    def step(self, newcomers: Sequence[Admission]) -> dict[int, Picked]:
        """Decode one token for every running sequence, then prefill the newcomers, those of
        similar length together (one prefill per prompt its `same_as` copies share)."""
        picked = self._decode() if self._rows else {}
        copies: dict[int, list[Admission]] = {}
        for a in newcomers:
            if a.same_as is not None:
                copies.setdefault(a.same_as, []).append(a)
        sources = [a for a in newcomers if a.same_as is None]
        for a in sources:
            if a.prompt_logprobs >= 0:  # scored alone: its prefill keeps every position
                picked.update(self._prefill([a], copies, every_position=True))
        plain = [a for a in sources if a.prompt_logprobs < 0]
        for group in prefill_groups([len(a.tokens) for a in plain]):
            picked.update(self._prefill([plain[i] for i in group], copies))
        return picked

    def _decode(self) -> dict[int, Picked]:
        self._ensure_room(rows=len(self._rows), left=0)
        cache, rows = self._cache, self._rows
        cache.rows = len(rows)
        starts = torch.tensor([row.start for row in rows], device=self.device)
        columns = torch.arange(cache.lo, cache.col + 1, device=self.device)
        mask = (columns[None, :] >= starts[:, None])[:, None, None, :]
        input_ids = torch.tensor([[row.last] for row in rows], device=self.device)
        positions = torch.tensor([[row.length] for row in rows], device=self.device)
        logits = self._forward(input_ids, mask, positions, cache)[:, -1]
        cache.col += 1
        tokens = sample(logits, [row.sampling for row in rows])
        scores = token_scores(logits, tokens, [row.logprobs for row in rows])
        for row, token in zip(rows, tokens, strict=True):
            row.length += 1
            row.last = token
        return {
            row.key: Picked(token, s) for row, token, s in zip(rows, tokens, scores, strict=True)
        }

    def _prefill(
        self,
        group: Sequence[Admission],
        copies: dict[int, list[Admission]],
        every_position: bool = False,
    ) -> dict[int, Picked]:
        lengths = [len(a.tokens) for a in group]
        width = max(lengths)
        pads = torch.tensor([width - n for n in lengths], device=self.device)
        ids = torch.full((len(group), width), self._pad_id, dtype=torch.long)
        for i, a in enumerate(group):
            ids[i, width - len(a.tokens) :] = torch.from_numpy(a.tokens.astype(np.int64))
        steps = torch.arange(width, device=self.device)
        positions = (steps[None, :] - pads[:, None]).clamp(min=0)
        real = steps[None, None, :] >= pads[:, None, None]  # keys that are not padding
        causal = steps[None, :, None] >= steps[None, None, :]
        diagonal = torch.eye(width, dtype=torch.bool, device=self.device)[None]
        mask = ((causal & real) | diagonal)[:, None]  # padding queries see themselves: no NaN
        cache = PrefillCache()
        keep = 0 if every_position else 1  # 0: transformers keeps every position's logits
        logits = self._forward(ids.to(self.device), mask, positions, cache, keep)
        members = [(b, i) for i, a in enumerate(group) for b in (a, *copies.get(a.key, ()))]
        last = logits[[i for _, i in members], -1]
        tokens = sample(last, [b.sampling for b, _ in members])
        scores = token_scores(last, tokens, [b.logprobs for b, _ in members])
        prompts = [
            prompt_scores(logits[i, width - n :], a.tokens, a.prompt_logprobs)
            if every_position
            else None
            for i, (a, n) in enumerate(zip(group, lengths, strict=True))
        ]
        self._ensure_room(rows=len(self._rows) + len(members), left=width)
        picked = {}
        for (b, i), token, s in zip(members, tokens, scores, strict=True):
            self._add_row(b, token, cache, i, lengths[i], width)
            picked[b.key] = Picked(token, s, prompts[i])
        self._cache.lo = min(row.start for row in self._rows)
        return picked

    def _add_row(
        self, a: Admission, token: int, prefill: PrefillCache, i: int, n: int, width: int
    ) -> None:
        """Copy row `i` of a prefill (its last `n` columns) into a new cache row."""
        r, col = len(self._rows), self._cache.col
        for layer in range(self._n_layers):
            self._cache.keys[layer][r, :, col - n : col] = prefill.keys[layer][i, :, width - n :]
            self._cache.values[layer][r, :, col - n : col] = prefill.values[layer][
                i, :, width - n :
            ]
        self._rows.append(_Row(a.key, col - n, n, token, a.sampling, a.logprobs))

    def _forward(self, ids, mask, positions, cache, keep: int = 1) -> torch.Tensor:
        """The model's logits (B, positions kept, V) in float32."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits

    # ---- row buffers ----------------------------------------------------------------------

    def _remove_row(self, index: int) -> None:
        last = len(self._rows) - 1
        if index != last:
            lo, col = self._cache.lo, self._cache.col
            for layer in range(self._n_layers):
                for buffer in (self._cache.keys[layer], self._cache.values[layer]):
                    buffer[index, :, lo:col] = buffer[last, :, lo:col]
            self._rows[index] = self._rows[last]
        self._rows.pop()
        if self._rows:
            self._cache.lo = min(row.start for row in self._rows)
        else:
            self._cache.lo = self._cache.col = 0

    def _ensure_room(self, *, rows: int, left: int) -> None:
        """Make room for `rows` rows, `left` columns before `col` and one column after it,
        moving the live window to the buffer's start (and growing it) only when needed."""
        cache = self._cache
        cap_rows, cap_width = self._capacity
        live = cache.col - cache.lo
        span = max(live, left)
        if rows <= cap_rows and cache.col >= span and cache.col + 1 <= cap_width:
            return
        new_rows = max(rows, cap_rows, 4) if rows <= cap_rows else max(rows, 2 * cap_rows)
        new_width = max(cap_width, span + max(64, span // 2))
        shape = (new_rows, self._kv_heads, new_width, self._head_dim)
        keys = [torch.zeros(shape, device=self.device) for _ in range(self._n_layers)]
        values = [torch.zeros(shape, device=self.device) for _ in range(self._n_layers)]
        shift = span - cache.col  # the window now ends at column `span`
        n = len(self._rows)
        for layer in range(len(cache.keys)):
            keys[layer][:n, :, span - live : span] = cache.keys[layer][:n, :, cache.lo : cache.col]
            values[layer][:n, :, span - live : span] = cache.values[layer][
                :n, :, cache.lo : cache.col
            ]
        for row in self._rows:
            row.start += shift
        cache.keys, cache.values = keys, values
        cache.col, cache.lo = span, span - live
        self._capacity = (new_rows, new_width)


def _eos_ids(model) -> set[int]:
    ids: set[int] = set()
    for config in (getattr(model, "generation_config", None), model.config):
        value = getattr(config, "eos_token_id", None) if config is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids
