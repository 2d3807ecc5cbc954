"""Decode attention packs grouped queries onto their key/value heads whatever transformers'
version (`worker/generate/attention.py`): the values of SDPA over repeated heads, one kernel
item per key/value head."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from worker.generate.attention import NAME, packed_decode_attention
from worker.generate.engine import GenerationEngine

pytestmark = pytest.mark.scenario


def test_one_query_per_head_is_attended_as_over_repeated_heads() -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, keys = 5, 9, 3, 64, 40
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    query = torch.randn(batch, heads, 1, dim)
    key, value = torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, dim)
    mask = (
        torch.arange(keys)[None, None, None, :]
        < torch.tensor([40, 33, 20, 7, 1])[:, None, None, None]
    )
    out, _ = packed_decode_attention(module, query, key, value, mask, scaling=dim**-0.5)  # type: ignore[arg-type]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=dim**-0.5
    ).transpose(1, 2)
    assert out.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_prefill_goes_to_transformers_own_sdpa() -> None:
    torch.manual_seed(1)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query, key, value = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    out, _ = packed_decode_attention(module, query, key, value, None)  # type: ignore[arg-type]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 2), repeat_kv(value, 2), is_causal=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_the_engine_loads_its_model_with_the_packed_attention(tiny_model: Path) -> None:
    engine = GenerationEngine(tiny_model, kv_tokens=256)
    assert engine.model.config._attn_implementation == NAME
