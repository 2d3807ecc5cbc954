"""Where a batch's files live: the queue's Redis, a folder on disk, an S3 bucket, through the API.

    .venv/bin/python benchmarks/files_store.py            # ~1 min
    .venv/bin/python benchmarks/files_store.py --mb 50

One redis-server (no persistence) and one `microbatch gateway` per store (`files_store=redis`,
`disk`, then `s3`), no worker: a JSONL file of `--mb` MiB of embedding lines is uploaded with
the official client, read back whole, and deleted, `--repeat` times. Printed: median seconds
and MiB/s of each step, and the Redis server's `used_memory` growth per stored byte (a file
in Redis costs its size in memory until deleted or expired; in a bucket, a record). The s3
arm runs moto's S3 server (`moto[s3]` and flask, in the dev extra) on loopback: it keeps objects
in its own process memory, so its speed is moto's, not a real object store's.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.batching import env_with, free_port, microbatch, started  # noqa: E402
from benchmarks.embed_servers import wait_http  # noqa: E402
from benchmarks.fleet import host_cpu  # noqa: E402


def jsonl(mib: int) -> bytes:
    line = {
        "custom_id": "",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": "x" * 200},
    }
    out, i = [], 0
    size = 0
    while size < mib * 1024 * 1024:
        line["custom_id"] = f"l{i}"
        raw = orjson.dumps(line) + b"\n"
        out.append(raw)
        size += len(raw)
        i += 1
    return b"".join(out)


S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_s3(folder: Path) -> Iterator[str]:
    """moto's S3 server in a process of its own, with the bucket `bench`."""
    import boto3

    port = free_port()
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with started(args, env_with(), folder / "moto.log"):
        url = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=url, **_boto_keys())
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:  # not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url


def _boto_keys() -> dict[str, str]:
    return {
        "aws_access_key_id": S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def measure(url: str, data: bytes, repeat: int, r: redis.Redis | None) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    ups, downs, memory = [], [], []
    for _ in range(repeat):
        before = r.info("memory")["used_memory"] if r is not None else 0
        t0 = time.perf_counter()
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
        ups.append(time.perf_counter() - t0)
        if r is not None:
            memory.append((r.info("memory")["used_memory"] - before) / len(data))
        t0 = time.perf_counter()
        back = client.files.content(file_id).content
        downs.append(time.perf_counter() - t0)
        assert back == data
        client.files.delete(file_id)
    mib = len(data) / 1024 / 1024
    result = {
        "upload_s": statistics.median(ups),
        "upload_mib_per_s": mib / statistics.median(ups),
        "read_s": statistics.median(downs),
        "read_mib_per_s": mib / statistics.median(downs),
    }
    if memory:
        result["redis_bytes_per_file_byte"] = statistics.median(memory)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    data = jsonl(args.mb)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        rport = free_port()
        binary = shutil.which("redis-server") or "redis-server"
        args_redis = [binary, "--port", str(rport), "--save", "", "--appendonly", "no"]
        stack.enter_context(started(args_redis, env_with(), folder / "redis.log"))
        r = redis.Redis(port=rport)
        s3 = stack.enter_context(moto_s3(folder))
        for store in ("redis", "disk", "s3"):
            port = free_port()
            settings = {
                "redis_url": f"redis://127.0.0.1:{rport}/0",
                "port": port,
                "files_store": store,
                "files_dir": folder / "files",
                "max_file_bytes": (args.mb + 8) * 1024 * 1024,
                "files_s3_bucket": "bench",
                "files_s3_endpoint_url": s3,
            }
            log = folder / f"gateway-{store}.log"
            env = {**env_with(**settings), **S3_CREDENTIALS}
            with started(microbatch("gateway"), env, log) as proc:
                wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
                url = f"http://127.0.0.1:{port}"
                results[store] = measure(url, data, args.repeat, r)
    print(f"host: {host_cpu()}; file {len(data) / 1024 / 1024:.1f} MiB, median of {args.repeat}")
    for store, figures in results.items():
        shown = ", ".join(f"{k} {v:.3g}" for k, v in figures.items())
        print(f"{store:6} {shown}")


if __name__ == "__main__":
    main()
