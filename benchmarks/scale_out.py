"""The scale-out curve: workers of a fixed-latency model behind 1 and 2 gateways, on one
Redis and on a local 3-master Redis Cluster, loaded by wrk.

    .venv/bin/python benchmarks/scale_out.py --write-docs  # 1-16 workers, both kinds (~5 min)
    .venv/bin/python benchmarks/scale_out.py --quick       # 1, 2, 4 workers
    .venv/bin/python benchmarks/scale_out.py --redis cluster --workers 1,8 --gateways 1

The `noop` model with `noop_compute_ms` (100) per batch of `max_batch_size` (8) entries and
one batch at a time: 80 requests/s per worker, whatever the host, so the ideal curve is
80 x workers and a shortfall is the serving path's (gateway, Redis, the workers' own loops,
how the load is shared), not the model's. Workers are added to a running fleet (1 -> 2 -> 4
-> ...); at each count, each gateway count is loaded in turn: one wrk process per gateway,
`--per-worker` connections per worker in all (16: two batches per worker in flight, one
computing and one waiting), a `--warmup` run, then `--duration` seconds measured. While it
runs, the pending entries of each consumer (XINFO CONSUMERS, summed over the model's bucket
streams) are sampled four times a second; their per-worker means give the spread of the
load (max/min).

Printed: one row per point (req/s, p50/p99 as wrk measures them, the ratio to 1 worker in
the same series, pending per worker, the machine's busy share), then the issue's goals
judged from the same run. Written to `--out` (JSON), and with --write-docs to
docs/scale-out.md, docs/data/scale-out.json and docs/data/scale-out.png. With two gateways, req/s is
the sum of both wrk processes and p50/p99 the larger of the two.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import WRK_SCRIPT
from benchmarks.fleet import (
    MODEL,
    Fleet,
    cpu_busy_share,
    cpu_seconds,
    host_cpu,
    proc_stat,
    start_redis,
    wrk_all,
    wrk_results,
)
from benchmarks.scale_out_report import judge, render_markdown, render_plot, table
from common.streams import GROUP, Keys

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = (128, 256, 512)  # the default buckets: the workers read all three streams


class PendingSampler(threading.Thread):
    """Pending entries per consumer, summed over the model's bucket streams, every `period_s`
    until `until_s` (monotonic)."""

    def __init__(self, client, consumers: list[str], until_s: float, period_s: float = 0.25):
        super().__init__(daemon=True)
        self.client = client
        self.streams = [Keys("mb").request(MODEL, b) for b in BUCKETS]
        self.samples: dict[str, list[int]] = {c: [] for c in consumers}
        self.until_s = until_s
        self.period_s = period_s

    def sample(self) -> None:
        counts = dict.fromkeys(self.samples, 0)
        for stream in self.streams:
            try:
                consumers = self.client.xinfo_consumers(stream, GROUP)
            except redis.ResponseError:
                continue  # no group on this bucket yet
            for info in consumers:
                name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
                if name in counts:
                    counts[name] += int(info["pending"])
        for name, count in counts.items():
            self.samples[name].append(count)

    def run(self) -> None:
        while time.monotonic() < self.until_s:
            self.sample()
            time.sleep(self.period_s)

    def summary(self) -> dict:
        means = {c: sum(s) / len(s) for c, s in self.samples.items() if s}
        if not means:
            return {}
        low, high = min(means.values()), max(means.values())
        return {
            "per_worker_mean": {c: round(m, 1) for c, m in means.items()},
            "min": round(low, 1),
            "max": round(high, 1),
            "max_over_min": round(high / low, 2) if low > 0 else None,
        }


def measure_point(fleet: Fleet, workers: int, gateways: int, args, script: Path) -> dict:
    """Warm up, then load `gateways` gateways for `args.duration` s with the pending sampler on."""
    urls = fleet.gateways[:gateways]
    connections = args.per_worker * workers
    with wrk_all(urls, connections, args.warmup, script) as procs:
        wrk_results(procs)
    client = fleet.redis.client()
    start = time.monotonic()
    sampler = PendingSampler(client, fleet.workers[:workers], start + args.duration - 1.0)
    roles = {
        "gateways": fleet.pids["gateway"],
        "workers": fleet.pids["worker"][:workers],
        "redis": fleet.redis.pids,
    }
    cpu_before = {role: cpu_seconds(pids) for role, pids in roles.items()}
    busy_before, t0 = proc_stat(), time.monotonic()
    try:
        with wrk_all(urls, connections, args.duration, script) as procs:
            time.sleep(1.0)  # past the ramp: every worker has had its first reads
            sampler.start()
            results = wrk_results(procs)
        sampler.join()
    finally:
        client.close()
    elapsed = time.monotonic() - t0
    cores = {role: (cpu_seconds(pids) - cpu_before[role]) / elapsed for role, pids in roles.items()}
    return {
        "redis": fleet.redis.kind,
        "gateways": gateways,
        "workers": workers,
        "connections": connections,
        "requests_per_s": round(sum(r["requests_per_s"] for r in results), 1),
        "p50_ms": max(r["p50_ms"] for r in results),
        "p99_ms": max(r["p99_ms"] for r in results),
        "non_2xx": sum(r["non_2xx"] for r in results),
        "socket_errors": [r["socket_errors"] for r in results if r["socket_errors"] != "none"],
        "pending": sampler.summary(),
        "machine_busy": round(cpu_busy_share(busy_before, proc_stat()), 3),
        "cores": {role: round(value, 3) for role, value in cores.items()},
    }


def run_kind(kind: str, args, script: Path, folder: Path) -> list[dict]:
    """One Redis deployment, its gateways, and workers grown through `args.workers`."""
    rows = []
    worker_settings = {"noop_compute_ms": args.compute_ms, "max_batch_size": args.batch}
    with ExitStack() as stack:
        deployment = start_redis(kind, stack, folder)
        fleet = Fleet(deployment, stack, folder, worker_settings)
        fleet.grow_gateways(max(args.gateways))
        for workers in args.workers:
            fleet.grow_workers(workers)
            for gateways in args.gateways:
                rows.append(measure_point(fleet, workers, gateways, args, script))
                print(table(rows, header=len(rows) == 1, ideal=args.ideal), flush=True)
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1, 2, 4 workers only")
    p.add_argument("--redis", choices=["single", "cluster", "both"], default="both")
    p.add_argument("--workers", default="1,2,4,8,16", help="worker counts, ascending")
    p.add_argument("--cluster-workers", default="1,2,4,8", help="worker counts on the Cluster")
    p.add_argument("--gateways", default="1,2", help="gateway counts at each worker count")
    p.add_argument("--duration", type=float, default=8.0, help="seconds measured per point")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each")
    p.add_argument("--per-worker", type=int, default=16, help="wrk connections per worker")
    p.add_argument("--compute-ms", type=float, default=100.0, help="noop time per batch")
    p.add_argument("--batch", type=int, default=8, help="max_batch_size")
    p.add_argument("--write-docs", action="store_true", help="docs/scale-out.{md,json,png}")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "scale_out.json")
    args = p.parse_args()
    if args.quick:
        args.workers = args.cluster_workers = "1,2,4"
    args.workers = [int(w) for w in args.workers.split(",")]
    args.cluster_workers = [int(w) for w in args.cluster_workers.split(",")]
    args.gateways = [int(g) for g in args.gateways.split(",")]
    args.ideal = 1000 / args.compute_ms * args.batch  # requests/s one worker can serve
    return args


def main() -> None:
    args = parse_args()
    kinds = ["single", "cluster"] if args.redis == "both" else [args.redis]
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_SCRIPT)
        for kind in kinds:
            worker_counts = args.workers if kind == "single" else args.cluster_workers
            kind_args = argparse.Namespace(**{**vars(args), "workers": worker_counts})
            folder = Path(tmp) / kind
            folder.mkdir()
            rows += run_kind(kind, kind_args, script, folder)
    goals = judge(rows)
    print()
    print(table(rows, header=True, ideal=args.ideal))
    print()
    for line in goals:
        print(line["text"])
    argv = " ".join(sys.argv[1:])
    report = {
        "command": f".venv/bin/python benchmarks/scale_out.py {argv}".strip(),
        "started": started_at,
        "host_cpu": host_cpu(),
        "ideal_per_worker": args.ideal,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
        "goals": goals,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    if args.write_docs:
        docs = ROOT / "docs"
        (docs / "data").mkdir(exist_ok=True)
        (docs / "data" / "scale-out.json").write_text(json.dumps(report, indent=2, default=str))
        render_plot(report, docs / "data" / "scale-out.png")
        (docs / "scale-out.md").write_text(render_markdown(report))
        print("\nwritten: docs/scale-out.md, docs/data/scale-out.json, docs/data/scale-out.png")


if __name__ == "__main__":
    main()
