"""A rolling update, both ways round, for one wire step (issue 34, item 10).

Real redis-server and real processes of this release; the previous release's side is played
by its frozen wire codec (tests/wire/v6): what it writes is exactly what a process of that
release writes, and what it cannot read fails the test. An old gateway beside a new worker,
then a new gateway beside an old worker: every request answered, none waiting out its
deadline; a message neither side can read is answered 503 `version_mismatch` at once.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import msgpack
import numpy as np
import redis

from common.streams import FIELD, GROUP
from common.wire_compat import PREVIOUS, VERSION
from tests.conftest import Processes, wait_ready, wait_until
from tests.otlp_receiver import Receiver
from tests.wire.v6 import protocol_v6 as old

KEYS_PREFIX = "mb"
STREAM = f"{KEYS_PREFIX}:{{noop}}:req:128"
MODELS = f"{KEYS_PREFIX}:models"


def _registered(client: redis.Redis) -> bytes | None:
    return client.hget(MODELS, "noop")


def test_an_old_gateway_beside_a_new_worker(redis_url: str, processes: Processes) -> None:
    processes.start("worker", redis_url=redis_url, model="noop")
    client = redis.Redis.from_url(redis_url)
    try:
        info = wait_until(lambda: _registered(client), 120, "the new worker registered")
        assert old.decode(info).name == "noop"  # the old gateway's catalog reads it: no 404
        now = int(time.time() * 1000)
        reply_to = "mb:reply:old-gateway"
        for i in range(3):
            tokens, lengths = old.pack_rows([np.array([101, 7592 + i, 102], dtype=np.uint32)])
            entry = old.RequestEntry(
                id=f"old.{i}", request_id=f"r{i}", model="noop", tokens=tokens,
                lengths=lengths, deadline_ms=now + 30_000, priority=1, reply_to=reply_to,
                enqueued_ms=now,
            )  # fmt: skip
            client.xadd(STREAM, {FIELD: old.encode(entry)})
        read = wait_until(
            lambda: client.xrange(reply_to), 30, "3 replies", until=lambda r: len(r) == 3
        )
        replies = [old.decode(fields[FIELD.encode()]) for _, fields in read]  # the old reader
        assert sorted(r.id for r in replies) == ["old.0", "old.1", "old.2"]
        assert all(isinstance(r, old.EmbeddingResult) and r.rows == 1 for r in replies)
        # an entry of a version this worker cannot read (a gateway two releases ahead)
        future = msgpack.unpackb(old.encode(entry))
        client.xadd(STREAM, {FIELD: msgpack.packb({**future, "id": "new.0", "v": VERSION + 1})})
        read = wait_until(
            lambda: client.xrange(reply_to), 30, "its answer", until=lambda r: len(r) == 4
        )
        refused = old.decode(read[-1][1][FIELD.encode()])
        assert isinstance(refused, old.ErrorReply) and refused.id == "new.0"
        assert (refused.status, refused.code) == (503, "version_mismatch")
        assert client.xlen(STREAM) == 0  # acked and deleted, not dead-lettered
    finally:
        client.close()


class OldWorker:
    """The previous release's worker as the wire sees it: registers, beats, reads with the
    consumer group and answers, all in the old codec; `future` answers in a version newer
    than either."""

    def __init__(self, redis_url: str, info: bytes) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.info = info
        self.read: list[object] = []
        self.future = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = self.client
        # its own consumer group, as every release's worker makes at start: the new worker
        # stopped above may have registered and been stopped before it made one
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: it is there already
            client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        while not self.stop.is_set():
            client.hset(MODELS, "noop", self.info)
            client.zadd(f"{KEYS_PREFIX}:{{noop}}:workers", {"old-worker": int(time.time() * 1000)})
            got = client.xreadgroup(GROUP, "old-worker", {STREAM: ">"}, count=8, block=100)
            for _, items in got or []:
                for entry_id, fields in items:
                    entry = old.decode(fields[FIELD.encode()])  # must read the new gateway's
                    self.read.append(entry)
                    rows = len(entry.row_lengths())
                    answer = old.EmbeddingResult(
                        id=entry.id, embeddings=np.full(rows * 384, 0.25, "<f4").tobytes(),
                        rows=rows,
                        n_tokens=entry.n_tokens, batch_ids=["old:1"], batch_size=1,
                        bucket=128, queue_ms=0.0, compute_ms=1.0, worker="old-worker",
                    )  # fmt: skip
                    payload = old.encode(answer)
                    if self.future:
                        payload = msgpack.packb({**msgpack.unpackb(payload), "v": VERSION + 1})
                    client.xadd(entry.reply_to, {FIELD: payload})
                    client.xack(STREAM, GROUP, entry_id)
                    client.xdel(STREAM, entry_id)


def test_a_new_gateway_beside_an_old_worker(redis_url: str, processes: Processes) -> None:
    client = redis.Redis.from_url(redis_url)
    new = processes.start("worker", redis_url=redis_url, model="noop")
    info = wait_until(lambda: _registered(client), 120, "a registration to copy")
    new.signal(15)
    new.wait(30)
    # the old worker registers the same model as its release writes a registration
    fields = {k: v for k, v in old_fields(info).items() if k not in ("t", "v")}
    worker = OldWorker(redis_url, old.encode(old.ModelInfo(**fields)))
    worker.thread.start()
    receiver = Receiver()
    try:
        # tracing on, and a traced request: an old worker reads no trace context (wire 7),
        # so while one is live the gateway queues untraced entries, which it reads
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        gateway = processes.start("gateway", redis_url=redis_url, model="noop", env=otel)
        wait_ready(gateway)
        url = f"{gateway.base_url}/v1/embeddings"
        traced = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        answered = httpx.post(url, json={"input": ["a", "b"]}, headers=traced, timeout=30)
        assert answered.status_code == 200, answered.text
        assert answered.headers["traceparent"].split("-")[1] == traced["traceparent"][3:35]
        assert [d["embedding"][:2] for d in answered.json()["data"]] == [[0.25, 0.25]] * 2
        assert all(e.v == PREVIOUS for e in worker.read)  # written so the old one reads them
        worker.future = True
        started = time.monotonic()
        refused = httpx.post(
            url, json={"input": "c"}, headers={"X-Microbatch-Timeout-Ms": "20000"}, timeout=30
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "version_mismatch"
        assert time.monotonic() - started < 5  # at once, not at the 20 s deadline
    finally:
        worker.stop.set()
        worker.thread.join(10)
        client.close()
        processes.stop_all()  # before its collector goes: it would retry the export for seconds
        receiver.close()


def old_fields(info: bytes) -> dict:
    """A registration as this release wrote it, read back as plain fields."""
    return msgpack.unpackb(info)
