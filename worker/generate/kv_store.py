"""`KVStore`: the paged KV cache's memory, one key and one value pool per layer.

Each pool is `[kv_heads, blocks, block_size, head_dim]`, so gathering a sequence's blocks
along dimension 1 gives every head's positions contiguous, the layout attention reads
fastest. Pools grow by doubling up to the block manager's size, so a small model on a big
budget does not reserve memory it never uses; block ids stay valid across growth.

`fp8_e4m3` stores float8 values with one float16 scale per token and head (its absolute
maximum over `head_dim`, mapped to float8's largest value), dequantized when read:
66 bytes per token and head instead of 256 in float32 (128 in bfloat16). `bfloat16` stores
a float32 model's cache at half its size, converted when read.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3")


class KVStore:
    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        max_blocks: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
        device: torch.device | str = "cpu",
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
        self.layers, self.heads, self.head_dim = layers, kv_heads, head_dim
        self.block_size, self.max_blocks = block_size, max_blocks
        self.dtype = dtype  # what attention computes in
        self.fp8 = kv_dtype == "fp8_e4m3"
        # float8 pools are kept as bytes: CPU indexing kernels do not take float8
        self.stored = {"fp8_e4m3": torch.uint8, "bfloat16": torch.bfloat16}.get(kv_dtype, dtype)
        self.device = torch.device(device)
        self.blocks = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        self.ensure(min(max_blocks, 64))

    def bytes_per_token(self) -> int:
        """Cache bytes one token costs across all layers, keys and values, scales included."""
        element = torch.empty((), dtype=self.stored).element_size()
        per_head = self.head_dim * element + (2 if self.fp8 else 0)
        return 2 * self.layers * self.heads * per_head

    def ensure(self, blocks: int) -> None:
        """Room for block ids below `blocks`, doubling (and copying) only when short."""
        if blocks <= self.blocks:
            return
        size = min(self.max_blocks, max(blocks, 2 * self.blocks))
        shape = (self.heads, size, self.block_size, self.head_dim)

        def grown(old: list[torch.Tensor], shape: tuple[int, ...], dtype) -> list[torch.Tensor]:
            out = []
            for layer in range(self.layers):
                new = torch.zeros(shape, dtype=dtype, device=self.device)
                if old:
                    new[:, : self.blocks] = old[layer]
                out.append(new)
            return out

        self.keys = grown(self.keys, shape, self.stored)
        self.values = grown(self.values, shape, self.stored)
        if self.fp8:
            self.key_scales = grown(self.key_scales, shape[:3], torch.float16)
            self.value_scales = grown(self.value_scales, shape[:3], torch.float16)
        self.blocks = size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Store `[heads, n, head_dim]` keys and values at flat slots `block * size + offset`."""
        self._put(self.keys[layer], self.key_scales[layer] if self.fp8 else None, slots, keys)
        self._put(self.values[layer], self.value_scales[layer] if self.fp8 else None, slots, values)

    def read(
        self, layer: int, blocks: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[rows, heads, positions, head_dim]` of `rows` block tables,
        flattened row by row into `blocks` (each table padded to the same length)."""
        return (
            self._get(self.keys[layer], self.key_scales[layer] if self.fp8 else None, blocks, rows),
            self._get(
                self.values[layer], self.value_scales[layer] if self.fp8 else None, blocks, rows
            ),
        )

    def copy_block(self, source: int, target: int) -> None:
        pools = [*self.keys, *self.values]
        if self.fp8:
            pools += [*self.key_scales, *self.value_scales]
        for pool in pools:
            pool[:, target] = pool[:, source]

    def _put(self, pool, scales, slots, states) -> None:
        flat = pool.view(self.heads, -1, self.head_dim)
        if scales is None:
            flat.index_copy_(1, slots, states.to(self.stored))
            return
        amax = states.abs().amax(dim=-1).float()
        scale = (amax / FP8_MAX).clamp(min=1e-6).to(torch.float16)  # rounded before use
        scaled = (states.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX)
        flat.index_copy_(1, slots, scaled.to(torch.float8_e4m3fn).view(torch.uint8))
        scales.view(self.heads, -1).index_copy_(1, slots, scale)

    def _get(self, pool, scales, blocks, rows) -> torch.Tensor:
        picked = pool.index_select(1, blocks)  # [heads, rows * per_row, size, dim]
        out = picked.view(self.heads, rows, -1, self.head_dim)
        if scales is not None:
            scale = scales.index_select(1, blocks).view(self.heads, rows, -1, 1)
            out = out.view(torch.float8_e4m3fn).to(self.dtype) * scale.to(self.dtype)
        elif out.dtype != self.dtype:  # bfloat16 storage under a float32 model
            out = out.to(self.dtype)
        return out.transpose(0, 1)
