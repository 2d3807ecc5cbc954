"""Redis commands and Redis server CPU per request, single-input and bulk, from INFO deltas.

    .venv/bin/python benchmarks/redis_cost.py                    # ~40 s on 2 cores
    .venv/bin/python benchmarks/redis_cost.py --compute-ms 20    # fuller batches

One redis-server, one gateway, one `noop` worker (no compute by default, `max_batch_size`
`--batch`): the queue path alone. First an idle window (`--idle` s, everything started, no
requests): the background rate of commands and CPU (heartbeats, cancellation polls, blocked
reads waking). Then each workload (one short text per request; `--bulk` texts per request):
wrk at `--connections` for 2 s (warm-up) then `--duration` s, each followed by a wait until
the request streams are empty, with INFO commandstats and INFO cpu (used_cpu_user +
used_cpu_sys, the whole server process) read before and after. Requests are counted by
Redis itself (XINFO STREAM entries-added over the request streams, one entry per input), so
requests wrk stopped mid-flight count too. Printed per workload: commands per request and per
input (as measured, and net of the idle rate over the same seconds), by command; Redis CPU
microseconds per request and per input; XACK calls (one per batch) and so entries per
batch; gateway and worker CPU per request (/proc); and the request rate at which that
Redis CPU would fill one core. Written as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fleet import (
    MODEL,
    Fleet,
    cpu_seconds,
    host_cpu,
    poll,
    start_redis,
    wrk_all,
    wrk_results,
)
from common.streams import Keys

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = (128, 256, 512)  # the default buckets


def snapshot(client: redis.Redis) -> tuple[Counter, float, float]:
    """(calls by command, server CPU seconds, wall seconds) now; INFO's own calls left out."""
    stats = client.info("commandstats")
    calls = Counter(
        {
            name.removeprefix("cmdstat_"): int(value["calls"])
            for name, value in stats.items()
            if name != "cmdstat_info"
        }
    )
    cpu = client.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), time.monotonic()


def delta(before: tuple[Counter, float, float], after: tuple[Counter, float, float]) -> dict:
    calls = after[0] - before[0]
    return {"calls": dict(calls), "cpu_s": after[1] - before[1], "wall_s": after[2] - before[2]}


def wrk_script(body: dict, folder: Path, name: str) -> Path:
    script = folder / f"{name}.lua"
    payload = json.dumps(body).replace("\\", "\\\\").replace("'", "\\'")
    script.write_text(
        f"wrk.method = 'POST'\nwrk.body = '{payload}'\n"
        "wrk.headers['Content-Type'] = 'application/json'\n"
    )
    return script


def entries_added(client: redis.Redis) -> int:
    """Entries ever added to the model's request streams (XINFO STREAM entries-added)."""
    total = 0
    for bucket in BUCKETS:
        with contextlib.suppress(redis.ResponseError):  # a bucket stream not made yet
            total += int(client.xinfo_stream(Keys("mb").request(MODEL, bucket))["entries-added"])
    return total


def drained(client: redis.Redis) -> bool:
    streams = [Keys("mb").request(MODEL, bucket) for bucket in BUCKETS]
    return all(client.xlen(s) == 0 for s in streams if client.exists(s))


