"""A tenant's tokens quota held across gateways: admitted tokens against the quota.

    .venv/bin/python benchmarks/tenant_quota.py                   # 2 minutes, ~3 min in all
    .venv/bin/python benchmarks/tenant_quota.py --seconds 30      # a shorter look

One redis-server, one `noop` worker and `--gateways` (3) gateway processes sharing a tenants
file whose tenant has `tokens_per_minute` (6,000). `--clients` (12) clients, spread over the
gateways, send embedding requests of a fixed text as fast as they can for `--seconds`
(120), never waiting out a 429. Printed: tokens admitted (from each 200's `usage`) against
the quota over the run (the goal: within 5%), the most admitted in any 60 s window, the
refusals, and whether every refusal was a 429 carrying `Retry-After`, `retry-after-ms` and
the `x-ratelimit-*-tokens` headers. `--out` keeps the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fleet import host_cpu
from benchmarks.tenant_fleet import start_fleet

KEY = "sk-bench"
HEADERS = [
    "Retry-After",
    "retry-after-ms",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
]
TEXT = " ".join(["quota"] * 40)


async def _client(url: str, until: float, seen: dict) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < until:
            sent = time.monotonic()
            answer = await http.post(
                f"{url}/v1/embeddings",
                json={"model": "noop", "input": TEXT},
                headers={"Authorization": f"Bearer {KEY}"},
            )
            if answer.status_code == 200:
                seen["admitted"].append((sent, answer.json()["usage"]["prompt_tokens"]))
            elif answer.status_code == 429:
                seen["refused"] += 1
                if any(h not in answer.headers for h in HEADERS):
                    seen["refused_without_headers"] += 1
            else:
                seen["other"][answer.status_code] = seen["other"].get(answer.status_code, 0) + 1


def _busiest_minute(admitted: list[tuple[float, int]]) -> int:
    """The most tokens admitted in any 60 s window (by the time each request was sent)."""
    admitted = sorted(admitted)
    best, total, start = 0, 0, 0
    for sent, tokens in admitted:
        total += tokens
        while admitted[start][0] < sent - 60:
            total -= admitted[start][1]
            start += 1
        best = max(best, total)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--tokens-per-minute", type=int, default=6000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    quota = args.tokens_per_minute
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        tenants = folder / "tenants.json"
        tenants.write_text(
            json.dumps({"tenants": {"bench": {"api_keys": [KEY], "tokens_per_minute": quota}}})
        )
        gateways = {str(i): {"tenants": str(tenants)} for i in range(args.gateways)}
        urls = list(start_fleet(stack, folder, gateways).values())
        seen: dict = {"admitted": [], "refused": 0, "refused_without_headers": 0, "other": {}}
        until = time.monotonic() + args.seconds

        async def run() -> None:
            clients = [_client(urls[i % len(urls)], until, seen) for i in range(args.clients)]
            await asyncio.gather(*clients)

        asyncio.run(run())
    admitted = sum(tokens for _, tokens in seen["admitted"])
    allowed = quota * args.seconds / 60
    result = {
        "host": host_cpu(),
        "gateways": args.gateways,
        "clients": args.clients,
        "seconds": args.seconds,
        "tokens_per_minute": quota,
        "tokens_per_request": seen["admitted"][0][1] if seen["admitted"] else None,
        "admitted_requests": len(seen["admitted"]),
        "admitted_tokens": admitted,
        "quota_over_run": allowed,
        "ratio": round(admitted / allowed, 4),
        "busiest_minute_tokens": _busiest_minute(seen["admitted"]),
        "refused_429": seen["refused"],
        "refused_without_headers": seen["refused_without_headers"],
        "other_statuses": seen["other"],
    }
    print(json.dumps(result, indent=2))
    verdict = "met" if abs(result["ratio"] - 1) <= 0.05 else "NOT met"
    ratio = result["ratio"]
    print(f"admitted {admitted} tokens of {allowed:.0f}: ratio {ratio} ({verdict}: within 5%)")
    clean = seen["refused_without_headers"] == 0 and not seen["other"]
    print(f"every refusal a 429 with the headers: {clean}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
