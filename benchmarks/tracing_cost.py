"""What tracing costs the queue path: single-input requests/s with tracing off, sampled at 1%,
10% and 100%, side by side in one run (`noop` model, as `queue_path.py` measures the path).

    .venv/bin/python benchmarks/tracing_cost.py                    # ~5 min on 2 cores
    .venv/bin/python benchmarks/tracing_cost.py --baseline ../old  # and an older checkout, off

One redis-server; for each mode its own gateway and `noop` worker, all up at once on key
prefixes of their own (tracing is configured at start, by the standard OTEL_* environment),
exporting OTLP/HTTP to a real receiver on loopback (tests/otlp_receiver.py, in this
process; it only keeps the bytes while wrk runs). wrk at `--connections` for `--duration`
s per run; the modes take turns for `--rounds` rounds, the order reversed every other
round, so drift in the host's speed falls on all of them alike. Printed: each mode's median
requests/s and p50, its ratio to tracing off (the issue's goals: 1% costs at most 3%, 100%
at most 15%), CPU per request of the gateway and the worker, and spans per request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fleet import host_cpu, start_redis
from benchmarks.queue_path import _single
from benchmarks.queue_stack import MODEL, ROOT, stack
from benchmarks.redis_cost import wrk_script
from tests.otlp_receiver import Receiver

GOALS = {"sampled_1pct": 0.97, "sampled_100pct": 0.85}  # requests/s over tracing off, at least


def modes(endpoint: str) -> dict[str, dict[str, str]]:
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}

    def ratio(share: str) -> dict[str, str]:
        sampler = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}
        return otlp | sampler | {"OTEL_TRACES_SAMPLER_ARG": share}

    return {
        "off": {},
        "sampled_1pct": ratio("0.01"),
        "sampled_10pct": ratio("0.1"),
        "sampled_100pct": otlp | {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
    }


def setups_of(args: argparse.Namespace, endpoint: str) -> list[tuple[str, Path, dict[str, str]]]:
    setups = [(name, ROOT, env) for name, env in modes(endpoint).items()]
    if args.baseline:  # the baseline has no tracing: only its "off" compares
        setups.append(("baseline_off", args.baseline.resolve(), {}))
    return setups


def run(args: argparse.Namespace, receiver: Receiver) -> dict:
    """Every mode's stack up at once (each on its own key prefix of one Redis), then wrk
    against each in turn, round after round, the order reversed every other round."""
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack_:
        folder = Path(tmp)
        deployment = start_redis("single", stack_, folder)
        client = redis.Redis.from_url(deployment.url)
        script = wrk_script({"model": MODEL, "input": "a short text to embed"}, folder, "one")
        stacks = {}
        for name, code, env in setups_of(args, receiver.endpoint):
            (folder / name).mkdir()
            env = env | {"MICROBATCH_PREFIX": name}
            stacks[name] = stack_.enter_context(stack(code, deployment.url, folder / name, env=env))
        for round_ in range(args.rounds):
            order = list(stacks) if round_ % 2 == 0 else list(reversed(stacks))
            for name in order:
                url, pids = stacks[name]
                spans_before = len(receiver.spans)
                result = _single(url, client, script, args.connections, args.duration, pids)
                result["spans"] = len(receiver.spans) - spans_before  # exported by now, mostly
                runs.setdefault(name, []).append(result)
                print(f"round {round_ + 1} {name}: {result['requests_per_s']:.0f} req/s")
    return runs


def call_counts(setups: list[tuple[str, Path, dict[str, str]]], endpoint: str) -> dict:
    """Python calls per request of each mode (`call_count.py`, in its own process with the
    tree's modules first): deterministic where requests/s on this host is not."""
    out = {}
    for name, code, env in setups:
        script = ROOT / "benchmarks" / "call_count.py"
        done = subprocess.run(
            [sys.executable, str(script), "--requests", "300"],
            env={**os.environ, **env, "PYTHONPATH": str(code)},
            cwd=code, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        out[name] = json.loads(done.stdout.splitlines()[-1])["calls_per_request"]
        print(f"{name}: {out[name]} calls per request")
    return out


def summary(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, results in runs.items():
        cpu = [r["cpu_us_per_request"] for r in results]
        out[name] = {
            "requests_per_s": statistics.median(r["requests_per_s"] for r in results),
            "p50_ms": statistics.median(r["p50_ms"] for r in results),
            "gateway_cpu_us": statistics.median(c["gateway"] for c in cpu),
            "worker_cpu_us": statistics.median(c["worker"] for c in cpu),
            "spans_per_request": statistics.median(
                r["spans"] / max(1, r["requests"]) for r in results
            ),
        }
    return out


def paired(runs: dict[str, list[dict]]) -> dict[str, float]:
    """Per mode, the median over rounds of its requests/s over tracing off's in the same
    round: runs next to each other share the host's speed of the moment, which on a shared
    host drifts by more than the effect measured."""
    off = [r["requests_per_s"] for r in runs["off"]]
    return {
        name: statistics.median(r["requests_per_s"] / o for r, o in zip(results, off, strict=True))
        for name, results in runs.items()
    }


def report(
    table: dict[str, dict[str, float]], ratios: dict[str, float], calls: dict[str, float]
) -> None:
    print(f"\n{'mode':<16}{'req/s':>9}{'p50 ms':>8}{'gw us':>8}{'wk us':>8}{'spans/req':>11}"
          f"{'calls':>8}{'ratio':>8}{'calls':>8}   goal on ratio")  # fmt: skip
    for name, row in table.items():
        ratio = ratios[name]
        goal = GOALS.get(name)
        verdict = f">= {goal:.2f}  {'met' if ratio >= goal else 'NOT met'}" if goal else ""
        # the same cost as a count of Python calls: off's over this mode's (throughput-like)
        by_calls = calls["off"] / calls[name]
        print(
            f"{name:<16}{row['requests_per_s']:>9.0f}{row['p50_ms']:>8.2f}"
            f"{row['gateway_cpu_us']:>8.0f}{row['worker_cpu_us']:>8.0f}"
            f"{row['spans_per_request']:>11.2f}{calls[name]:>8.0f}{ratio:>8.3f}{by_calls:>8.3f}"
            f"   {verdict}"
        )
    print(
        "ratio: median over rounds of req/s over off's in the same round; calls: Python calls"
        " per request (call_count.py), and off's over the mode's"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout: its 'off' beside ours")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--out", type=Path, default=Path("/tmp/tracing_cost.json"))
    args = parser.parse_args()
    print(f"host: {host_cpu()}, {os.cpu_count()} cores")
    receiver = Receiver()
    calls = call_counts(setups_of(args, receiver.endpoint), receiver.endpoint)
    runs = run(args, receiver)
    receiver.close()
    table, ratios = summary(runs), paired(runs)
    report(table, ratios, calls)
    record = {"host": host_cpu(), "runs": runs, "summary": table, "ratios": ratios,
              "calls_per_request": calls}  # fmt: skip
    args.out.write_text(json.dumps(record, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
