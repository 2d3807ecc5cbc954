"""Token lists to one padded batch: pad to the batch's own longest member, mask the padding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# oneDNN compiles a kernel for every shape a low-precision (AMX / AVX-512 bf16) CPU matmul
# sees, ~25 ms each here, and keeps a bounded cache of them: a served batch has a new length
# almost every time, so it paid that compile on most batches (served bfloat16 reranking at
# 0.67 of an offline loop that met the same shapes again). Lengths on a grid of 16 bound the
# shapes and keep them tile-aligned; float32 kernels are shape-generic, there the extra
# padding is only cost.
LOW_PRECISION_CPU_MULTIPLE = 16


def length_multiple(device: str, dtype: str) -> int:
    """The grid a batch's padded length is rounded up to on this device and dtype."""
    low_precision = dtype in ("bfloat16", "float16")
    return LOW_PRECISION_CPU_MULTIPLE if low_precision and device.startswith("cpu") else 1


def padded_length(longest: int, multiple: int = 1, limit: int | None = None) -> int:
    """`longest` rounded up to `multiple`, never past `limit` (the model's longest input)."""
    rounded = -(-longest // multiple) * multiple
    return rounded if limit is None else max(longest, min(rounded, limit))


def collate(
    rows: Sequence[np.ndarray], pad_id: int = 0, multiple: int = 1, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T) int64 with T = the longest row (rounded up to
    `multiple`, at most `limit`), not the bucket."""
    width = padded_length(max(len(r) for r in rows), multiple, limit)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)
