"""A request's inputs as token rows: counted, tokenized, and cut into blocks when many.

Every route that queues inputs shares these rules: a list is neither empty nor over
`max_inputs_per_request`; an input is a string, strings, a token list or token lists; and
more texts than one queue entry carries are tokenized a block at a time, so the first
blocks compute while the rest are still being tokenized.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from common import tracing
from common.errors import InvalidRequest
from gateway.catalog import ModelEntry
from gateway.services import Services


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """A request's rows made a block at a time (tokenized while earlier blocks compute)."""

    count: int
    blocks: AsyncIterator[list[np.ndarray]]


def check_count(services: Services, count: int, field: str) -> None:
    """A list of inputs is neither empty nor over `max_inputs_per_request`: else a 400."""
    if not count:
        raise InvalidRequest(f"{field} must not be an empty list", param=field)
    limit = services.settings.max_inputs_per_request
    if count > limit:
        raise InvalidRequest(f"{field} has {count} items; the limit is {limit}", param=field)


async def token_lists(
    services: Services,
    model: ModelEntry,
    data: str | list,
    *,
    field: str = "input",
    truncate: bool = False,
    check: bool = True,
    direction: str = "right",
) -> list[np.ndarray]:
    """Token ids per item of an `input` or `prompt`: a string, strings, a token list or token
    lists. `check` refuses an item over the model's limit (a prompt is checked by its caller,
    together with the tokens it asks for)."""
    if isinstance(data, str):
        data = [data]
    check_count(services, len(data), field)
    if isinstance(data[0], str):
        with tracing.span(services.tracer, "tokenize", inputs=len(data)):
            return await services.tokenize.encode(model.tokenizer, data, truncate, check, direction)
    lists = [data] if isinstance(data[0], int) else data
    return model.tokenizer.check_token_lists(lists, truncate, check, direction)


async def token_rows(
    services: Services, model: ModelEntry, data: str | list, truncate: bool, direction: str
) -> list[np.ndarray] | RowBlocks:
    """An `input`'s token rows; more texts than one entry carries come a block at a time,
    each block tokenized as it is queued."""
    size = services.settings.max_entry_rows
    if isinstance(data, list) and len(data) > size and isinstance(data[0], str):
        check_count(services, len(data), "input")
        blocks = services.tokenize.encode_blocks(model.tokenizer, data, size, truncate, direction)
        return RowBlocks(len(data), blocks)
    return await token_lists(services, model, data, truncate=truncate, direction=direction)
