"""`Services`: the gateway process's collaborators, built once per app and shared by routes.

The catalog, the reply router, the enqueuer, the canceller, the tokenizer pool and the rate
limiter live here, on `app.state.services`; the request path reads them, never a global.
"""

from __future__ import annotations

import asyncio
import itertools
import os

from opentelemetry.trace import Tracer

from common import metrics, streams, tenants
from common.buckets import bucket_for
from common.errors import ServiceUnavailable
from common.protocol import ModelInfo, ModelKind
from common.settings import Settings
from common.store import Store
from common.tasks import OnDeath
from gateway.admission import PerModelMean
from gateway.affinity import AffinityRouter, names_of
from gateway.auth import RateLimiter, authenticate
from gateway.backlog_store import Backlogs
from gateway.batch_records import BatchRecords
from gateway.catalog import Catalog
from gateway.enqueue import Enqueuer
from gateway.files import DiskFiles, FileStore, RedisFiles
from gateway.lanes import Lanes
from gateway.quota_store import Quotas
from gateway.replies import ReplyRouter
from gateway.responses.finisher import Finisher
from gateway.responses.store import ResponseStore
from gateway.tokenize import TokenizePool
from gateway.waiting import Canceller


class Services:
    def __init__(self, settings: Settings, store: Store, tracer: Tracer | None = None) -> None:
        self.settings = settings
        self.store = store
        self.tracer = tracer  # None: tracing is off, and the request path does none of it
        self.id = settings.process_id("gateway")
        self.keys = streams.Keys(settings.prefix)
        self.catalog = Catalog(store, settings)
        self.router = ReplyRouter(
            store,
            self.keys.reply(self.id),
            block_ms=settings.read_block_ms,
            ttl_s=max(60, 2 * settings.request_timeout_ms // 1000),
            keys=self.keys,
        )
        self.enqueuer = Enqueuer(store)
        self.entry_rows = PerModelMean(default=1.0)  # rows per request entry
        self.sequence_tokens = PerModelMean(default=None)  # prompt + max_tokens per sequence
        self.canceller = Canceller(store, self.keys)
        self.tokenize = TokenizePool(settings.inline_tokenize_chars)
        self.limiter = (
            RateLimiter(settings.rate_limit_per_key, settings.rate_limit_burst)
            if settings.rate_limit_per_key > 0
            else None
        )
        self.affinity = (
            AffinityRouter(settings.affinity_max_imbalance)
            if settings.cache_aware_routing
            else None
        )
        if self.affinity is not None:
            self.catalog.on_loads = self.affinity.update_loads
        self.files = open_files(settings, store, self.keys)
        self.batch_records = BatchRecords(store, self.keys)
        # the CLI refused a bad file before anything started; here it is read for use
        self.tenants = tenants.load(settings.tenants) if settings.tenants else tenants.NO_TENANTS
        self.quotas = Quotas(store, self.keys, settings.quota_on_redis_error)
        self.lanes, self.backlogs = Lanes(store, self.keys), Backlogs(store, self.keys)
        self.responses = ResponseStore(store, self.keys)
        ttls = settings.response_ttl_s, settings.response_events_ttl_s
        cancel, release = self.canceller.cancel, self.backlogs.release
        self.finisher = Finisher(self.responses, cancel, *ttls, release, self.quotas.settle)
        self.batches_changed = asyncio.Event()  # a batch created or cancelled here: look now
        self.stop = asyncio.Event()
        self.batches_stop = asyncio.Event()  # set first on shutdown: hand batches back
        self.alive = True  # false once a background task died: /healthz fails, requests 503
        self._nonce = os.urandom(4).hex()
        self._counter = itertools.count()

    def authenticate(self, authorization: str | None) -> tuple[str | None, str | None]:
        """The caller's key and its tenant, by the keys and the tenants file in force now
        (401 when neither holds it): every route that checks a key asks here."""
        tenants = self.tenants if self.settings.tenants else None
        return authenticate(authorization, self.settings.api_keys, tenants)

    def next_id(self) -> str:
        return f"{self._nonce}{next(self._counter):x}"

    def request_stream(self, model: str, n_tokens: int, lane: str | None = None) -> str:
        """The stream an input of `n_tokens` goes to: its length bucket's (prompts past the
        largest bucket share it), or that bucket's in the tenant's `lane`."""
        buckets = self.settings.buckets
        bucket = bucket_for(n_tokens, buckets) or buckets[-1]
        return (
            self.keys.request(model, bucket)
            if lane is None
            else self.keys.lane(model, bucket, lane)
        )

    def affinity_names(
        self, info: ModelInfo, prompt: list[int], session: str | None
    ) -> list[bytes]:
        """What a prompt is routed and remembered by; nothing when routing ignores it."""
        if self.affinity is None or info.kind != ModelKind.CAUSAL_LM:
            return []
        return names_of(prompt, info.name, session)

    def generation_stream(
        self,
        model: str,
        n_tokens: int,
        names: list[bytes],
        known: str | None = None,
        lane: str | None = None,
    ) -> tuple[str, str | None]:
        """The stream of the worker caching this prompt's prefix, if one is live and not
        overloaded (and that worker), in the tenant's `lane` where that worker reads one;
        else its length bucket's (in the tenant's `lane`), which any worker reads."""
        router = self.affinity
        worker = router.route(model, names, known) if router and names else None
        if names:
            metrics.affinity_routes_total.labels(model, "affine" if worker else "shared").inc()
        if worker is None or router is None:
            return self.request_stream(model, n_tokens, lane), None
        laned = lane if lane is not None and router.reads_lanes(model, worker) else None
        return self.keys.affinity(model, worker, laned), worker

    def routes_answered(self, model: str, workers: list[str | None]) -> None:
        """The prompts routed to `workers` are answered or failed: their load is gone."""
        if self.affinity is not None:
            for worker in workers:
                if worker is not None:
                    self.affinity.answered(model, worker)

    def learn_route(self, names: list[bytes], worker: str) -> None:
        if self.affinity is not None and names:
            self.affinity.learn(names, worker)

    def on_death_of(self, task: str) -> OnDeath:
        """What happens when `task` (the reply reader, the catalog) ends before the gateway
        stops: every waiter fails now, not at its deadline, and /healthz fails for a restart."""

        def died(exc: BaseException | None) -> None:
            if not self.batches_stop.is_set():  # set first when the gateway stops
                self.alive = False
                error = ServiceUnavailable(f"gateway {task} died", retry_after_s=1.0)
                self.router.fail_all(error)

        return died


def open_files(settings: Settings, store: Store, keys: streams.Keys) -> FileStore:
    """Files in the queue's Redis when there is one (any gateway reads any file), else on
    disk: the embedded store lives in process memory; or, asked for, in an object store."""
    where = settings.files_store
    if where == "auto":
        where = "disk" if settings.embedded else "redis"
    if where == "s3":
        from gateway.s3_files import S3Files, s3_client

        client = s3_client(settings)
        return S3Files(store, keys, client, settings.files_s3_bucket, settings.files_s3_prefix)
    return DiskFiles(settings.files_dir) if where == "disk" else RedisFiles(store, keys)
