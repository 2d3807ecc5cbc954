"""Fair shares between tenants where batches form: a noisy neighbour, weights, and the cost.

    .venv/bin/python benchmarks/tenant_fairness.py                # ~3 min on 2 cores
    .venv/bin/python benchmarks/tenant_fairness.py --seconds 10   # a shorter look

One redis-server, one `noop` worker whose simulated device takes `--batch-ms` (100) per batch
of at most `--batch-size` (4) rows (so the fleet serves under 40 rows/s however fast the
host is: on 2 cores shared with the load generator and the gateways, the worker, not the
HTTP path, must be what the tenants contend for), and two
gateways on it: one with a tenants file (tenants A and B), one with the
same keys as plain `api_keys` (tenants off: one FIFO queue, as before tenants). Closed-loop
clients send single-input embedding requests as fast as their answers come back, each
tenant's from a process of its own. Side by side in one run:

- share: A with 10x B's clients (`--b-clients`, 8), both backlogged: B's share of what the
  fleet served, tenants off (today: about its arrival share) and on (the goal: >= 0.45);
- latency: B alone at `--b-rate` (10) requests/s (open loop, below its share), then the same
  with A saturating the fleet: B's p50 against alone (the goal: <= 1.5x), tenants on;
- weights 3:1, both backlogged with equal clients: A's share (the goal: 0.75 within 10%);
- work conservation: A alone, tenants on against off (the goal: >= 0.95).

`--out` keeps the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fleet import host_cpu
from benchmarks.tenant_fleet import start_fleet

KEYS = {"A": "sk-a", "B": "sk-b"}


async def _timed(client: httpx.AsyncClient, key: str, served: list[float]) -> None:
    """One single-input request; its latency kept when it was answered."""
    sent = time.monotonic()
    answer = await client.post(
        "/v1/embeddings",
        json={"model": "noop", "input": "fair"},
        headers={"Authorization": f"Bearer {key}"},
    )
    if answer.status_code == 200:
        served.append(time.monotonic() - sent)


async def _closed(url: str, key: str, until: float, served: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < until:
            await _timed(client, key, served)


async def _open(url: str, key: str, rate: float, until: float, served: list[float]) -> None:
    """Requests at a fixed rate, whatever the answers do: the latency of each."""
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        start = time.monotonic()
        i = 0
        while time.monotonic() < until:
            tasks.append(asyncio.create_task(_timed(client, key, served)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)


def _closed_process(
    url: str, name: str, clients: int, seconds: float, out: multiprocessing.Queue
) -> None:
    served: list[float] = []
    until = time.monotonic() + seconds

    async def run() -> None:
        await asyncio.gather(*[_closed(url, KEYS[name], until, served) for _ in range(clients)])

    asyncio.run(run())
    out.put((name, served))


def closed(url: str, clients: dict[str, int], seconds: float) -> dict[str, list[float]]:
    """Each tenant's closed-loop clients in a process of its own, so one tenant's client
    load does not slow the other's sends: what differs is what the fleet serves them."""
    results: multiprocessing.Queue = multiprocessing.Queue()
    senders = [
        multiprocessing.Process(target=_closed_process, args=(url, name, n, seconds, results))
        for name, n in clients.items()
    ]
    for sender in senders:
        sender.start()
    served = dict(results.get(timeout=seconds + 120) for _ in senders)
    for sender in senders:
        sender.join()
    return served


def _b_open(url: str, rate: float, seconds: float, out: multiprocessing.Queue) -> None:
    """B's open loop in a process of its own: the clients of A, busy in the main process,
    must not delay its sends (a late sender catches up in a burst, and B's latency would be
    its own burst's)."""
    served: list[float] = []
    asyncio.run(_open(url, KEYS["B"], rate, time.monotonic() + seconds, served))
    out.put(served)


def b_latency(url: str, rate: float, a_clients: int, seconds: float) -> list[float]:
    results: multiprocessing.Queue = multiprocessing.Queue()
    sender = multiprocessing.Process(target=_b_open, args=(url, rate, seconds, results))
    sender.start()
    if a_clients:
        closed(url, {"A": a_clients}, seconds)
    served = results.get(timeout=seconds + 120)
    sender.join()
    return served


def share(served: dict[str, list[float]], name: str) -> float:
    total = sum(len(v) for v in served.values())
    return round(len(served[name]) / total, 4) if total else 0.0


def _tenants(path: Path, a_weight: float) -> None:
    tenants = {
        "A": {"api_keys": [KEYS["A"]], "weight": a_weight},
        "B": {"api_keys": [KEYS["B"]], "weight": 1},
    }
    path.write_text(json.dumps({"tenants": tenants}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--batch-ms", type=float, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--b-clients", type=int, default=8)
    parser.add_argument("--b-rate", type=float, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    s, b = args.seconds, args.b_clients
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        tenants = folder / "tenants.json"
        _tenants(tenants, 1)
        gateways = {"on": {"tenants": str(tenants)}, "off": {"api_keys": "sk-a,sk-b"}}
        urls = start_fleet(
            stack, folder, gateways, noop_compute_ms=args.batch_ms, max_batch_size=args.batch_size
        )
        closed(urls["on"], {"A": 2, "B": 2}, 3)  # lanes announced and found; warm
        result: dict = {"host": host_cpu(), "seconds": s, "batch_ms": args.batch_ms}
        for mode in ("off", "on"):  # A with 10x B's clients, both backlogged
            served = closed(urls[mode], {"A": 10 * b, "B": b}, s)
            result[f"noisy_{mode}"] = {
                "B_share": share(served, "B"),
                "served_per_s": round(sum(len(v) for v in served.values()) / s, 1),
            }
        alone = b_latency(urls["on"], args.b_rate, 0, s)
        crowded = b_latency(urls["on"], args.b_rate, 10 * b, s)
        result["b_latency"] = {
            "rate": args.b_rate,
            "alone_p50_ms": round(statistics.median(alone) * 1000, 1),
            "with_A_p50_ms": round(statistics.median(crowded) * 1000, 1),
        }
        result["b_latency"]["ratio"] = round(
            result["b_latency"]["with_A_p50_ms"] / result["b_latency"]["alone_p50_ms"], 3
        )
        on_alone = closed(urls["on"], {"A": 10 * b}, s)
        off_alone = closed(urls["off"], {"A": 10 * b}, s)
        result["work_conservation"] = round(len(on_alone["A"]) / len(off_alone["A"]), 4)
        _tenants(tenants, 3)
        time.sleep(7)  # the file read again, the new weight announced and found
        weighted = closed(urls["on"], {"A": 4 * b, "B": 4 * b}, s)
        result["weights_3_1_A_share"] = share(weighted, "A")
    print(json.dumps(result, indent=2))
    off, on = result["noisy_off"]["B_share"], result["noisy_on"]["B_share"]
    print(f"noisy neighbour: B's share {off} off, {on} on (>= 0.45)")
    print(f"B's p50 with A / alone: {result['b_latency']['ratio']} (<= 1.5)")
    print(f"weights 3:1: A's share {result['weights_3_1_A_share']} (0.75 within 10%)")
    print(f"work conservation: {result['work_conservation']} (>= 0.95)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
