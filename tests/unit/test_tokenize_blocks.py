"""A bulk request's blocks tokenize side by side, yet come out in order, errors included."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from common.errors import InvalidRequest
from gateway.tokenize import ModelTokenizer, TokenizePool

WORDS = ["alpha", "beta", "gamma", "delta", "[UNK]"]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    plain = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    return ModelTokenizer(plain.to_str(), max_tokens=64, vocab_size=len(WORDS))


def texts(n: int) -> list[str]:
    """Texts of different lengths, so a block's rows say which texts they came from."""
    return [" ".join(WORDS[: 1 + i % 4] * (1 + i % 7)) for i in range(n)]


async def collect(pool: TokenizePool, tokenizer: ModelTokenizer, items: list[str], size: int):
    return [block async for block in pool.encode_blocks(tokenizer, items, size, False)]


def test_blocks_come_out_in_order_and_equal_tokenizing_all_at_once(tokenizer) -> None:
    pool = TokenizePool(inline_chars=0, threads=2)  # every block on the pool
    items = texts(103)
    blocks = asyncio.run(collect(pool, tokenizer, items, 10))
    assert [len(b) for b in blocks] == [10] * 10 + [3]
    whole = tokenizer.encode_texts(items, truncate=False)
    got = [row for block in blocks for row in block]
    assert all(np.array_equal(a, b) for a, b in zip(got, whole, strict=True))
    pool.close()


def test_a_bad_text_in_a_later_block_is_named_by_its_place_in_the_request(tokenizer) -> None:
    pool = TokenizePool(inline_chars=0, threads=2)
    items = texts(50)
    items[37] = ""

    async def scenario() -> int:
        taken = 0
        with pytest.raises(InvalidRequest, match=r"input\[37\]"):
            async for _ in pool.encode_blocks(tokenizer, items, 10, False):
                taken += 1
        return taken

    assert asyncio.run(scenario()) == 3  # the blocks before it, then the error, in order
    pool.close()


def test_no_more_than_the_pool_s_threads_run_ahead_and_none_after_the_caller_stops(
    tokenizer,
) -> None:
    """Tokenizing ahead is bounded (a bulk request holds no more than it queues soon), and a
    caller that stops (its client left, its queue write failed) starts nothing more."""
    pool = TokenizePool(inline_chars=0, threads=2)
    calls: list[int] = []

    class Counting:
        def encode_texts(self, block, *args, **kwargs):
            calls.append(kwargs.get("offset", args[-1] if args else 0))
            return tokenizer.encode_texts(block, *args, **kwargs)

    async def scenario() -> None:
        blocks = pool.encode_blocks(Counting(), texts(100), 10, False)  # type: ignore[arg-type]
        await anext(blocks)
        await blocks.aclose()
        await asyncio.sleep(0.2)  # anything still queued on the pool would run by now

    asyncio.run(scenario())
    assert len(calls) <= 3  # the block taken, and at most two in flight; never all ten
    pool.close()
