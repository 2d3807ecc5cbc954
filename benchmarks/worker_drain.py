"""A worker's own CPU per single-text entry: a backlog drained by one `noop` worker, no gateway.

    PYTHONPATH=TREE .venv/bin/python benchmarks/worker_drain.py URL ENTRIES WORKER_PID [DEVICE_MS]

`benchmarks/queue_path.py` runs it for each tree it measures, with that tree's modules first
on the path, so the entries are written in that tree's own wire format. It waits for the
worker's consumer group, writes ENTRIES one-text entries (8 to 27 tokens) to the 128-token
stream in pipelines of 1,000, and waits until the worker has answered all of them. Printed
as JSON: the wall time and the worker's CPU (/proc) per entry. With no gateway and no HTTP
in the way, and full batches from the backlog, this is the figure that caps one worker's
entries per second on any device: 1 / CPU per entry.

DEVICE_MS, when the worker runs with `noop_compute_ms` (a simulated device that takes that
long per batch, the GIL released, as a GPU forward is to the host), adds the share of the
wall time the device was busy: batches (named by the replies) x DEVICE_MS / wall. What
the worker's own loop costs between batches shows there as a device left idle.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import redis

from common import streams
from common.protocol import EmbeddingResult, RequestEntry, decode, encode, pack_tokens
from common.settings import Settings

REPLY = "mb:reply:worker-drain"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def answered(client: redis.Redis) -> int:
    try:
        return int(client.xinfo_stream(REPLY)["entries-added"])
    except redis.ResponseError:  # no reply yet: the stream does not exist
        return 0


def main() -> None:
    url, n, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device_ms = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    client = redis.Redis.from_url(url)
    stream = streams.Keys(Settings().prefix).request("noop", 128)
    deadline = time.monotonic() + 60
    while not _has_group(client, stream):
        if time.monotonic() > deadline:
            raise SystemExit("the worker made no consumer group within 60 s")
        time.sleep(0.1)
    now = int(time.time() * 1000)
    payloads = [encode(_entry(i, now)) for i in range(n)]
    cpu0, t0 = cpu_s(pid), time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, payload in enumerate(payloads, 1):
        pipe.xadd(stream, {streams.FIELD: payload})
        if i % 1000 == 0 or i == n:
            pipe.execute()
    while answered(client) < n:
        if time.perf_counter() - t0 > 300:
            raise SystemExit(f"only {answered(client)} of {n} entries answered in 300 s")
        time.sleep(0.01)
    wall_s, cpu = time.perf_counter() - t0, cpu_s(pid) - cpu0
    out = {
        "entries": n,
        "wall_s": round(wall_s, 3),
        "entries_per_s": round(n / wall_s),
        "worker_cpu_us_per_entry": round(cpu / n * 1e6, 1),
    }
    if device_ms:
        batches = batches_answered(client)
        out["batches"] = batches
        out["device_busy_share"] = round(batches * device_ms / 1000 / wall_s, 3)
    print(json.dumps(out))


def batches_answered(client: redis.Redis) -> int:
    """Batches the worker ran: its batch ids count up from 0 ("worker:N"), and the newest
    replies name the last (the reply stream is trimmed, so older replies may be gone)."""
    last = -1
    for _, fields in client.xrevrange(REPLY, "+", "-", count=200):
        reply = decode(fields[streams.FIELD.encode()])
        if isinstance(reply, EmbeddingResult):
            last = max([last, *(int(b.rsplit(":", 1)[1]) for b in reply.batch_ids)])
    return last + 1


def _has_group(client: redis.Redis, stream: str) -> bool:
    try:
        return bool(client.xinfo_groups(stream))
    except redis.ResponseError:
        return False


def _entry(i: int, now_ms: int) -> RequestEntry:
    ids = list(range(101, 109 + i % 20))
    return RequestEntry(
        id=f"drain.{i}",
        request_id="",
        model="noop",
        tokens=pack_tokens(ids),
        lengths=pack_tokens([len(ids)]),
        deadline_ms=now_ms + 600_000,
        priority=1,
        reply_to=REPLY,
        enqueued_ms=now_ms,
    )


if __name__ == "__main__":
    main()
