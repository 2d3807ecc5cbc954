"""Text to token ids with the model's fast tokenizer; length limits are enforced here.

Short texts are tokenized inline (a thread hop costs more than they do); long ones go to a
small thread pool, where `tokenizers` releases the GIL, so a busy event loop never stalls.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tokenizers import Tokenizer

from common.errors import InputTooLong, InvalidRequest


class ModelTokenizer:
    def __init__(self, tokenizer_json: str, *, max_tokens: int, vocab_size: int) -> None:
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._plain = Tokenizer.from_str(tokenizer_json)
        self._plain.no_padding()
        self._plain.no_truncation()
        self._json = tokenizer_json
        self._truncating: dict[str, Tokenizer] = {}  # by direction, made when first asked
        self._pieces: dict[int, str] = {}

    def _cutting(self, direction: str, strategy: str = "longest_first") -> Tokenizer:
        """A tokenizer that cuts to the limit from the `direction` end ("right": the end);
        a pair's second text only with strategy "only_second"."""
        key = f"{direction}/{strategy}"
        tokenizer = self._truncating.get(key)
        if tokenizer is None:
            tokenizer = Tokenizer.from_str(self._json)
            tokenizer.no_padding()
            tokenizer.enable_truncation(
                max_length=self.max_tokens, direction=direction, strategy=strategy
            )
            self._truncating[key] = tokenizer
        return tokenizer

    def encode_texts(
        self,
        texts: Sequence[str],
        truncate: bool,
        check: bool = True,
        direction: str = "right",
        offset: int = 0,
    ) -> list[np.ndarray]:
        """Token ids per text; `check` refuses one over the limit (a prompt is checked by its
        caller against the context, together with the tokens it asks for). Errors name a
        text by its place in the request: `offset` is where `texts` start in it."""
        for i, text in enumerate(texts, offset):
            if not text:
                raise InvalidRequest(f"input[{i}] is an empty string", param=f"input[{i}]")
        tokenizer = self._cutting(direction) if truncate else self._plain
        encoded = (
            tokenizer.encode_batch_fast(list(texts))
            if len(texts) > 1
            else [tokenizer.encode(texts[0])]
        )
        out = [np.asarray(e.ids, dtype=np.uint32) for e in encoded]
        if check:
            self._check_lengths(out, offset)
        return out

    def encode_pairs(
        self,
        items: Sequence[str | tuple[str, str]],
        truncate: bool,
        field: str = "documents",
        direction: str = "right",
    ) -> list[np.ndarray]:
        """One row per text or (text, text) pair, a pair joined as the model's tokenizer
        joins one ([CLS] q [SEP] d [SEP]); `truncate` cuts a pair's second text only, never
        the first (a reranker's query)."""
        for i, item in enumerate(items):
            for part in (item,) if isinstance(item, str) else item:
                if not part:
                    raise InvalidRequest(f"{field}[{i}] is an empty string", param=f"{field}[{i}]")
        try:
            tokenizer = self._cutting(direction, "only_second") if truncate else self._plain
            encoded = tokenizer.encode_batch(list(items))
        except Exception as exc:  # a pair's first text alone is over the limit
            raise InputTooLong(
                f"a query leaves no room for its document within {self.max_tokens} tokens ({exc})",
                param="query",
            ) from None
        out = [np.asarray(e.ids, dtype=np.uint32) for e in encoded]
        for i, ids in enumerate(out):
            if len(ids) > self.max_tokens:
                raise InputTooLong(
                    f"{field}[{i}] is {len(ids)} tokens with its query; the limit for this "
                    f"model is {self.max_tokens} (set truncate: true to cut it)",
                    param=f"{field}[{i}]",
                )
        return out

    def cut(self, text: str, max_tokens: int) -> str:
        """`text` up to its first `max_tokens` tokens (Cohere's `max_tokens_per_doc`)."""
        encoding = self._plain.encode(text, add_special_tokens=False)
        if len(encoding.ids) <= max_tokens:
            return text
        return text[: encoding.offsets[max_tokens - 1][1]]

    def encode_plain(self, text: str) -> np.ndarray:
        """A rendered chat prompt: its template already wrote every special token."""
        return np.asarray(self._plain.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """One text's ids, whatever its length (for `/tokenize`, which reports the count)."""
        return list(self._plain.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text, special tokens included (`/detokenize`)."""
        self.check_in_vocab(ids, "tokens")
        return self._plain.decode(list(ids), skip_special_tokens=False)

    def spans(self, text: str, add_special_tokens: bool) -> list[dict]:
        """TEI's tokens: id, text, whether special, and the character span in `text` (None
        for a special token, which has none)."""
        encoding = self._plain.encode(text, add_special_tokens=add_special_tokens)
        special = encoding.special_tokens_mask
        out = []
        for i, (token, (start, stop)) in enumerate(
            zip(encoding.ids, encoding.offsets, strict=True)
        ):
            is_special = bool(special[i])
            out.append(
                {
                    "id": token,
                    "text": self.piece(token) if is_special else text[start:stop],
                    "special": is_special,
                    "start": None if is_special else start,
                    "stop": None if is_special else stop,
                }
            )
        return out

    def decode_text(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Ids back to text (TEI's `/decode`), special tokens dropped unless kept."""
        return self._plain.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token: int) -> str:
        """One token as text, the way vLLM shows it in log probabilities: decoded alone, so a
        fragment of a multi-byte character shows as U+FFFD."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self._plain.decode([token], skip_special_tokens=False)
        return text

    def check_in_vocab(self, ids: Sequence[int], param: str) -> None:
        if self.vocab_size and ids and max(ids) >= self.vocab_size:
            raise InvalidRequest(
                f"{param}: token id {max(ids)} is outside the vocabulary ({self.vocab_size})",
                param=param,
            )

    def check_token_lists(
        self,
        lists: Sequence[Sequence[int]],
        truncate: bool,
        check: bool = True,
        direction: str = "right",
    ) -> list[np.ndarray]:
        out = []
        for i, ids in enumerate(lists):
            if not ids:
                raise InvalidRequest(f"input[{i}] is an empty token list", param=f"input[{i}]")
            if truncate and len(ids) > self.max_tokens:
                ids = ids[-self.max_tokens :] if direction == "left" else ids[: self.max_tokens]
            array = np.asarray(ids, dtype=np.uint32)
            if self.vocab_size and int(array.max()) >= self.vocab_size:
                raise InvalidRequest(
                    f"input[{i}]: token id {int(array.max())} is outside the vocabulary "
                    f"({self.vocab_size})",
                    param=f"input[{i}]",
                )
            out.append(array)
        if check:
            self._check_lengths(out)
        return out

    def _check_lengths(self, encoded: list[np.ndarray], offset: int = 0) -> None:
        for i, ids in enumerate(encoded, offset):
            if len(ids) > self.max_tokens:
                raise InputTooLong(
                    f"input[{i}] has {len(ids)} tokens; the limit for this model is "
                    f"{self.max_tokens} (set truncate: true to cut it)",
                    param=f"input[{i}]",
                )


class TokenizePool:
    """Decides where tokenization runs: inline when cheap, else in the pool."""

    def __init__(self, inline_chars: int, threads: int = 2) -> None:
        self._inline_chars = inline_chars
        self._threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def encode(
        self,
        tokenizer: ModelTokenizer,
        texts: Sequence[str],
        truncate: bool,
        check: bool = True,
        direction: str = "right",
        offset: int = 0,
    ) -> list[np.ndarray]:
        chars = sum(len(t) for t in texts)
        return await self.run(
            chars, tokenizer.encode_texts, texts, truncate, check, direction, offset
        )

    async def encode_blocks(
        self,
        tokenizer: ModelTokenizer,
        texts: Sequence[str],
        size: int,
        truncate: bool,
        direction: str = "right",
    ) -> AsyncIterator[list[np.ndarray]]:
        """Token ids of `texts`, `size` at a time, in order, with as many blocks in flight as
        the pool has threads: a bulk request's blocks tokenize side by side (as TEI spreads
        inputs over its tokenizer workers), each on one core, while the ones before them are
        queued. A block not yet started when the caller stops never runs."""
        starts = iter(range(0, len(texts), size))
        flight: deque[asyncio.Future] = deque()

        def launch() -> None:
            start = next(starts, None)
            if start is not None:
                block = texts[start : start + size]
                encode = tokenizer.encode_texts
                work = functools.partial(encode, block, truncate, True, direction, start)
                flight.append(self._start(work, sum(len(t) for t in block)))

        try:
            for _ in range(self._threads):
                launch()
            while flight:
                block = await flight.popleft()
                launch()
                yield block
        finally:
            for future in flight:
                future.cancel()
                future.add_done_callback(_retrieve)

    def _start(self, work: Callable[[], list[np.ndarray]], chars: int) -> asyncio.Future:
        """`work()` as a future: done at once when cheap (`chars` few), else on the pool."""
        loop = asyncio.get_running_loop()
        if chars > self._inline_chars:
            return loop.run_in_executor(self._executor, work)
        future = loop.create_future()
        try:
            future.set_result(work())
        except Exception as exc:  # a bad input: raised where the block is awaited, in order
            future.set_exception(exc)
        return future

    async def run(self, chars: int, fn, *args):
        """`fn(*args)` inline when `chars` is small, else on the pool."""
        if chars <= self._inline_chars:
            return fn(*args)
        return await self.on_pool(fn, *args)

    async def on_pool(self, fn, *args):
        """`fn(*args)` on the pool, whatever its size: work whose cost its input's length
        does not tell (a grammar's compile) never runs on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _retrieve(future: asyncio.Future) -> None:
    """A dropped block's outcome, read so that nothing reports it as never retrieved."""
    if not future.cancelled():
        future.exception()
