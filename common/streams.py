"""The only Redis command call sites; speaks `protocol` bytes.

Key names are `keys.Keys` (re-exported here: the call sites and the names go together).

Request streams are never trimmed by count: an entry is deleted right after it is acked.

On a Redis Cluster every `{model}` key of one model lives in one hash slot, so the one
multi-key command here (XREADGROUP over a model's bucket streams) never crosses slots; reply
streams hash by gateway id and spread over the masters. A pipeline may mix slots (a reply
and the acks it answers): the cluster client splits it per node, never as one transaction,
and nothing here relies on it being atomic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.exceptions import ResponseError

from common.keys import Keys as Keys
from common.store import Store, pipeline
from common.wire_compat import VERSION

GROUP = "workers"
FIELD = "m"
DEAD_MAXLEN = 10_000


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One entry read from a stream; `payload` is None when Redis lost it (trimmed, XDEL'd)."""

    stream: str
    entry_id: str
    payload: bytes | None


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def entries_of(stream: bytes | str, items: Iterable) -> list[StreamEntry]:
    name = as_text(stream)
    return [
        StreamEntry(name, as_text(eid), (fields or {}).get(FIELD.encode())) for eid, fields in items
    ]


async def ensure_groups(store: Store, streams: Iterable[str]) -> None:
    """Create the group on each stream; BUSYGROUP (already there) is success."""
    for stream in streams:
        try:
            await store.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


async def add_requests(store: Store, items: Sequence[tuple[str, bytes]]) -> list[str]:
    """XADD many entries in one round trip; returns their ids in order (one entry: the
    command alone, without a pipeline's own cost)."""
    if len(items) == 1:
        stream, payload = items[0]
        return [as_text(await store.xadd(stream, {FIELD: payload}))]
    pipe = pipeline(store)
    for stream, payload in items:
        pipe.xadd(stream, {FIELD: payload})
    return [as_text(entry_id) for entry_id in await pipe.execute()]


async def read_group(
    store: Store, consumer: str, streams: dict[str, str], *, count: int, block_ms: int | None
) -> list[StreamEntry]:
    """XREADGROUP; `>` for new entries, `0` for this consumer's own pending ones."""
    reply = await store.xreadgroup(GROUP, consumer, streams, count=count, block=block_ms)
    out: list[StreamEntry] = []
    for stream, items in reply or []:
        out.extend(entries_of(stream, items))
    return out


def id_order(entry_id: str) -> tuple[int, int]:
    """Stream ids order by number: as text, `5-10` would sort before `5-9`."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def complete(
    store: Store,
    replies: Sequence[tuple[str, bytes]],
    done: Sequence[tuple[str, str]],
    *,
    reply_maxlen: int,
    reply_ttl_s: int,
    expire: Iterable[str] | None = None,
) -> None:
    """Publish replies, then ack and delete the entries they answer, in one round trip.

    Replies go first so a crash between the two re-runs the entry (at-least-once) rather
    than acking an entry nobody answered. The reply streams in `expire` (default: all) get
    their time to live again, so a dead gateway's stream goes away on its own.
    """
    pipe = pipeline(store)
    for reply_to, payload in replies:
        pipe.xadd(reply_to, {FIELD: payload}, maxlen=reply_maxlen)
    for reply_to in {r for r, _ in replies} if expire is None else expire:
        pipe.expire(reply_to, reply_ttl_s)
    by_stream: dict[str, list[str]] = {}
    for stream, entry_id in done:
        by_stream.setdefault(stream, []).append(entry_id)
    for stream, ids in by_stream.items():  # one XACK and one XDEL per stream, not per entry
        pipe.xack(stream, GROUP, *ids)
        pipe.xdel(stream, *ids)
    await pipe.execute()


async def read_replies(
    store: Store,
    stream: str,
    last_id: str,
    *,
    count: int,
    block_ms: int | None,
    consumed: str | None = None,
) -> list[StreamEntry]:
    """Replies after `last_id`. With `consumed` (the last id its one reader has handled),
    everything up to it is deleted first, in the same round trip: a stream is a log, not a
    queue, and only its reader knows what it no longer needs (issue 34: answered replies
    held ~4 GB per gateway when trimmed by count alone)."""
    if consumed is None:
        reply = await store.xread({stream: last_id}, count=count, block=block_ms)
    else:
        pipe = pipeline(store)
        pipe.xtrim(stream, minid=_after(consumed), approximate=False)
        pipe.xread({stream: last_id}, count=count, block=block_ms)
        reply = (await pipe.execute())[-1]
    out: list[StreamEntry] = []
    for name, items in reply or []:
        out.extend(entries_of(name, items))
    return out


def _after(entry_id: str) -> str:
    """The smallest stream id above `entry_id`: XTRIM MINID keeps ids from it on."""
    ms, seq = id_order(entry_id)
    return f"{ms}-{seq + 1}"


async def added_and_held(store: Store, stream: str) -> tuple[int, int] | None:
    """Entries ever added to a stream, and those it holds now (XINFO STREAM); None where the
    stream is not there yet or the server does not count (the embedded store)."""
    try:
        info = await store.xinfo_stream(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():  # no stream yet: nothing written, nothing lost
            return None
        raise
    added = info.get("entries-added")
    return None if added is None else (int(added), int(info["length"]))


async def keep_alive(store: Store, keys: Keys, stream: str, ttl_s: int, now_ms: int) -> None:
    """A reply stream lives while its gateway does: its time to live set again, and the
    gateway's beat, by which workers tell whether anyone will read what they send there."""
    pipe = pipeline(store)
    pipe.expire(stream, ttl_s)
    pipe.zadd(keys.gateways, {stream: now_ms})
    await pipe.execute()


