"""Queue state per model and bucket, as Redis reports it: for `microbatch status` and the gauges."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from common import affinity_streams, lane_streams, metrics, streams
from common.clock import wall_ms
from common.protocol import ModelInfo, ModelKind, ProtocolError, decode
from common.store import Store


@dataclass(frozen=True, slots=True)
class BucketStatus:
    bucket: int
    depth: int  # waiting + in progress
    lag: int  # waiting: XINFO GROUPS lag, or depth - pending when Redis reports none
    lag_from_redis: bool
    pending: int
    oldest_age_s: float | None
    entries_read: int | None = None  # delivered to the group so far; None when Redis cannot say


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    name: str
    last_beat_age_s: float
    live: bool


@dataclass(frozen=True, slots=True)
class ModelStatus:
    model: str
    kind: str
    buckets: list[BucketStatus]
    dead_letters: int
    workers: list[WorkerStatus]
    lanes: dict[str, int] = field(default_factory=dict)  # per tenant lane: its depth
    # a generation model's prompts routed to the workers that cache their prefixes, waiting
    # in those workers' affinity streams (any length: bucket 0); None for other models
    affinity: BucketStatus | None = None

    @property
    def live_workers(self) -> int:
        return sum(w.live for w in self.workers)

    @property
    def queues(self) -> list[BucketStatus]:
        """Every queue of the model: its buckets, then its affinity streams when it has any."""
        return self.buckets if self.affinity is None else [*self.buckets, self.affinity]

    @property
    def depth(self) -> int:
        return sum(b.depth for b in self.queues)


AFFINITY = 0  # the bucket number that stands for a model's affinity streams


def queue_name(bucket: int) -> str:
    """A queue's name in the gauges and `microbatch status`: its bucket, or "affinity"."""
    return "affinity" if bucket == AFFINITY else str(bucket)


def bucket_status(bucket: int, info: streams.GroupInfo, now_ms: int) -> BucketStatus:
    """Lag falls back to depth - pending: entries are deleted on ack, so XLEN is exact. And
    it never exceeds that: after a restart from its append-only file, Redis 7.0 was seen
    reporting a lag of 1,469 on an empty stream (the soak), which admission took for a
    backlog and refused requests against."""
    waiting = max(0, info.length - info.pending)
    lag = waiting if info.lag is None else min(info.lag, waiting)
    age = None if info.oldest_ms is None else max(0.0, (now_ms - info.oldest_ms) / 1000)
    return BucketStatus(
        bucket, info.length, lag, info.lag is not None, info.pending, age, info.entries_read
    )


async def model_status(
    store: Store,
    keys: streams.Keys,
    name: str,
    kind: str,
    buckets: list[int],
    stale_ms: int,
    loads: Mapping[str, affinity_streams.WorkerLoad] | None = None,
) -> ModelStatus:
    """A model's queues as Redis holds them. `loads`: its generation workers' reported
    loads where the caller has read them already (they name the affinity streams)."""
    now_ms = wall_ms()
    rows = []
    tenants = await lane_streams.lane_tenants(store, keys, name)
    lanes = dict.fromkeys(tenants, 0)
    for bucket in buckets:
        info = await streams.group_info(store, keys.request(name, bucket))
        for tenant in tenants:  # a bucket's depth and lag count its lanes' too
            lane = await streams.group_info(store, keys.lane(name, bucket, tenant))
            lanes[tenant] += lane.length
            info = lane_streams.merged(info, lane)
        rows.append(bucket_status(bucket, info, now_ms))
    beats = await streams.worker_beats(store, keys, name)
    workers = [WorkerStatus(w, (now_ms - ms) / 1000, now_ms - ms <= stale_ms) for w, ms in beats]
    dead = await streams.stream_length(store, keys.dead(name))
    if kind != ModelKind.CAUSAL_LM:  # only generation workers have affinity streams
        affinity = None
    else:
        if loads is None:
            loads = await affinity_streams.worker_loads(store, keys, name)
        affinity = await _affinity_status(store, keys, name, sorted(loads), list(tenants), now_ms)
    return ModelStatus(name, kind, rows, dead, workers, lanes, affinity)


async def _affinity_status(
    store: Store,
    keys: streams.Keys,
    model: str,
    workers: list[str],
    tenants: list[str],
    now_ms: int,
) -> BucketStatus | None:
    """Every affinity stream of the model's generation workers (their own, and each tenant's)
    as one queue: prompts waiting there are work the bucket streams do not show, so without
    this the gauges, `microbatch status`, admission and KEDA would all miss them."""
    if not workers:
        return None
    info = streams.GroupInfo(0, 0, 0, None, 0)
    for worker in workers:
        for tenant in (None, *tenants):
            stream = await streams.group_info(store, keys.affinity(model, worker, tenant))
            if stream.length or stream.entries_read is not None:  # never written: nothing
                info = lane_streams.merged(info, stream)
    return bucket_status(AFFINITY, info, now_ms)


async def collect(
    store: Store, prefix: str, buckets: list[int], stale_ms: int
) -> list[ModelStatus]:
    keys = streams.Keys(prefix)
    out = []
    for name, raw in sorted((await streams.registered_models(store, keys)).items()):
        try:
            info = decode(raw)
        except ProtocolError:
            continue
        kind = info.kind if isinstance(info, ModelInfo) else "unknown"
        out.append(await model_status(store, keys, name, kind, buckets, stale_ms))
    return out


def export_gauges(models: list[ModelStatus]) -> None:
    """Set the queue gauges so they equal what Redis said at this refresh."""
    for model in models:
        metrics.workers.labels(model.model).set(model.live_workers)
        metrics.dead_letter_depth.labels(model.model).set(model.dead_letters)
        for b in model.queues:
            labels = (model.model, queue_name(b.bucket))
            metrics.queue_depth.labels(*labels).set(b.depth)
            metrics.queue_lag.labels(*labels).set(b.lag)
            metrics.queue_pending.labels(*labels).set(b.pending)


def to_json(models: list[ModelStatus]) -> list[dict]:
    return [{**asdict(m), "live_workers": m.live_workers, "depth": m.depth} for m in models]
