"""The queue path at hardware speed: microbatch's own cost per input and per request, `noop` model.

    .venv/bin/python benchmarks/queue_path.py                       # ~3 min on 2 cores
    .venv/bin/python benchmarks/queue_path.py --baseline ../old     # and an older checkout

One redis-server, one gateway and one `noop` worker (no compute: zero vectors), all on this
machine with the load generator, as the queue-path issue measured them. For each code tree
(this checkout, and `--baseline DIR` if given: another checkout run the same way, side by
side in the same run) it measures:

- bulk: one request of `--bulk` (1,024) short inputs at a time, `--bulk-requests` of them
  after a warm-up, with `encoding_format` float and base64: median end-to-end ms, and us per
  input;
- Redis commands per input and per request of those bulk requests (INFO commandstats, the
  INFO calls themselves left out);
- wrk, single-input requests, `--connections` (64) for `--duration` s: requests/s and p50;
- wrk, one connection: the mean round trip, and Redis commands per request;
- `--processes 2` against 1 (where the tree has the option): wrk at 64 connections;
- the tokenizer alone on the bulk request's texts: the floor under the bulk rows;
- a worker alone draining `--drain-entries` one-text entries (`worker_drain.py`): its CPU per
  entry, which caps one worker's entries per second on any device;
- the same drain against a simulated device taking `--device-ms` (1) per batch (`noop` with
  `noop_compute_ms`, the GIL released, as a GPU forward is to the host): entries/s and the
  share of the time the device was busy, where the worker's own turn between batches shows
  as a device left idle;
- during the 64-connection run, CPU microseconds per request of the gateway, the worker and
  redis-server (/proc and INFO cpu): where a single-input request's cost goes.

Each figure is printed with its goal and the ratio to it; `--out` keeps the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import parse_wrk
from benchmarks.fleet import cpu_seconds, host_cpu, need, start_redis
from benchmarks.queue_stack import MODEL, ROOT, drain, stack, supports_processes
from benchmarks.redis_cost import wrk_script
from common.cli import loadgen

GOALS = {  # the queue-path issue's goal column
    "bulk_us_per_input_base64": ("<=", 20.0),
    "bulk_us_per_input_float": ("<=", 35.0),
    "bulk_redis_commands_per_input": ("<=", 0.05),
    "wrk64_requests_per_s": (">=", 5000.0),
    "wrk1_mean_ms": ("<=", 0.8),
}


def _commands(client: redis.Redis) -> Counter:
    stats = client.info("commandstats")
    return Counter(
        {
            k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in stats.items()
            if k not in ("cmdstat_info",)
        }
    )


def _bulk(
    url: str,
    client: redis.Redis,
    texts: list[str],
    fmt: str,
    n: int,
    model: str = MODEL,
    clients: int = 1,
) -> dict:
    """Bulk requests, `n` per client, `clients` at once; each client sends prepared bytes
    and reads the body without parsing it inside the timed part, so the figure is the
    server's and the wire's."""
    body = orjson.dumps({"model": model, "input": texts, "encoding_format": fmt})
    headers = {"Content-Type": "application/json"}

    def one_client(count: int) -> list[float]:
        times = []
        with httpx.Client(timeout=120) as http:
            for _ in range(count):
                t0 = time.perf_counter()
                response = http.post(f"{url}/v1/embeddings", content=body, headers=headers)
                times.append(time.perf_counter() - t0)
                response.raise_for_status()
        return times

    with httpx.Client(timeout=120) as http:
        for _ in range(3):  # warm-up: connections, caches, the cost model
            answer = http.post(f"{url}/v1/embeddings", content=body, headers=headers)
            answer.raise_for_status()
        assert len(orjson.loads(answer.content)["data"]) == len(texts)
    before = _commands(client)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        times = [t for ts in pool.map(one_client, [n] * clients) for t in ts]
    wall_s = time.perf_counter() - start
    calls = _commands(client) - before
    n = len(times)
    median_ms = statistics.median(times) * 1000
    return {
        "clients": clients,
        "median_ms": round(median_ms, 2),
        "us_per_input": round(median_ms * 1000 / len(texts), 2),
        "inputs_per_s": round(len(texts) * n / wall_s),
        "redis_commands_per_request": round(sum(calls.values()) / n, 2),
        "redis_commands_per_input": round(sum(calls.values()) / n / len(texts), 4),
        "by_command_per_request": {k: round(v / n, 2) for k, v in calls.most_common()},
    }


def _wrk(url: str, script: Path, connections: int, duration_s: float) -> dict:
    wrk = need("wrk")
    args = [wrk, "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "30s"]
    args += ["--latency", "-s", str(script), f"{url}/v1/embeddings"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=300).stdout
    parsed = parse_wrk(out)
    mean = re.search(r"Latency\s+([\d.]+)(us|ms|s)", out)
    if mean:
        parsed["mean_ms"] = float(mean.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean.group(2)]
    total = re.search(r"(\d+) requests in", out)
    parsed["requests"] = int(total.group(1)) if total else 0
    return parsed


def _single(
    url: str, client: redis.Redis, script: Path, connections: int, s: float, pids: dict
) -> dict:
    """wrk, single-input requests: its figures, Redis commands and each role's CPU (and
    Redis's own) in microseconds per request."""
    _wrk(url, script, connections, 1.0)  # warm-up
    before = _commands(client)
    cpu_before = {role: cpu_seconds(p) for role, p in pids.items()}
    redis_before = _redis_cpu(client)
    result = _wrk(url, script, connections, s)
    requests = max(1, result["requests"])
    result["cpu_us_per_request"] = {
        role: round((cpu_seconds(p) - cpu_before[role]) / requests * 1e6)
        for role, p in pids.items()
    }
    result["cpu_us_per_request"]["redis"] = round(
        (_redis_cpu(client) - redis_before) / requests * 1e6
    )
    calls = _commands(client) - before
    per_request = sum(calls.values()) / max(1, result["requests"])
    result["redis_commands_per_request"] = round(per_request, 2)
    return result


