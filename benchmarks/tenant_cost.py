"""What tenants cost on the queue path: wrk at 64 connections, 100 tenants configured vs off.

    .venv/bin/python benchmarks/tenant_cost.py                   # ~5.5 min on 2 cores

A fleet is one redis-server, one `noop` worker (no compute: the queue path at hardware
speed, as `queue_path.py` measures it) and three gateways on it: `on`, with a tenants file
of `--tenants` (100) tenants, each with a requests and a tokens quota far above the load (so
every request runs the quota check, announces its lane and is read from it); `off`, with the
same key as a plain `api_keys` entry (tenants off); and `same`, a second `off`, the control.
wrk sends single-input embedding requests over `--connections` (64) for `--duration` (2) s
to each in turn, `--rounds` (6) times, each round in another of the six orders. A fleet's
figure is the median over its rounds of on against the mean of the two plain gateways; the
benchmark's, the median over `--fleets` (6) fleets, each started afresh (the goal: >= 0.95).
The control, same/off, says what two identical gateways differ by (1.0 but for the noise).

Why so: on a shared 2-core host the speed swings by 15% within a second (a busy loop timed in
half seconds, alone on it), so a turn is compared only within its round; and two identical
gateway processes differ by up to 8% for as long as they live (the control, fleet to fleet),
so one fleet's figure is one draw of that, and several fleets are needed (a fleet's processes
share a hash seed, the fleet's number: with one seed, the control's fleets spread over
0.95-1.00 in a run of four, against 0.90-1.10 in three runs without). It also prints each
side's CPU per request by role (its gateway, the worker, Redis; from /proc), which says where
a difference lands, and their sum's ratio (plain over tenants), the cost without the rates'
noise. Needs `wrk`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import parse_wrk
from benchmarks.fleet import cpu_seconds, host_cpu, need
from benchmarks.tenant_fleet import start_fleet
from tests.proc_tree import descendants

KEY = "sk-t0"


def many_tenants(count: int = 100, quotas: bool = True) -> dict[str, dict]:
    """`count` tenants (`KEY` is the first one's), each, with `quotas`, with a requests and a
    tokens quota far above any load here: every request is quota-checked, never refused."""
    limits = {"requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000}
    return {f"t{i}": {"api_keys": [f"sk-t{i}"], **(limits if quotas else {})} for i in range(count)}


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


def _roles() -> dict[str, list[int]]:
    """This run's processes by role: `gw-on`, `gw-off`, `worker`, `redis` (from /proc)."""
    roles: dict[str, list[int]] = {}
    for pid in descendants(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"redis-server" in a for a in argv):
            role = "redis"
        elif b"gateway" in argv:
            gid = next((e for e in env if e.startswith(b"MICROBATCH_GATEWAY_ID=")), b"=gw-?")
            role = gid.split(b"=", 1)[1].decode()
        elif b"worker" in argv:
            role = "worker"
        else:
            continue
        roles.setdefault(role, []).append(pid)
    return roles


MODES = ("on", "off", "same")
Rates = dict[str, list[float]]  # per gateway (or role), one figure a round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=int, default=2, help="seconds (wrk takes whole ones)")
    parser.add_argument("--rounds", type=int, default=6, help="per fleet")
    parser.add_argument("--fleets", type=int, default=6)
    parser.add_argument(
        "--no-quotas", action="store_true", help="tenants without quotas: the lanes' cost alone"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    fleets = []
    for number in range(args.fleets):
        # one hash seed for a fleet's processes, another for each fleet: the three gateways
        # lay out their dicts alike, which is part of what makes two identical ones differ
        os.environ["PYTHONHASHSEED"] = str(number)
        fleets.append(_fleet(args))
    result = _result(fleets, args)
    print(json.dumps(result, indent=2))
    verdict = "met" if result["ratio"] >= 0.95 else "NOT met"
    print(
        f"tenants on / off (two plain gateways), req/s at {args.connections} connections, "
        f"median over {args.fleets} fleets: {result['ratio']} ({verdict}; the fleets "
        f"{result['ratio_per_fleet']}); the control, same / off: {result['control']} "
        f"(the fleets {result['control_per_fleet']}); CPU per request, off / on: "
        f"{result['cpu_ratio']}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def _fleet(args: argparse.Namespace) -> tuple[Rates, dict[str, Rates]]:
    """One fleet started, measured and stopped: its rounds' rates, and CPU per request."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        tenants = many_tenants(args.tenants, quotas=not args.no_quotas)
        path = folder / "tenants.json"
        path.write_text(json.dumps({"tenants": tenants}))
        plain = {"api_keys": KEY}
        gateways = {"on": {"tenants": str(path)}, "off": plain, "same": plain}
        urls = start_fleet(stack, folder, gateways)
        return _measure(urls, _script(folder), args)


def _measure(
    urls: dict[str, str], script: Path, args: argparse.Namespace
) -> tuple[Rates, dict[str, Rates]]:
    """Each round's rate per gateway, and its CPU per request by role."""
    for mode in urls:
        _wrk(urls[mode], script, args.connections, 2)  # warm: lanes found, caches full
    roles = _roles()
    rates: Rates = {mode: [] for mode in MODES}
    cpu_us: dict[str, Rates] = {mode: {} for mode in MODES}
    orders = itertools.cycle(itertools.permutations(MODES))
    for _ in range(args.rounds):
        for mode in next(orders):  # every order as often: drift and position cancel
            before = {role: cpu_seconds(pids) for role, pids in roles.items()}
            idle_before = _machine_idle()
            result = _wrk(urls[mode], script, args.connections, args.duration)
            idle_after = _machine_idle()
            rates[mode].append(result["requests_per_s"])
            served = result["requests_per_s"] * args.duration
            for role, pids in roles.items():
                used = (cpu_seconds(pids) - before[role]) * 1e6 / served
                cpu_us[mode].setdefault(role, []).append(used)
            idle, total = (a - b for a, b in zip(idle_after, idle_before, strict=True))
            cpu_us[mode].setdefault("idle share", []).append(idle / max(1, total))
    return rates, cpu_us


def _machine_idle() -> tuple[int, int]:
    """The machine's idle and total CPU time so far, in ticks (/proc/stat): a side whose rate
    falls further than its CPU per request rises left the cores idle more."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return ticks[3] + ticks[4], sum(ticks)


def _result(fleets: list[tuple[Rates, dict[str, Rates]]], args: argparse.Namespace) -> dict:
    def by_fleet(rates: Rates) -> tuple[float, float]:
        plain = [(a + b) / 2 for a, b in zip(rates["off"], rates["same"], strict=True)]
        ratio = statistics.median(a / b for a, b in zip(rates["on"], plain, strict=True))
        control = statistics.median(a / b for a, b in zip(rates["same"], rates["off"], strict=True))
        return round(ratio, 4), round(control, 4)

    ratios, controls = zip(*(by_fleet(rates) for rates, _ in fleets), strict=True)
    cpu: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for _, by_mode in fleets:
        for mode, by_role in by_mode.items():
            for role, values in by_role.items():
                if role in ("worker", "redis", f"gw-{mode}", "idle share"):
                    cpu[mode].setdefault(role, []).extend(values)
    medians = {
        mode: {role: round(statistics.median(v), 3) for role, v in sorted(by_role.items())}
        for mode, by_role in cpu.items()
    }
    used = {
        mode: sum(v for role, v in by_role.items() if role != "idle share")
        for mode, by_role in medians.items()
    }
    return {
        "host": host_cpu(),
        "tenants": args.tenants,
        "quotas": not args.no_quotas,
        "connections": args.connections,
        "fleets": args.fleets,
        "rounds_per_fleet": args.rounds,
        "duration_s": args.duration,
        "requests_per_s": [rates for rates, _ in fleets],
        "ratio": round(statistics.median(ratios), 4),
        "ratio_per_fleet": list(ratios),
        "control": round(statistics.median(controls), 4),
        "control_per_fleet": list(controls),
        "cpu_us_per_request": medians,  # over every round; each side's own gateway
        # the CPU a request takes of the machine, plain over tenants: what the rates would
        # be were the 2 cores all the queue path's and the speed steady
        "cpu_ratio": round((used["off"] + used["same"]) / 2 / used["on"], 4),
    }


if __name__ == "__main__":
    main()
