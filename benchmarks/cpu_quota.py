"""Generation under a container's CPU limit: threads bounded by the quota, against one per core.

A Kubernetes CPU limit is a CFS quota: the worker sees every core, and torch used to start a
thread on each; the quota then throttles them, and OpenMP's barriers wait for the throttled
ones. Since worker/cores.py, a worker with `torch_threads` unset computes on as many threads
as the quota runs. This runs `microbatch serve` on a trained model inside a cgroup with a CPU
quota (`--quota` CPUs, below this host's cores), in both ways, in alternating order:

  before: torch_threads = this host's cores (what an unset worker did)
  after:  torch_threads unset (the quota decides)

and prints each arm's median tokens/s for one client and for eight at once, and the ratio
after / before (judged: above 1 means the quota-bound threads serve more).

  sudo .venv/bin/python benchmarks/cpu_quota.py [--quota 1] [--rounds 3]

Needs root (it makes a cgroup: v2, or v1's cpu controller) and a model folder
(../shared/models/fetch-trained.sh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import env_with, free_port, started, wait_ready

PERIOD_US = 100_000


@contextmanager
def quota_cgroup(cpus: float):
    """A cgroup whose CFS quota runs `cpus` CPUs; yields the file a pid is written to."""
    quota = int(cpus * PERIOD_US)
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # v2
        group = root / f"mb-quota-{os.getpid()}"
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        group = root / "cpu" / f"mb-quota-{os.getpid()}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    try:
        yield group / "cgroup.procs"
    finally:
        group.rmdir()


def tokens_per_s(url: str, clients: int, tokens: int) -> float:
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }

    def one(_: int) -> int:
        got = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        got.raise_for_status()
        return got.json()["usage"]["completion_tokens"]

    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(one, range(clients)))
    return done / (time.monotonic() - start)


def measure(arm: str, procs: Path, model: Path, tmp: Path, tokens: int) -> dict[str, float]:
    port = free_port()
    settings: dict[str, object] = {"model": model, "served_model_name": "smol", "port": port}
    if arm == "before":
        settings["torch_threads"] = len(os.sched_getaffinity(0))
    command = f"echo $$ > {procs} && exec {sys.executable} -m common.cli serve"
    with started(["sh", "-c", command], env_with(**settings), tmp / f"{arm}-{port}.log"):
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=600)
        tokens_per_s(url, 1, 8)  # warm: first shapes
        return {f"x{n}": tokens_per_s(url, n, tokens) for n in (1, 8)}


def main() -> None:
    default = Path("~/.cache/microbatch-models/smollm2-135m-instruct").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default)
    parser.add_argument("--quota", type=float, default=1.0, help="CPUs the cgroup runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run ../shared/models/fetch-trained.sh")
    cores = len(os.sched_getaffinity(0))
    if args.quota >= cores:
        sys.exit(f"--quota {args.quota} is not below this host's {cores} cores: nothing to show")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp, quota_cgroup(args.quota) as procs:
        for n in range(args.rounds):
            for arm in ("before", "after") if n % 2 == 0 else ("after", "before"):
                runs[arm].append(measure(arm, procs, args.model, Path(tmp), args.tokens))
                print(f"round {n} {arm}: {runs[arm][-1]}", flush=True)
    print(f"\nquota {args.quota} CPUs of {cores}; {args.tokens} tokens per request; tok/s medians")
    for load in ("x1", "x8"):
        before = statistics.median(r[load] for r in runs["before"])
        after = statistics.median(r[load] for r in runs["after"])
        print(f"{load}: before {before:.1f}  after {after:.1f}  after/before {after / before:.2f}")


if __name__ == "__main__":
    main()
