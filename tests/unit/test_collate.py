"""Padding policy: a batch pads to its own longest row, on the kernel grid where the device
and dtype compile a kernel per shape, never past the model's longest input."""

from __future__ import annotations

import numpy as np
import pytest

from worker.encode.collate import collate, length_multiple, padded_length


@pytest.mark.parametrize(
    ("longest", "multiple", "limit", "want"),
    [
        (1, 1, None, 1),
        (37, 1, 512, 37),
        (37, 16, None, 48),
        (48, 16, None, 48),
        (49, 16, 512, 64),
        (500, 16, 510, 510),  # the grid would pass the model's positions: capped
        (510, 16, 510, 510),
    ],
)
def test_padded_length_rounds_up_to_the_grid_within_the_limit(longest, multiple, limit, want):
    assert padded_length(longest, multiple, limit) == want


def test_only_low_precision_on_a_cpu_pads_to_a_grid():
    assert length_multiple("cpu", "bfloat16") == 16
    assert length_multiple("cpu", "float16") == 16
    assert length_multiple("cpu", "float32") == 1  # shape-generic kernels: padding is cost
    assert length_multiple("cuda", "bfloat16") == 1
    assert length_multiple("cuda:1", "float32") == 1


def test_grid_padding_is_masked_and_filled_with_the_pad_id():
    rows = [np.array([5, 6, 7]), np.array([8])]
    ids, mask = collate(rows, pad_id=0, multiple=16)
    assert ids.shape == mask.shape == (2, 16)
    assert ids[0, :3].tolist() == [5, 6, 7] and ids[1, :1].tolist() == [8]
    assert mask.sum(1).tolist() == [3, 1]  # the grid's columns are padding, never tokens
    assert int(ids[:, 3:].abs().sum()) == 0 and int(ids[1, 1:].abs().sum()) == 0
    plain_ids, _ = collate(rows, pad_id=0)
    assert plain_ids.shape == (2, 3)  # without a grid: the batch's own longest
