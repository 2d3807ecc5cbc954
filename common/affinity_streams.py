"""Generation workers' affinity streams in Redis: the loads they report, which of them read
their tenants' streams in the tenants' lanes, and forgetting a long-dead one's streams.

The workers write both with each beat (`streams.heartbeat`); the gateways route prompts by
them (`gateway.affinity`), and the live workers adopt a dead peer's streams
(`worker.liveness`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.keys import Keys
from common.store import Store, pipeline
from common.streams import as_text


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    load: int  # sequences held at its last beat
    beat_ms: int


async def worker_loads(store: Store, keys: Keys, model: str) -> dict[str, WorkerLoad]:
    """What each generation worker with an affinity stream last reported, live or not."""
    rows = await store.hgetall(keys.load(model))
    out = {}
    for name, value in (rows or {}).items():
        try:
            load, beat = as_text(value).split()
            out[as_text(name)] = WorkerLoad(int(load), int(beat))
        except (ValueError, UnicodeDecodeError):  # not ours to fail on: skipped, not a crash
            continue
    return out


async def laned_affinity_workers(store: Store, keys: Keys, model: str) -> set[str]:
    """The workers that read their tenants' affinity streams in the tenants' lanes."""
    # HGETALL, not HKEYS: the documented least-privilege user has the one, not the other
    return {as_text(name) for name in await store.hgetall(keys.laned_affinity(model)) or {}}


async def forget_affinity(
    store: Store, keys: Keys, model: str, worker: str, tenants: list[str]
) -> bool:
    """Delete a long-dead worker's affinity streams (its own and its `tenants'`) and its
    load entry if every one of them is empty."""
    owned = [keys.affinity(model, worker), *(keys.affinity(model, worker, t) for t in tenants)]
    pipe = pipeline(store)
    for stream in owned:
        pipe.xlen(stream)
    if any(await pipe.execute()):
        return False
    pipe = pipeline(store)
    pipe.delete(*owned)
    pipe.hdel(keys.load(model), worker)
    pipe.hdel(keys.laned_affinity(model), worker)
    await pipe.execute()
    return True
