"""FROZEN: common/message_checks.py of wire version 6 (release 558b774), for protocol_v6.

A message's checks: its field types, and what they cannot say (byte fields and counts agree).

`protocol.decode` checks the field set and each field's type (`check_field`, against what
`field_types` read from the dataclass), then calls `check_consistent`, so a malformed entry
is a `ProtocolError` the worker dead-letters, never an exception in the middle of a batch.
Checks go by the message's tag; the classes stay in `protocol`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import numpy as np

MAX_STOP_SEQUENCES = 4
MAX_ENTRY_ROWS = 1024  # rows one encoder entry may carry (the gateway's max_entry_rows)


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this version; the entry is dead-lettered.
    `id` and `reply_to` are what it still says of its sender, where it says it (strings),
    so a reader can answer the one waiting for it instead of leaving them to their deadline."""

    id: str | None = None
    reply_to: str | None = None


class VersionMismatch(ProtocolError):
    """A message of a wire version this release does not read (`wire_compat`): not poison,
    a fleet mid-upgrade; answered 503 `version_mismatch` where it names its sender."""


def addressed(exc: ProtocolError, body: dict) -> ProtocolError:
    """`exc`, with the `id` and `reply_to` the raw message still names."""
    for name in ("id", "reply_to"):
        value = body.get(name)
        if isinstance(value, str):
            setattr(exc, name, value)
    return exc


def field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """isinstance() targets per field; a `list[X]` field is checked as list, then its items
    as X; a `dict[str, str]` as dict, then its keys and values as str."""
    hints = typing.get_type_hints(cls)
    allowed: dict[str, tuple[type, ...]] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if hint is float:
            allowed[field.name] = (float, int)
        elif typing.get_origin(hint) is list:
            allowed[field.name] = (list, typing.get_args(hint)[0])
        elif typing.get_origin(hint) is dict:
            allowed[field.name] = (dict, str)
        else:
            allowed[field.name] = (hint,)
    return allowed


def check_field(tag: str, name: str, value: object, allowed: tuple[type, ...]) -> None:
    if allowed[0] in (list, dict):
        container, item = allowed
        if not isinstance(value, list | dict) or not isinstance(value, container):
            raise ProtocolError(f"{tag}.{name}: unexpected type {type(value).__name__}")
        items = [*value, *value.values()] if isinstance(value, dict) else value
        if not all(isinstance(i, item) and not isinstance(i, bool) for i in items):
            raise ProtocolError(f"{tag}.{name}: items must be {_NAMES.get(item, item.__name__)}")
        return
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ProtocolError(f"{tag}.{name}: unexpected type {type(value).__name__}")


_NAMES = {str: "strings", int: "integers"}


def check_consistent(tag: str, message: Any) -> None:
    if tag in ("req", "genreq") and (not message.tokens or len(message.tokens) % 4):
        raise ProtocolError(f"{tag}.tokens: {len(message.tokens)} bytes is not a uint32 list")
    check = _CHECKS.get(tag)
    if check is not None:
        check(message)


def _check_rows(entry: Any) -> None:
    if len(entry.lengths) == 4:  # one row, the common case: no array for it
        if int.from_bytes(entry.lengths, "little") != entry.n_tokens:
            raise ProtocolError("req.lengths: every row has tokens, and they add up to tokens")
        return  # and tokens is not empty: `check_consistent` saw to that
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