async def gateway_left(store: Store, keys: Keys, stream: str, now_ms: int) -> None:
    """A gateway stopping for good: its beat set an hour back, so every worker finds it
    gone at once and drops what it holds for it (the entry is forgotten within a day)."""
    await store.zadd(keys.gateways, {stream: now_ms - 3_600_000})


async def gone_gateways(store: Store, keys: Keys, now_ms: int, stale_ms: int) -> frozenset[str]:
    """Reply streams whose gateway left or has not beaten for `stale_ms`. A stream never
    seen beating (a gateway from before beats) is not among them: unknown is not gone.
    Entries a day past any use are forgotten on the way."""
    pipe = pipeline(store)
    pipe.zremrangebyscore(keys.gateways, "-inf", now_ms - 86_400_000)
    pipe.zrangebyscore(keys.gateways, 0, now_ms - stale_ms)
    return frozenset(as_text(name) for name in (await pipe.execute())[-1])


async def dead_letter(
    store: Store, stream: str, payload: bytes, *, now_ms: int, max_age_ms: int
) -> None:
    """Keep a dead letter; drop those older than `max_age_ms` (stream ids are their time)
    and any past the newest `DEAD_MAXLEN`: a dead letter holds a raw prompt."""
    pipe = pipeline(store)
    pipe.xadd(stream, {FIELD: payload}, maxlen=DEAD_MAXLEN)
    pipe.xtrim(stream, minid=f"{max(0, now_ms - max_age_ms)}-0", approximate=False)
    await pipe.execute()


async def register_model(
    store: Store, keys: Keys, name: str, info: bytes, sha: str, tok: str
) -> None:
    pipe = pipeline(store)
    pipe.set(keys.tokenizer(sha), tok)
    pipe.hset(keys.models, name, info)
    await pipe.execute()


async def heartbeat(
    store: Store,
    keys: Keys,
    model: str,
    consumer: str,
    now_ms: int,
    stale_ms: int,
    load: int | None = None,
) -> bool:
    """Record that this consumer's loop is alive (with its `load`, sequences held, when it
    reports one), and forget peers silent for long.

    Returns whether the model is still registered: False means Redis lost its data.
    """
    pipe = pipeline(store)
    # the wire version first: a worker seen live has said what it reads
    pipe.hset(keys.wire(model), consumer, str(VERSION))
    pipe.zadd(keys.workers(model), {consumer: now_ms})
    pipe.zremrangebyscore(keys.workers(model), 0, now_ms - 60 * stale_ms)
    if load is not None:
        pipe.hset(keys.load(model), consumer, f"{load} {now_ms}")
        pipe.hset(keys.laned_affinity(model), consumer, "1")  # renewed as a flush forgets it
    pipe.hexists(keys.models, model)
    return bool((await pipe.execute())[-1])


async def leave(store: Store, keys: Keys, model: str, consumer: str) -> None:
    """Leave the live set. A generation worker's load entry stays: it tells peers which
    affinity stream to drain until no gateway can still route there (`forget_affinity`)."""
    pipe = pipeline(store)
    pipe.zrem(keys.workers(model), consumer)
    pipe.hdel(keys.wire(model), consumer)
    await pipe.execute()


async def wire_versions(store: Store, keys: Keys, model: str, known: set[str]) -> dict[str, int]:
    """The newest wire version each worker of `model` said it reads (a worker of an older
    release says nothing); the entries of workers gone from the `known` set (the live set,
    stale members included) are deleted, as a worker that died without leaving leaves one."""
    versions = {as_text(k): int(v) for k, v in (await store.hgetall(keys.wire(model))).items()}
    gone = [name for name in versions if name not in known]
    if gone:
        await store.hdel(keys.wire(model), *gone)
    return {name: v for name, v in versions.items() if name in known}