def tokenize_floor_us(texts: list[str]) -> float:
    """Microseconds per input of the gateway's own tokenizer call alone (the default model's
    tokenizer, which `noop` borrows; the Rust batch call), median of five: a floor under the
    bulk figures that no change to the queue path can remove."""
    from tokenizers import Tokenizer

    from worker.models import default_model_path

    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        tokenizer.encode_batch_fast(texts)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) / len(texts) * 1e6, 1)


def _redis_cpu(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def measure_tree(label: str, code: Path, args, redis_url: str, folder: Path) -> dict:
    client = redis.Redis.from_url(redis_url)
    texts = loadgen.workload("short", args.bulk)
    script = wrk_script({"model": args.model, "input": "a short text to embed"}, folder, "single")
    out: dict = {"code": str(code)}
    if args.drain_entries:
        client.flushall()
        out["drain"] = drain(code, redis_url, folder / f"{label}-drain", args.drain_entries)
        if args.device_ms:
            client.flushall()
            out["drain_device"] = drain(
                code, redis_url, folder / f"{label}-device", args.drain_entries, args.device_ms
            )
    client.flushall()
    with stack(code, redis_url, folder / label, 1, args.model, args.device) as (url, pids):
        for fmt in ("float", "base64"):
            out[f"bulk_{fmt}"] = _bulk(url, client, texts, fmt, args.bulk_requests, args.model)
        for clients in (int(c) for c in args.bulk_clients.split(",")):
            if clients > 1:
                out[f"bulk_base64_{clients}_clients"] = _bulk(
                    url, client, texts, "base64", args.bulk_requests, args.model, clients
                )
        if args.bulk_only:
            return out
        out["wrk64"] = _single(url, client, script, args.connections, args.duration, pids)
        out["wrk1"] = _single(url, client, script, 1, args.duration, pids)
    if supports_processes(code) and args.processes > 1 and not args.bulk_only:
        client.flushall()
        p_folder = folder / f"{label}-p"
        with stack(code, redis_url, p_folder, processes=args.processes) as (url, pids):
            out[f"wrk64_processes_{args.processes}"] = _single(
                url, client, script, args.connections, args.duration, pids
            )
    return out


def figures(result: dict) -> dict[str, float]:
    """The goal table's rows, from one tree's measurements."""
    rows = {
        "bulk_us_per_input_base64": result["bulk_base64"]["us_per_input"],
        "bulk_us_per_input_float": result["bulk_float"]["us_per_input"],
        "bulk_redis_commands_per_input": result["bulk_base64"]["redis_commands_per_input"],
        "wrk64_requests_per_s": result["wrk64"]["requests_per_s"],
        "wrk64_p50_ms": result["wrk64"]["p50_ms"],
        "wrk1_mean_ms": result["wrk1"].get("mean_ms", float("nan")),
        "wrk1_redis_commands_per_request": result["wrk1"]["redis_commands_per_request"],
    }
    if "worker_cpu_us_per_entry" in result.get("drain", {}):
        rows["drain_worker_cpu_us_per_entry"] = result["drain"]["worker_cpu_us_per_entry"]
    if "device_busy_share" in result.get("drain_device", {}):
        rows["drain_device_entries_per_s"] = result["drain_device"]["entries_per_s"]
        rows["drain_device_busy_share"] = result["drain_device"]["device_busy_share"]
    for role, us in result["wrk64"]["cpu_us_per_request"].items():
        rows[f"wrk64_{role}_cpu_us_per_request"] = us
    for key, value in result.items():
        if key.startswith("wrk64_processes_"):
            rows[f"{key}_requests_per_s"] = value["requests_per_s"]
            rows[f"{key}_over_1"] = round(value["requests_per_s"] / rows["wrk64_requests_per_s"], 2)
    return rows


def report(results: dict[str, dict]) -> None:
    labels = list(results)
    if "wrk64" not in results[labels[0]]:  # --bulk-only
        print(json.dumps(results, indent=2))
        return
    table = {label: figures(r) for label, r in results.items()}
    names = list(dict.fromkeys(k for t in table.values() for k in t))
    print(f"{'figure':<44}" + "".join(f"{label:>14}" for label in labels) + "   goal   met")
    for name in names:
        values = [table[label].get(name) for label in labels]
        cells = "".join(f"{v:>14.4g}" if v is not None else f"{'-':>14}" for v in values)
        goal = GOALS.get(name)
        verdict = ""
        if goal and values[0] is not None:
            op, target = goal
            met = values[0] <= target if op == "<=" else values[0] >= target
            ratio = values[0] / target
            verdict = f"  {op}{target:g}  {'yes' if met else 'no'} ({ratio:.2f}x of goal)"
        print(f"{name:<44}{cells}{verdict}")
    if len(labels) == 2:
        a, b = labels
        print(f"\nratios {a} / {b}:")
        for name in names:
            x, y = table[a].get(name), table[b].get(name)
            if x and y:
                print(f"  {name:<42}{x / y:>8.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout, measured the same way")
    parser.add_argument("--bulk", type=int, default=1024, help="inputs per bulk request")
    parser.add_argument("--bulk-requests", type=int, default=20)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--processes", type=int, default=2, help="gateway processes to compare")
    parser.add_argument("--out", type=Path, default=Path("/tmp/queue_path.json"))
    parser.add_argument("--model", default=MODEL, help="a real model for the bulk rows")
    parser.add_argument("--device", help="the worker's device (cuda on a GPU host)")
    parser.add_argument(
        "--bulk-clients", default="1", help="bulk requests at once, e.g. 1,4,16 (base64)"
    )
    parser.add_argument("--bulk-only", action="store_true", help="bulk rows only (no wrk)")
    parser.add_argument(
        "--device-ms", type=float, default=1.0, help="simulated device ms per batch (0: no row)"
    )
    parser.add_argument(
        "--drain-entries", type=int, default=20_000, help="one-text entries a worker drains (0: no)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    trees = {"this": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    print(f"host: {host_cpu()}, {os.cpu_count()} cores")
    results = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        deployment = start_redis("single", stack, folder)
        for label, code in trees.items():
            (folder / label).mkdir()
            (folder / f"{label}-p").mkdir()
            results[label] = measure_tree(label, code, args, deployment.url, folder)
            print(f"{label}: measured", flush=True)
    floor = tokenize_floor_us(loadgen.workload("short", args.bulk))
    print(f"tokenizing alone (the floor under the bulk rows): {floor} us per input")
    report(results)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": host_cpu(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "tokenize_us_per_input": floor,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
