"""What one worker's cancellation poll costs as the cancel set grows (issue 34, item 9).

    .venv/bin/python benchmarks/cancel_poll.py                  # ~20 s
    .venv/bin/python benchmarks/cancel_poll.py --held 256 --sizes 100000 400000

Clients that leave add their entries to the model's cancel set, where they stay until the
entry's deadline, and every worker polls the set every `cancel_poll_ms`. Side by side on one
redis-server, per set size: the poll as it was (expire, then read the whole set back) and as
it is (`streams.cancelled_among`: expire, then `ZMSCORE` of the `--held` entry ids the worker
holds). Prints each median over `--repeats` polls and the ratio it is judged by (old / new).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fleet import host_cpu, start_redis
from common import streams
from common.settings import Settings
from common.store import close_store, open_store

MODEL = "noop"


async def _whole_set(store, keys: streams.Keys, now_ms: int) -> set[str]:
    """The poll before: every unexpired id in the set, read back whole."""
    pipe = store.pipeline(transaction=False)
    pipe.zremrangebyscore(keys.cancel(MODEL), 0, now_ms)
    pipe.zrangebyscore(keys.cancel(MODEL), now_ms, "+inf")
    _, ids = await pipe.execute()
    return {i.decode() if isinstance(i, bytes) else i for i in ids}


async def _measure(url: str, sizes: list[int], held: int, repeats: int) -> list[dict]:
    store = open_store(Settings(redis_url=url, model=MODEL))
    keys = streams.Keys("mb")
    rows = []
    try:
        for size in sizes:
            await store.delete(keys.cancel(MODEL))
            future = int(time.time() * 1000) + 3_600_000
            for start in range(0, size, 10_000):
                ids = [f"r{i}.0" for i in range(start, min(size, start + 10_000))]
                await streams.cancel(store, keys, MODEL, ids, future)
            mine = [f"r{i}.0" for i in range(0, size, max(1, size // held))][:held]
            old, new = [], []
            for _ in range(repeats):
                now = int(time.time() * 1000)
                began = time.perf_counter()
                whole = await _whole_set(store, keys, now)
                old.append(time.perf_counter() - began)
                began = time.perf_counter()
                asked = await streams.cancelled_among(store, keys, MODEL, mine, now)
                new.append(time.perf_counter() - began)
                assert asked == whole & set(mine)  # the same answer about what is held
            rows.append(
                {
                    "size": size,
                    "whole_ms": statistics.median(old) * 1000,
                    "asked_ms": statistics.median(new) * 1000,
                }
            )
    finally:
        await close_store(store)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 400_000])
    parser.add_argument("--held", type=int, default=64, help="entries the worker holds")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        redis = start_redis("single", stack, Path(folder))
        rows = asyncio.run(_measure(redis.url, args.sizes, args.held, args.repeats))
    print(f"host: {host_cpu()}; {args.held} held entries; medians of {args.repeats} polls")
    print(f"{'cancel set':>12} {'whole-set read':>15} {'ZMSCORE held':>13} {'ratio':>7}")
    for row in rows:
        ratio = row["whole_ms"] / row["asked_ms"]
        print(
            f"{row['size']:>12,} {row['whole_ms']:>12.2f} ms {row['asked_ms']:>10.2f} ms"
            f" {ratio:>6.1f}x"
        )


if __name__ == "__main__":
    main()
