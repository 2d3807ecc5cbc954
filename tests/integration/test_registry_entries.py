"""One model's bad registry entry costs that model only: every other model stays served."""

from __future__ import annotations

import asyncio

from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from common import affinity_streams, streams
from common.protocol import ModelInfo, encode
from common.settings import Settings
from common.store import close_store, open_store
from gateway.catalog import Catalog


def _info(name: str, sha: str) -> bytes:
    return encode(
        ModelInfo(
            name=name, kind="embedding", dim=4, max_tokens=128, vocab_size=3,
            tokenizer_sha256=sha, chat_template="", bos_token="", eos_token="", aliases=[],
        )
    )  # fmt: skip


def test_a_model_whose_tokenizer_cannot_be_parsed_is_skipped_and_the_rest_served(
    redis_url: str,
) -> None:
    """A registry entry whose tokenizer JSON this gateway's `tokenizers` cannot parse (a newer
    format, a corrupted write) once killed the catalog task: every model 503, /healthz
    failed, and restarted gateways could not start."""
    good = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]")).to_str()

    async def scenario() -> tuple[set[str], bool]:
        settings = Settings(redis_url=redis_url)
        store = open_store(settings)
        keys = streams.Keys(settings.prefix)
        try:
            await streams.register_model(store, keys, "good", _info("good", "g"), "g", good)
            await streams.register_model(store, keys, "bad", _info("bad", "b"), "b", '{"no":1}')
            await store.hset(keys.models, "garbage", b"\x00 not msgpack")
            catalog = Catalog(store, settings)
            await catalog.refresh()
            await catalog.refresh()  # and again: still no exception, still served
            return set(catalog.models), catalog.redis_ok
        finally:
            await close_store(store)

    served, redis_ok = asyncio.run(scenario())
    assert served == {"good"} and redis_ok


def test_a_malformed_load_report_is_skipped_not_a_crash(redis_url: str) -> None:
    """Generation workers report their load in a hash every gateway and worker reads; one
    garbled field once crash-looped every worker of the model."""

    async def scenario() -> dict:
        settings = Settings(redis_url=redis_url)
        store = open_store(settings)
        keys = streams.Keys(settings.prefix)
        try:
            await store.hset(keys.load("m"), mapping={"w1": "3 1700000000000", "w2": "garbage"})
            return await affinity_streams.worker_loads(store, keys, "m")
        finally:
            await close_store(store)

    loads = asyncio.run(scenario())
    assert list(loads) == ["w1"] and loads["w1"].load == 3
