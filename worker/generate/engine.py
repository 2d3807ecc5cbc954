"""`GenerationEngine`: a Hugging Face causal LM decoding many sequences at once over a paged
KV cache with automatic prefix caching.

Each sequence's keys and values live in fixed-size blocks of a shared pool (`KVStore`), found
through its block table (`BlockManager`). A decode step writes one position per sequence and
attention reads each sequence's blocks (gathered per layer, padded to the longest table and
masked); joining, leaving and preemption only change block tables, never move a running
sequence's cache. A newcomer whose prompt begins with blocks cached by an earlier sequence
(the same system prompt, the previous turn of a chat with its answer) prefills only the
rest: its queries attend to the cached keys through the same gather. The model's own forward
runs unchanged: the engine only passes a cache object, explicit positions and a ready 4-D
mask, which transformers uses as is.

Called from the worker's single compute thread only; never from the event loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.protocol import Scores
from worker.generate import attention
from worker.generate.blocks import NULL_BLOCK, BlockManager
from worker.generate.kv_store import KVStore
from worker.generate.logprobs import prompt_scores, token_scores
from worker.generate.packed_linear import pack_linears
from worker.generate.sampling import Sampling, sample
from worker.generate.scheduler import prefill_groups
from worker.generate.steps import Admission, Picked
from worker.models import eos_ids_of


@dataclass(slots=True)
class _Row:
    key: int
    length: int  # tokens in the cache
    last: int  # the newest token, not yet in the cache: the next decode input
    sampling: Sampling
    logprobs: int


@dataclass(slots=True)
class _Filling:
    """A prompt being prefilled, maybe over several steps."""

    admission: Admission
    done: int  # leading positions whose keys and values are in place
    copies: list[Admission]  # its `same_as` siblings: they fork its blocks when it is done
    cached: int = 0  # of `done` at admission, how many the prefix cache held
    scores: list[Scores] | None = None  # its prompt's scores so far, chunk by chunk, if asked


class PagedCache:
    """The transformers cache protocol (`update`) over the block pool, for one forward:
    store the new keys and values at their slots, hand attention every row's blocks."""

    def __init__(
        self, store: KVStore, slots: torch.Tensor, real: torch.Tensor | None, blocks, rows: int
    ) -> None:
        self.store, self.slots, self.real, self.blocks, self.rows = store, slots, real, blocks, rows

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__
    ):
        heads, dim = key_states.shape[1], key_states.shape[3]
        keys = key_states.transpose(0, 1).reshape(heads, -1, dim)
        values = value_states.transpose(0, 1).reshape(heads, -1, dim)
        if self.real is not None:  # a prefill: skip the padding queries
            keys, values = keys[:, self.real], values[:, self.real]
        self.store.write(layer_idx, self.slots, keys, values)
        return self.store.read(layer_idx, self.blocks, self.rows)