async def record_cold_start(store: Store, keys: Keys, model: str, ms: int) -> None:
    await store.set(keys.cold_start(model), str(ms))


async def cold_start_ms(store: Store, keys: Keys, model: str) -> int | None:
    """The last measured start of a worker of `model`, None before any was measured."""
    raw = await store.get(keys.cold_start(model))
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


async def registered_models(store: Store, keys: Keys) -> dict[str, bytes]:
    rows = await store.hgetall(keys.models)
    return {as_text(name): bytes(info) for name, info in (rows or {}).items()}


async def load_tokenizer(store: Store, keys: Keys, sha: str) -> str | None:
    raw = await store.get(keys.tokenizer(sha))
    return None if raw is None else as_text(raw)


@dataclass(frozen=True, slots=True)
class GroupInfo:
    length: int  # XLEN: entries are deleted on ack, so waiting + in progress
    pending: int  # delivered to a worker, not yet acked
    lag: int | None  # not yet delivered; None when Redis cannot say (after trims, old servers)
    oldest_ms: int | None  # id time of the oldest entry still in the stream
    # XINFO GROUPS entries-read: a counter of entries delivered to the group (Redis 7+);
    # None when the store cannot say (burner-redis, older servers, after some deletions).
    entries_read: int | None = None


async def group_info(store: Store, stream: str) -> GroupInfo:
    """One stream's queue state as Redis reports it (XLEN, XINFO GROUPS, first entry)."""
    pipe = pipeline(store)
    pipe.xlen(stream)
    pipe.xrange(stream, "-", "+", count=1)
    length, first = await pipe.execute()
    try:
        groups = await store.xinfo_groups(stream)
    except ResponseError:  # "no such key": nothing was ever queued here
        groups = []
    group = next((g for g in groups if as_text(g["name"]) == GROUP), None)
    pending = int(group["pending"]) if group else 0
    lag = group.get("lag") if group else None
    read = group.get("entries-read") if group else None
    oldest = int(as_text(first[0][0]).split("-")[0]) if first else None
    return GroupInfo(
        int(length),
        pending,
        None if lag is None else int(lag),
        oldest,
        None if read is None else int(read),
    )


async def worker_beats(store: Store, keys: Keys, model: str) -> list[tuple[str, int]]:
    """Every consumer the registry remembers, with its last beat in epoch ms."""
    rows = await store.zrange(keys.workers(model), 0, -1, withscores=True)
    return [(as_text(name), int(score)) for name, score in rows or []]


async def stream_length(store: Store, stream: str) -> int:
    return int(await store.xlen(stream))


async def live_batching(store: Store, keys: Keys, model: str) -> dict[str, str]:
    rows = await store.hgetall(keys.batching(model))
    return {as_text(k): as_text(v) for k, v in (rows or {}).items()}


async def set_live_batching(store: Store, keys: Keys, model: str, values: dict[str, str]) -> None:
    """Replace the live overrides; an empty mapping returns workers to their own settings."""
    pipe = pipeline(store)
    pipe.delete(keys.batching(model))
    if values:
        pipe.hset(keys.batching(model), mapping=values)
    await pipe.execute()


async def cancel(store: Store, keys: Keys, model: str, ids: Sequence[str], until_ms: int) -> None:
    """Tell workers nobody waits for these entries any more (client gone, deadline passed)."""
    if ids:
        await store.zadd(keys.cancel(model), dict.fromkeys(ids, until_ms))


async def cancelled_among(
    store: Store, keys: Keys, model: str, entry_ids: Sequence[str], now_ms: int
) -> set[str]:
    """Which of these entries are cancelled, asked by id (`ZMSCORE`): the cost follows what a
    worker holds, not how many cancellations the set has (the set was read whole every
    poll: 35 ms at 100k ids). Expired cancellations are forgotten on the way; a
    cancellation only lives until its entry's deadline, which the operator caps."""
    pipe = pipeline(store)
    pipe.zremrangebyscore(keys.cancel(model), 0, now_ms)
    one_command = hasattr(pipe, "zmscore")  # the embedded store has ZSCORE only
    if entry_ids and one_command:
        pipe.zmscore(keys.cancel(model), list(entry_ids))
    elif entry_ids:
        for entry_id in entry_ids:
            pipe.zscore(keys.cancel(model), entry_id)
    answers = await pipe.execute()
    if not entry_ids:
        return set()
    scores = answers[1] if one_command else answers[1:]
    return {i for i, score in zip(entry_ids, scores, strict=True) if score is not None}
