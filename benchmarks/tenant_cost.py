"""What tenants cost on the queue path: wrk at 64 connections, 100 tenants configured vs off.

    .venv/bin/python benchmarks/tenant_cost.py                   # ~3 min on 2 cores

One redis-server, one `noop` worker (no compute: the queue path at hardware speed, as
`queue_path.py` measures it) and two gateways on it: one with a tenants file of `--tenants`
(100) tenants, each with a requests and a tokens quota far above the load (so every request
runs the quota script, announces its lane and is read from it), one with the same key as a
plain `api_keys` entry (tenants off). wrk sends single-input embedding requests over
`--connections` (64) for `--duration` s, to each gateway in turn, `--rounds` (5) times, the
order swapped each round (on, off, off, on, ...). Judged by the median of each round's
on/off ratio (the goal: >= 0.95): on a shared 2-core host whose speed drifts by 20% within
minutes, a round's two runs see the same host, and the ratio of the two sides' medians
(also printed) mixes rounds. Needs `wrk`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import parse_wrk
from benchmarks.fleet import host_cpu, need
from benchmarks.tenant_fleet import start_fleet

KEY = "sk-t0"


def _script(folder: Path) -> Path:
    script = folder / "single.lua"
    body = json.dumps({"model": "noop", "input": "a short text to embed"})
    script.write_text(
        f"wrk.method = 'POST'\nwrk.body = '{body}'\n"
        "wrk.headers['Content-Type'] = 'application/json'\n"
        f"wrk.headers['Authorization'] = 'Bearer {KEY}'\n"
    )
    return script


def _wrk(url: str, script: Path, connections: int, seconds: float) -> dict:
    args = [need("wrk"), "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency"]
    out = subprocess.run(
        [*args, "-s", str(script), f"{url}/v1/embeddings"], capture_output=True, text=True
    ).stdout
    return parse_wrk(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--no-quotas", action="store_true", help="tenants without quotas: the lanes' cost alone"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        quotas = {"requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000}
        tenants = {
            f"t{i}": {"api_keys": [f"sk-t{i}"], **({} if args.no_quotas else quotas)}
            for i in range(args.tenants)
        }
        path = folder / "tenants.json"
        path.write_text(json.dumps({"tenants": tenants}))
        urls = start_fleet(stack, folder, {"on": {"tenants": str(path)}, "off": {"api_keys": KEY}})
        script = _script(folder)
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for mode in urls:
            _wrk(urls[mode], script, args.connections, 2)  # warm: lanes found, caches full
        for round_ in range(args.rounds):
            modes = ["on", "off"] if round_ % 2 == 0 else ["off", "on"]  # ABBA: drift cancels
            for mode in modes:
                result = _wrk(urls[mode], script, args.connections, args.duration)
                rates[mode].append(result["requests_per_s"])
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    paired = statistics.median(a / b for a, b in zip(rates["on"], rates["off"], strict=True))
    result = {
        "host": host_cpu(),
        "tenants": args.tenants,
        "connections": args.connections,
        "requests_per_s": rates,
        "median_on": on,
        "median_off": off,
        "ratio_of_medians": round(on / off, 4),
        "ratio": round(paired, 4),
    }
    print(json.dumps(result, indent=2))
    verdict = "met" if result["ratio"] >= 0.95 else "NOT met"
    print(
        f"tenants on / off, req/s at {args.connections} connections, median of each round's "
        f"ratio: {result['ratio']} ({verdict}; ratio of the medians {result['ratio_of_medians']})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