def per_unit(measured: dict, idle: dict, requests: int, inputs: int) -> dict:
    """The costs of one workload, as measured and net of the idle rate over its seconds."""
    idle_share = measured["wall_s"] / idle["wall_s"]
    total = sum(measured["calls"].values())
    idle_calls = sum(idle["calls"].values()) * idle_share
    net_cpu = measured["cpu_s"] - idle["cpu_s"] * idle_share
    by_command = sorted(measured["calls"].items(), key=lambda kv: -kv[1])
    return {
        "requests": requests,
        "inputs": inputs,
        "seconds": round(measured["wall_s"], 2),
        "requests_per_s": round(requests / measured["wall_s"], 1),
        "commands_per_request": round(total / requests, 2),
        "commands_per_request_net_of_idle": round((total - idle_calls) / requests, 2),
        "commands_per_input": round(total / inputs, 3),
        "by_command_per_request": {name: round(n / requests, 3) for name, n in by_command},
        "entries_per_batch": round(inputs / max(1, measured["calls"].get("xack", 0)), 1),
        "redis_cpu_us_per_request": round(measured["cpu_s"] / requests * 1e6, 1),
        "redis_cpu_us_per_request_net_of_idle": round(net_cpu / requests * 1e6, 1),
        "redis_cpu_us_per_input": round(measured["cpu_s"] / inputs * 1e6, 2),
        "requests_per_s_filling_one_redis_core": round(requests / max(net_cpu, 1e-9)),
    }


def run_workload(fleet: Fleet, client: redis.Redis, script: Path, args) -> dict:
    """wrk for `args.duration` s, then until the queue is empty; the deltas over both."""
    pids = {"gateway": fleet.pids["gateway"], "worker": fleet.pids["worker"]}
    cpu_before = {role: cpu_seconds(p) for role, p in pids.items()}
    added = entries_added(client)
    before = snapshot(client)
    with wrk_all(fleet.gateways[:1], args.connections, args.duration, script) as procs:
        answered = wrk_results(procs)[0]
    poll(lambda: drained(client), 30, "request streams empty")
    measured = delta(before, snapshot(client))
    measured["role_cpu_s"] = {role: cpu_seconds(p) - cpu_before[role] for role, p in pids.items()}
    measured["entries"] = entries_added(client) - added
    measured["wrk"] = answered
    return measured


def measure(args: argparse.Namespace, folder: Path) -> dict:
    workloads = {
        "single": ({"input": "a short text to embed", "model": MODEL}, 1),
        f"bulk-{args.bulk}": (
            {"input": [f"short text number {i}" for i in range(args.bulk)], "model": MODEL},
            args.bulk,
        ),
    }
    with ExitStack() as stack:
        deployment = start_redis("single", stack, folder)
        settings = {"noop_compute_ms": args.compute_ms, "max_batch_size": args.batch}
        fleet = Fleet(deployment, stack, folder, settings)
        fleet.grow_gateways(1)
        fleet.grow_workers(1)
        client = stack.enter_context(deployment.client())
        before = snapshot(client)
        time.sleep(args.idle)
        idle = delta(before, snapshot(client))
        results: dict = {"idle": {**idle, "cpu_share": round(idle["cpu_s"] / idle["wall_s"], 4)}}
        for name, (body, per) in workloads.items():
            script = wrk_script(body, folder, name)
            run_workload(fleet, client, script, argparse.Namespace(**{**vars(args), "duration": 2}))
            measured = run_workload(fleet, client, script, args)  # the first was a warm-up
            requests = measured["entries"] // per
            results[name] = per_unit(measured, idle, requests, measured["entries"])
            results[name]["wrk"] = measured["wrk"]
            results[name]["process_cpu_us_per_request"] = {
                role: round(s / requests * 1e6, 1) for role, s in measured["role_cpu_s"].items()
            }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of wrk per workload")
    p.add_argument("--connections", type=int, default=64, help="wrk connections")
    p.add_argument("--bulk", type=int, default=64, help="inputs per bulk request")
    p.add_argument("--batch", type=int, default=32, help="the worker's max_batch_size")
    p.add_argument("--compute-ms", type=float, default=0.0, help="noop time per batch")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of the idle window")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "redis_cost.json")
    args = p.parse_args()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args, Path(tmp))
    report = {
        "command": f".venv/bin/python benchmarks/redis_cost.py {' '.join(sys.argv[1:])}".strip(),
        "started": started,
        "host_cpu": host_cpu(),
        "redis_version": redis_version(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        **results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def redis_version() -> str:
    return subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout


if __name__ == "__main__":
    main()
