"""On a Redis Cluster, every key of one model hashes to one slot: no command crosses slots."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from common.streams import Keys


def model_keys(keys: Keys, model: str) -> list[str]:
    buckets = [keys.request(model, bucket) for bucket in (128, 256, 512)]
    extra = [keys.dead(model), keys.workers(model), keys.batching(model), keys.cancel(model)]
    return buckets + extra


@pytest.mark.parametrize("model", ["noop", "all-MiniLM-L6-v2", "/models/bge small", "org/m{v2}"])
@pytest.mark.parametrize("prefix", ["mb", "staging:mb"])
def test_every_key_of_one_model_hashes_to_one_slot(model: str, prefix: str) -> None:
    slots = {key_slot(key.encode()) for key in model_keys(Keys(prefix), model)}
    assert len(slots) == 1


def test_models_and_gateways_spread_over_slots() -> None:
    keys = Keys("mb")
    models = {key_slot(keys.request(f"model-{i}", 128).encode()) for i in range(20)}
    replies = {key_slot(keys.reply(f"gateway-{i}").encode()) for i in range(20)}
    assert len(models) > 10 and len(replies) > 10


def test_concurrent_requests_are_written_one_pipeline_per_model_slot() -> None:
    """A Cluster master that fails over fails the requests of its own slot only."""
    from gateway.enqueue import _by_slot

    keys = Keys("mb")
    a = [(keys.request("a", 128), b"1"), (keys.request("a", 512), b"2")]
    b = [(keys.request("b", 128), b"3")]
    waiters = [(a, "fa"), (b, "fb"), (a[:1], "fa2")]
    groups = _by_slot(waiters)  # type: ignore[arg-type]
    assert [[w[1] for w in g] for g in groups] == [["fa", "fa2"], ["fb"]]
