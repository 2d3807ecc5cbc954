"""What a message's field types cannot say: that its byte fields and counts agree.

`protocol.decode` calls `check_consistent` once the field set and types are checked, so a
malformed entry is a `ProtocolError` the worker dead-letters, never an exception in the
middle of a batch. Checks go by the message's tag; the classes stay in `protocol`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_STOP_SEQUENCES = 4
MAX_ENTRY_ROWS = 1024  # rows one encoder entry may carry (the gateway's max_entry_rows)


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this version; the entry is dead-lettered."""


def check_consistent(tag: str, message: Any) -> None:
    if tag in ("req", "genreq") and (not message.tokens or len(message.tokens) % 4):
        raise ProtocolError(f"{tag}.tokens: {len(message.tokens)} bytes is not a uint32 list")
    check = _CHECKS.get(tag)
    if check is not None:
        check(message)


def _check_rows(entry: Any) -> None:
    n = len(entry.lengths) // 4
    if not 0 < n <= MAX_ENTRY_ROWS or len(entry.lengths) % 4:
        raise ProtocolError(f"req.lengths: 1 to {MAX_ENTRY_ROWS} uint32 row lengths")
    lengths = entry.row_lengths()
    if not lengths.all() or int(lengths.sum(dtype=np.int64)) != entry.n_tokens:
        raise ProtocolError("req.lengths: every row has tokens, and they add up to tokens")


def _check_vectors(result: Any) -> None:
    if not 0 < result.rows <= MAX_ENTRY_ROWS or len(result.embeddings) % (4 * result.rows):
        raise ProtocolError("emb.embeddings: rows x dim float32 values")


def _check_generation_lists(entry: Any) -> None:
    if len(entry.stop) > MAX_STOP_SEQUENCES:
        raise ProtocolError(f"genreq.stop: more than {MAX_STOP_SEQUENCES} sequences")
    if len(entry.stop_token_ids) % 4 or len(entry.bias_tokens) % 4:
        raise ProtocolError("genreq: stop_token_ids and bias_tokens must be uint32 lists")
    if len(entry.bias_values) != len(entry.bias_tokens):
        raise ProtocolError("genreq: one float32 bias per bias token")


def _check_scores(chunk: Any) -> None:
    for prefix, n in (("", chunk.n_tokens), ("prompt_", None)):
        values = getattr(chunk, prefix + "logprobs")
        ids, tops = getattr(chunk, prefix + "top_ids"), getattr(chunk, prefix + "top_logprobs")
        rows = len(values) // 4
        if len(values) % 4 or (n is not None and values and rows != n):
            raise ProtocolError(f"gen.{prefix}logprobs: one float32 per token")
        if len(ids) != len(tops) or len(ids) % 4 or (ids and (not rows or len(ids) // 4 % rows)):
            raise ProtocolError(f"gen.{prefix}top_ids: a uint32 and a float32 per alternative")


_CHECKS = {
    "req": _check_rows,
    "emb": _check_vectors,
    "genreq": _check_generation_lists,
    "gen": _check_scores,
}
