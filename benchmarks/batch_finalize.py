"""A batch's finalization, whole against paged: the gateway memory it takes to write the
output file of N results of S bytes each from Redis.

    .venv/bin/python benchmarks/batch_finalize.py                 # 20,000 x 8 KB, ~1 min
    .venv/bin/python benchmarks/batch_finalize.py --lines 50000

One redis-server; the results hash filled as batch lines fill it. `whole` is how the driver
finalized before (one HGETALL, the whole output assembled, then stored); `paged` is
`BatchRun._write_files` itself (a page of lines' results read, assembled and written at a
time). Printed: each side's peak of Python allocations (tracemalloc) and seconds, and the
ratio of the peaks, side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import tracemalloc
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fleet import host_cpu, start_redis
from common.keys import Keys
from common.settings import Settings
from common.store import close_store, open_store
from gateway.batch_lines import Line, assemble
from gateway.batch_records import BatchRecords
from gateway.batch_run import BatchRun, RunLimits
from gateway.files import RedisFiles, file_meta

BATCH = "batch_bench"


async def _fill(records: BatchRecords, lines: list[Line], size: int) -> None:
    body = b"x" * size
    for start in range(0, len(lines), 1000):
        await asyncio.gather(
            *(
                records.save_result(BATCH, line.custom_id, True, body)
                for line in lines[start : start + 1000]
            )
        )


async def _whole(store, keys: Keys, files: RedisFiles, lines: list[Line], done: dict) -> int:
    raw = await store.hgetall(keys.batch_results(BATCH))
    results = {k.decode(): v for k, v in raw.items()}
    output, _ = assemble(lines, results, done)
    await files.put(file_meta("file-wholeo", len(output), "o.jsonl", "batch_output", "o"), output)
    return len(output)


async def _paged(records: BatchRecords, files: RedisFiles, lines: list[Line], done: dict) -> int:
    limits = RunLimits(window=1, max_lines=len(lines), max_timeout_ms=1, output_ttl_s=3600)
    run = BatchRun(BATCH, records, files, None, None, limits, asyncio.Event(), None, None)  # type: ignore[arg-type]
    ids = await run._write_files(lines, dict(done), False, "o")
    return (await files.meta(ids["output_file_id"])).bytes  # type: ignore[union-attr]


async def _measure(side, *args) -> tuple[float, float, int]:
    tracemalloc.start()
    started = time.perf_counter()
    written = await side(*args)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20, seconds, written


async def main(args: argparse.Namespace, url: str) -> None:
    store, keys = open_store(Settings(redis_url=url)), Keys("mb")
    try:
        records, files = BatchRecords(store, keys), RedisFiles(store, keys)
        lines = [Line(i, f"line-{i}", b"{}", None) for i in range(args.lines)]
        await _fill(records, lines, args.bytes)
        done = await records.done(BATCH)
        whole = await _measure(_whole, store, keys, files, lines, done)
        paged = await _measure(_paged, records, files, lines, done)
    finally:
        await close_store(store)
    print(f"host: {host_cpu()}; {args.lines} results of {args.bytes} bytes")
    for name, (peak, seconds, written) in (("whole", whole), ("paged", paged)):
        print(
            f"{name:>6}: peak {peak:8.1f} MiB  {seconds:6.2f} s  output {written / 2**20:.1f} MiB"
        )
    print(f"peak paged / whole: {paged[0] / whole[0]:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--bytes", type=int, default=8192)
    parsed = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        redis = start_redis("single", stack, Path(tmp))
        asyncio.run(main(parsed, redis.url))
