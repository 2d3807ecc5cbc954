"""Chained names of a token sequence's full blocks: equal prefixes, equal names.

Each name hashes its parent's name and its block's tokens, so one name stands for the whole
prefix it ends. The worker's prefix cache names its KV blocks this way; the gateway names
prompts the same way (at its own granularity) to remember which worker holds which prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def prefix_names(tokens: Sequence[int], block_size: int, namespace: bytes) -> list[bytes]:
    """One 16-byte name per full block of `tokens`, each covering its whole prefix."""
    array = np.asarray(tokens, dtype=np.int64)
    names: list[bytes] = []
    parent = namespace
    for start in range(0, len(array) - block_size + 1, block_size):
        names.append(parent := next_name(parent, array[start : start + block_size]))
    return names


def next_name(parent: bytes, block: np.ndarray | Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(block, dtype=np.int64).tobytes())
    return digest.digest()
