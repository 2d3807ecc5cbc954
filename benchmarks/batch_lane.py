"""The Batch API's background lane beside online traffic, side by side in one run.

    .venv/bin/python benchmarks/batch_lane.py              # ~5 min on 2 cores
    .venv/bin/python benchmarks/batch_lane.py --quick      # ~2 min: fewer lines, shorter loads

One redis-server, one all-MiniLM-L6-v2 worker and one gateway (processes of their own, as
deployed), loaded from this machine. One workload of short texts (8-48 tokens, fixed seed)
is both the online requests (one text each) and the batch's lines. Measured, in this order:

- offline limit: the batch's lines through the worker's own runner, sorted and batched as
  `benchmarks/embeddings.py`'s offline-limit arm does: what the hardware allows; and one
  text's forward alone, the smallest slice of work a background row can be;
- online alone: one client (wrk-free: one keep-alive connection) for p50, then 32 clients
  (wrk) for throughput;
- batch alone: `--lines` lines through files.create / batches.create, timed from creation to
  `completed`;
- online with a batch running: a fresh batch started and answering, then the same two
  loads; the batch's lines answered during each load are counted from its `request_counts`.

Judged by (issue 36): online 1-client p50 with a batch <= 1.2x without; online 32-client
throughput with a batch >= 0.9x without; the batch uses >= 80% of the capacity online
traffic leaves idle (lines/s during the load over batch-alone lines/s minus the online
texts/s); the batch alone >= 0.9 of the offline limit. Printed, and written to `--out`
(docs/data/batch-lane.json) with a plot beside it.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import embed_offline as offline  # noqa: E402
from benchmarks.embed_load import closed_loop, one_client, wrk_script  # noqa: E402
from benchmarks.embed_servers import microbatch_redis  # noqa: E402
from benchmarks.embed_workload import MODEL_NAME, load_tokenizer, make_workload  # noqa: E402
from benchmarks.fleet import cpu_busy_share, cpu_seconds, host_cpu, proc_stat  # noqa: E402

GOALS = {"p50": 1.2, "throughput": 0.9, "idle_use": 0.8, "of_offline": 0.9}


def client_for(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def start_batch(client, texts: list[str]) -> str:
    lines = (
        orjson.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"input": text, "model": MODEL_NAME},
            }
        )
        for i, text in enumerate(texts)
    )
    data = b"\n".join(lines)
    upload = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    ).id


def answered(client, batch_id: str) -> tuple[int, str]:
    batch = client.batches.retrieve(batch_id)
    return batch.request_counts.completed + batch.request_counts.failed, batch.status


def wait_answering(client, batch_id: str, at_least: int = 50) -> None:
    deadline = time.monotonic() + 120
    while answered(client, batch_id)[0] < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} answers nothing")
        time.sleep(0.1)


def role_pids(role: str) -> list[int]:
    """The processes of one microbatch role this benchmark started (`common.cli <role>`)."""
    found = subprocess.run(["pgrep", "-f", f"common.cli {role}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def batch_alone(client, texts: list[str]) -> dict:
    """Lines/s from creation to `completed`, and where the two cores went meanwhile: CPU
    ms per line of the gateway (which runs every line through its routes) and of the
    worker, and how busy the machine was."""
    gateway, worker = role_pids("gateway"), role_pids("worker")
    cpu0 = (cpu_seconds(gateway), cpu_seconds(worker), proc_stat())
    started = time.perf_counter()
    batch_id = start_batch(client, texts)
    while (state := answered(client, batch_id))[1] not in ("completed", "failed", "cancelled"):
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    lines = state[0]
    gateway_s, worker_s = cpu_seconds(gateway) - cpu0[0], cpu_seconds(worker) - cpu0[1]
    return {
        "lines": lines,
        "status": state[1],
        "seconds": elapsed,
        "lines_per_s": lines / elapsed,
        "gateway_cpu_ms_per_line": gateway_s / lines * 1000,
        "worker_cpu_ms_per_line": worker_s / lines * 1000,
        "machine_busy_share": cpu_busy_share(cpu0[2], proc_stat()),
    }


def online(server, workload, script: Path, duration_s: int) -> dict:
    single = one_client(server.port, workload, duration_s)
    loaded = closed_loop(server.url, script, 32, duration_s)
    return {
        "one_client_p50_ms": single["p50_ms"],
        "one_client_texts_per_s": single["texts_per_s"],
        "clients32_texts_per_s": loaded["texts_per_s"],
        "clients32_p50_ms": loaded["p50_ms"],
    }


def online_beside_batch(server, workload, script: Path, texts, duration_s: int) -> dict:
    """Each load against a fresh batch that is already answering; the batch's own lines/s
    during the load is read from its counts before and after."""
    client = client_for(server.url)
    figures: dict = {}
    for name, run in (
        ("one_client", lambda: one_client(server.port, workload, duration_s)),
        ("clients32", lambda: closed_loop(server.url, script, 32, duration_s)),
    ):
        batch_id = start_batch(client, texts)
        wait_answering(client, batch_id)
        before, t0 = answered(client, batch_id)[0], time.perf_counter()
        result = run()
        after, status = answered(client, batch_id)
        seconds = time.perf_counter() - t0
        if status == "completed":
            raise RuntimeError("the batch ran out during the load: give it more --lines")
        client.batches.cancel(batch_id)
        figures[f"{name}_p50_ms"] = result["p50_ms"]
        figures[f"{name}_texts_per_s"] = result["texts_per_s"]
        figures[f"{name}_batch_lines_per_s"] = (after - before) / seconds
        while answered(client, batch_id)[1] != "cancelled":
            time.sleep(0.2)
    return figures


def offline_limit(workload) -> dict:
    """The hardware's rate for these texts, and one text's own forward (median of 200, on
    every core): the least a background forward holds the model for, which an online
    request arriving meanwhile may wait out."""
    loaded = offline.load_runner()
    plan = offline.limit_plan(workload.tokens, 1.3, 16, 2048)
    run = offline.run_plan(loaded, workload, plan, offline.worker_parallelism())
    sample = make_sample(workload, 200)
    single = offline.run_plan(loaded, sample, offline.single_plan(sample.tokens))
    loaded.compute.shutdown()
    return {
        "texts_per_s": run.figures["texts_per_s"],
        "one_text_forward_ms": statistics.median(single.batch_seconds) * 1000,
    }


def make_sample(workload, n: int):
    from benchmarks.embed_workload import Workload

    return Workload(workload.mix, workload.texts[:n], workload.token_ids[:n])


def judge(limit: dict, alone: dict, batch: dict, beside: dict) -> dict:
    p50 = beside["one_client_p50_ms"] / alone["one_client_p50_ms"]
    throughput = beside["clients32_texts_per_s"] / alone["clients32_texts_per_s"]
    idle = batch["lines_per_s"] - beside["one_client_texts_per_s"]
    idle_use = beside["one_client_batch_lines_per_s"] / idle if idle > 0 else None
    return {
        "p50": p50,
        "throughput": throughput,
        "idle_use": idle_use,
        "of_offline": batch["lines_per_s"] / limit["texts_per_s"],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios, goals = result["ratios"], GOALS
    names = list(goals)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(names, [ratios[n] or 0 for n in names], color="#4c72b0")
    ax.scatter(names, [goals[n] for n in names], color="#c44e52", zorder=3, label="goal")
    ax.set_ylabel("ratio")
    ax.set_title(f"batch lane beside online traffic ({result['host']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lines", type=int, default=None)
    parser.add_argument("--duration", type=int, default=None, help="seconds per online load")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/data/batch-lane.json")
    parser.add_argument(
        "--batch-queue-depth", type=int, default=None, help="the gateway's batch_queue_depth"
    )
    args = parser.parse_args()
    lines = args.lines or (8000 if args.quick else 20_000)
    duration = args.duration or (8 if args.quick else 20)
    from worker.models import default_model_path

    tokenizer = load_tokenizer(default_model_path())
    workload = make_workload("short", lines, tokenizer)
    result: dict = {"host": host_cpu(), "lines": lines, "duration_s": duration}
    result["offline_limit"] = offline_limit(workload)
    print("offline limit", result["offline_limit"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        script = wrk_script(workload, Path(tmp))
        settings = {}
        if args.batch_queue_depth is not None:
            settings["batch_queue_depth"] = args.batch_queue_depth
            result["batch_queue_depth"] = args.batch_queue_depth
        with microbatch_redis("redis", Path(tmp), **settings) as server:
            client = client_for(server.url)
            online(server, workload, script, 3)  # warm-up: untimed
            result["online_alone"] = online(server, workload, script, duration)
            print("online alone", result["online_alone"], flush=True)
            result["batch_alone"] = batch_alone(client, workload.texts)
            print("batch alone", result["batch_alone"], flush=True)
            result["online_beside_batch"] = online_beside_batch(
                server, workload, script, workload.texts, duration
            )
            print("online beside a batch", result["online_beside_batch"], flush=True)
    result["ratios"] = judge(
        result["offline_limit"],
        result["online_alone"],
        result["batch_alone"],
        result["online_beside_batch"],
    )
    print(f"\nhost: {result['host']}")
    for name, goal in GOALS.items():
        value = result["ratios"][name]
        better = value is not None and (value <= goal if name == "p50" else value >= goal)
        shown = "n/a" if value is None else f"{value:.2f}"
        sign = "<=" if name == "p50" else ">="
        print(f"{name:12} {shown:>6}  goal {sign} {goal}  {'met' if better else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