class GenerationEngine:
    def __init__(
        self,
        path: Path,
        *,
        device: str = "cpu",
        threads: int | None = None,
        kv_tokens: int = 32_768,
        block_size: int = 16,
        prefix_caching: bool = True,
        dtype: str = "float32",
        kv_dtype: str = "auto",
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.model = load_causal_lm(path, self.dtype, self.device)
        self.packed_linears = pack_linears(self.model, self.device)
        config = self.model.config.get_text_config(decoder=True)
        self.context = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        kv_heads = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
        head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._pad_id = int(self.model.config.pad_token_id or 0)
        self._cache_keyword = cache_keyword(self.model)
        self.eos_ids = _eos_ids(self.model)
        self.block_size = block_size
        num_blocks = -(-kv_tokens // block_size) + 1  # and the null block
        self.blocks = BlockManager(
            num_blocks, block_size, prefix_caching, namespace=str(path).encode()
        )
        self.store = KVStore(
            layers=int(config.num_hidden_layers),
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            max_blocks=num_blocks,
            dtype=self.dtype,
            kv_dtype=kv_dtype,
            device=self.device,
        )
        self._rows: list[_Row] = []
        self._filling: dict[int, _Filling] = {}

    # ---- state the scheduler reads --------------------------------------------------------

    def usage_ratio(self) -> float:
        """Blocks running sequences hold, over the pool."""
        return self.blocks.used / self.blocks.usable

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def retire(self, keys: Sequence[int]) -> None:
        """Free the blocks of finished, cancelled or preempted sequences (named full blocks
        stay cached until evicted). A prompt still prefilling hands its progress to the first
        of its copies that stays."""
        gone = set(keys)
        for key in gone:
            filling = self._filling.pop(key, None)
            if filling is not None:
                heirs = [c for c in filling.copies if c.key not in gone]
                if heirs:
                    self.blocks.fork(key, heirs[0].key)
                    self._filling[heirs[0].key] = _Filling(
                        heirs[0], filling.done, heirs[1:], filling.cached, filling.scores
                    )
            for copies in (f.copies for f in self._filling.values()):
                copies[:] = [c for c in copies if c.key not in gone]
            self.blocks.free(key)
        self._rows = [row for row in self._rows if row.key not in gone]

    def pending(self, key: int) -> int:
        """Prompt tokens of `key` not yet prefilled (0 once it decodes)."""
        filling = self._filling.get(key)
        return 0 if filling is None else len(filling.admission.tokens) - filling.done

    @torch.inference_mode()
    def step(
        self, newcomers: Sequence[Admission], budgets: Mapping[int, int] | None = None
    ) -> dict[int, Picked]:
        """Decode one token for every running sequence, then prefill: prompts begun earlier
        first, then the newcomers, those of similar length together (one prefill per prompt
        its `same_as` copies share). `budgets` caps the prompt tokens a key computes this
        step (a long prompt prefills in chunks, so running sequences keep decoding); a key
        without one computes all it has left. A prompt whose last token is computed gets its
        first token; one still short of it picks nothing yet."""
        budgets = budgets or {}
        picked = self._decode() if self._rows else {}
        copies: dict[int, list[Admission]] = {}
        for a in newcomers:
            if a.same_as is not None:
                copies.setdefault(a.same_as, []).append(a)
        for a in newcomers:
            if a.same_as is None:  # a prompt scored needs every position computed: no reuse
                self._admit(a, copies, reuse=a.prompt_logprobs < 0)
        tasks = [f for key, f in self._filling.items() if budgets.get(key, 1) > 0]
        ends = {
            f.admission.key: min(
                len(f.admission.tokens), f.done + budgets.get(f.admission.key, 1 << 30)
            )
            for f in tasks
        }
        for f in (f for f in tasks if f.scores is not None):  # alone: every position's logits
            picked.update(self._prefill([f], ends, every_position=True))
        plain = [f for f in tasks if f.scores is None]
        for group in prefill_groups([ends[f.admission.key] - f.done for f in plain]):
            picked.update(self._prefill([plain[i] for i in group], ends))
        return picked

    def _admit(self, a: Admission, copies: dict[int, list[Admission]], reuse: bool) -> None:
        cached = self.blocks.admit(a.key, a.tokens, reuse=reuse)
        scores: list[Scores] | None = [] if a.prompt_logprobs >= 0 else None
        self._filling[a.key] = _Filling(a, cached, copies.get(a.key, []), cached, scores)

    def _decode(self) -> dict[int, Picked]:
        rows = self._rows
        copies = [self.blocks.append(row.key, row.last) for row in rows]
        self.store.ensure(self.blocks.high_water)
        for copy in copies:
            if copy is not None:  # a shared last block, copied before this step writes it
                self.store.copy_block(*copy)
        slots = torch.tensor([self.blocks.slot(row.key, row.length) for row in rows])
        blocks, width = self._tables([row.key for row in rows])
        lengths = torch.tensor([row.length for row in rows], device=self.device)
        mask = torch.arange(width, device=self.device)[None, :] <= lengths[:, None]
        input_ids = torch.tensor([[row.last] for row in rows], device=self.device)
        cache = PagedCache(self.store, slots.to(self.device), None, blocks, len(rows))
        logits = self._forward(input_ids, mask[:, None, None, :], lengths[:, None], cache)[:, -1]
        self.blocks.commit([row.key for row in rows])
        tokens, failed = sample(logits, [row.sampling for row in rows])
        scores = token_scores(
            logits, tokens, [-1 if i in failed else r.logprobs for i, r in enumerate(rows)]
        )
        for row, token in zip(rows, tokens, strict=True):
            row.length += 1
            row.last = token
        picked = {
            row.key: Picked(token, s) for row, token, s in zip(rows, tokens, scores, strict=True)
        }
        return self._let_go(picked, {rows[i].key: why for i, why in failed.items()})

    def _prefill(
        self, group: Sequence[_Filling], ends: Mapping[int, int], every_position: bool = False
    ) -> dict[int, Picked]:
        """Compute each prompt's positions from where it stopped to its end this step; those
        reaching their last token become decoding rows, with their copies."""
        self.store.ensure(self.blocks.high_water)
        spans = [(f.done, ends.get(f.admission.key, len(f.admission.tokens))) for f in group]
        ids, positions, mask, cache = self._prefill_inputs(group, spans)
        width = ids.shape[1]
        keep = 0 if every_position else 1  # 0: transformers keeps every position's logits
        logits = self._forward(ids, mask, positions, cache, keep)
        self.blocks.commit([f.admission.key for f in group], [end for _, end in spans])
        if every_position:  # alone in its group: score this chunk, keep only the scores
            (f,), ((start, end),) = group, spans
            assert f.scores is not None
            following = f.admission.tokens[start + 1 : end + 1]
            run = logits[0, width - (end - start) :]
            f.scores.append(
                prompt_scores(run, following, f.admission.prompt_logprobs, first=start == 0)
            )
        finished = []
        for i, (f, (_, end)) in enumerate(zip(group, spans, strict=True)):
            f.done = end
            if end == len(f.admission.tokens):
                del self._filling[f.admission.key]
                finished.append(i)
        members = [(b, i) for i in finished for b in (group[i].admission, *group[i].copies)]
        for b, i in members:
            if b is not group[i].admission:
                self.blocks.fork(group[i].admission.key, b.key)
        if not members:
            return {}
        last = logits[[i for _, i in members], -1]
        tokens, failed = sample(last, [b.sampling for b, _ in members])
        asked = [-1 if j in failed else b.logprobs for j, (b, _) in enumerate(members)]
        scores = token_scores(last, tokens, asked)
        prompts = {  # a prompt's scores, joined once for it and its copies
            i: Scores.concat(group[i].scores) for i in finished if group[i].scores is not None
        }
        picked = {}
        for (b, i), token, s in zip(members, tokens, scores, strict=True):
            a = group[i].admission
            prompt = prompts.get(i)
            self._rows.append(_Row(b.key, len(a.tokens), token, b.sampling, b.logprobs))
            picked[b.key] = Picked(token, s, prompt, group[i].cached)
        return self._let_go(picked, {members[j][0].key: why for j, why in failed.items()})

    def _let_go(self, picked: dict[int, Picked], failed: dict[int, str]) -> dict[int, Picked]:
        """Sequences whose own sampling failed leave the engine (their blocks freed); each
        is reported as failed, the rest as picked."""
        if failed:
            self.retire(list(failed))
            for key, why in failed.items():
                picked[key] = Picked(-1, failed=why)
        return picked

    def _prefill_inputs(self, group: Sequence[_Filling], spans: Sequence[tuple[int, int]]):
        """Token ids, positions, mask and cache of a prefill of positions `[start, end)` per
        prompt: queries left-padded, so each row's last token is the last column."""
        width = max(end - start for start, end in spans)
        ids = torch.full((len(group), width), self._pad_id, dtype=torch.long)
        positions = torch.zeros((len(group), width), dtype=torch.long)
        slots, real = [], []
        for i, (f, (c, end)) in enumerate(zip(group, spans, strict=True)):
            m, key = end - c, f.admission.key
            ids[i, width - m :] = torch.from_numpy(f.admission.tokens[c:end].astype(np.int64))
            positions[i, width - m :] = torch.arange(c, end)
            slots += [self.blocks.slot(key, p) for p in range(c, end)]
            real += range(i * width + width - m, (i + 1) * width)
        blocks, keys = self._tables([f.admission.key for f in group])
        # a query sees every key up to its own position; padding queries see position 0
        mask = torch.arange(keys)[None, None, :] <= positions[:, :, None]
        cache = PagedCache(
            self.store,
            torch.tensor(slots, device=self.device),
            torch.tensor(real, device=self.device),
            blocks,
            len(group),
        )
        return ids.to(self.device), positions.to(self.device), mask[:, None].to(self.device), cache

    def _tables(self, keys: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The rows' block tables padded with the null block and flattened, and the number
        of key positions each row then spans."""
        tables = [self.blocks.table(key) for key in keys]
        longest = max(len(t) for t in tables)
        flat = [b for t in tables for b in (*t, *[NULL_BLOCK] * (longest - len(t)))]
        return torch.tensor(flat, device=self.device), longest * self.block_size

    def _forward(self, ids, mask, positions, cache, keep: int = 1) -> torch.Tensor:
        """The model's logits (B, positions kept, V) in float32, whatever the model's dtype
        (sampling, penalties and log-probabilities are computed in it)."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_keyword: cache},
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits.float()


def load_causal_lm(path: Path, dtype: torch.dtype, device: torch.device):
    """The model in `dtype` on `device`, for inference; its decode attention packs grouped
    queries whatever transformers' version (attention.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention.register()
    )
    return model.to(device).eval()


def cache_keyword(model) -> str:
    """What the model's forward calls its KV cache: `cache` from transformers 5.20 on,
    `past_key_values` before (there, a `cache=` would be swallowed by its **kwargs and the
    model would attend without one)."""
    forward = inspect.signature(model.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


def _eos_ids(model) -> set[int]:
    configs = (getattr(model, "generation_config", None), model.config)
    return eos_ids_of(getattr(c, "eos_token_id", None) for c in configs if c is not None)
