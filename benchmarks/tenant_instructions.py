"""What a tenant's request costs a gateway, in instructions: a count that no host noise moves.

    .venv/bin/python benchmarks/tenant_instructions.py [--requests 400]   # ~2.5 min

One redis-server and one `noop` worker run as always; each gateway (tenants `off`: the key as
a plain `api_keys` entry; `on`: a tenants file of 100 tenants, each with a requests and a
tokens quota far above the load, as `tenant_cost.py` configures them) runs alone under
valgrind's callgrind, counting only while told to (`callgrind_control`). Warmed by 200
requests (lanes found, leases grown), it counts 5 s idle (its background work's own rate),
then `--requests` single-input embedding requests from 64 concurrent clients; a request's
figure is the load's count less the background's over the load's duration, divided by the
requests. Judged beside `tenant_cost.py`, whose rates this host moves by more than the
effect (a busy loop alone on it swings 15% within a second): the ratio on / off of the
gateway's instructions per request. Instructions are not time (a regular expression's are
cheaper than a dict miss's), and what depends on timing still moves them (how many replies
one read brings, a lease's renewals): two runs of one tree gave 1.081 and 1.157. Needs
valgrind (apt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import env_with, free_port
from benchmarks.fleet import host_cpu, need, poll, start_redis
from benchmarks.queue_stack import ROOT, process, ready
from benchmarks.tenant_cost import KEY, many_tenants

IDLE_S = 5
WARM = 200


async def _load(url: str, requests: int, connections: int = 64) -> None:
    """`requests` embeddings of one short input, `connections` at a time; every one a 200."""
    gate = asyncio.Semaphore(connections)
    body = {"model": "noop", "input": "a short text to embed"}
    auth = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:

        async def one() -> None:
            async with gate:
                answer = await client.post(f"{url}/v1/embeddings", json=body, headers=auth)
                assert answer.status_code == 200, answer.text

        await asyncio.gather(*(one() for _ in range(requests)))


def _control(pid: int, *command: str) -> None:
    subprocess.run([need("callgrind_control"), *command, str(pid)], capture_output=True)


def _counted(dump: Path) -> int:
    """The instructions a callgrind dump holds."""
    found = re.search(r"^(?:summary|totals):\s+(\d+)", dump.read_text(errors="replace"), re.M)
    assert found, f"{dump} has no total"
    return int(found.group(1))


def _measure(folder: Path, mode: str, settings: dict, requests: int) -> dict:
    """One gateway under callgrind: its instructions per request, net of its background."""
    port, out = free_port(), folder / f"callgrind-{mode}.out"
    env = {**env_with(port=port, gateway_id=f"gw-{mode}", **settings), "PYTHONPATH": str(ROOT)}
    command = [need("valgrind"), "--tool=callgrind", "--instr-atstart=no"]
    command += [f"--callgrind-out-file={out}", sys.executable, "-m", "common.cli", "gateway"]
    with (folder / f"gw-{mode}.log").open("wb") as log:
        gateway = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: ready(url, "noop"), 900, f"gateway {mode} under valgrind")
        _control(gateway.pid, "-i", "on")
        asyncio.run(_load(url, WARM))
        _control(gateway.pid, "-z")
        time.sleep(IDLE_S)
        _control(gateway.pid, "-d")  # dump 1: the background alone
        _control(gateway.pid, "-z")
        started = time.monotonic()
        asyncio.run(_load(url, requests))
        took = time.monotonic() - started
        _control(gateway.pid, "-d")  # dump 2: the load
        poll(lambda: Path(f"{out}.2").exists(), 60, "the load's dump written")
    finally:
        os.killpg(gateway.pid, signal.SIGKILL)
        gateway.wait()
    background_per_s = _counted(Path(f"{out}.1")) / IDLE_S
    loaded = _counted(Path(f"{out}.2"))
    return {
        "instructions_per_request": round((loaded - background_per_s * took) / requests),
        "background_instructions_per_s": round(background_per_s),
        "load_s": round(took, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--no-quotas", action="store_true", help="tenants without quotas: the lanes' cost alone"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ["PYTHONHASHSEED"] = "0"  # both gateways lay out their dicts alike
    tenants = many_tenants(quotas=not args.no_quotas)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        (folder / "tenants.json").write_text(json.dumps({"tenants": tenants}))
        common = {"model": "noop", "redis_url": start_redis("single", stack, folder).url}
        common["max_queue_depth"] = 100_000
        worker = env_with(worker_id="w0", **common)
        stack.enter_context(process(ROOT, ["worker"], worker, folder / "w0.log"))
        sides = {"off": {"api_keys": KEY}, "on": {"tenants": str(folder / "tenants.json")}}
        result = {m: _measure(folder, m, {**common, **s}, args.requests) for m, s in sides.items()}
    on, off = (result[m]["instructions_per_request"] for m in ("on", "off"))
    result |= {"host": host_cpu(), "requests": args.requests, "quotas": not args.no_quotas}
    result["ratio"] = round(on / off, 4)
    print(json.dumps(result, indent=2))
    print(
        f"gateway instructions per request, tenants on / off: {result['ratio']} "
        f"({on:,} / {off:,}; {'met' if on / off <= 1.05 else 'NOT met'}: at most 1.05)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
