"""Token lists to one padded batch: pad to the batch's own longest member, mask the padding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def collate(rows: Sequence[np.ndarray], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T) int64 with T = the longest row, not the bucket."""
    longest = max(len(r) for r in rows)
    ids = np.full((len(rows), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)
