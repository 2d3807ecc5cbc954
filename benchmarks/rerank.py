"""Reranking throughput, side by side in one run: the offline ceiling, microbatch, infinity-emb.

    python -m benchmarks.rerank [--rounds 3] [--arms offline,microbatch,infinity]
                                [--dtype float32|bfloat16]

Model: a random-weight BERT cross-encoder of cross-encoder/ms-marco-MiniLM-L6-v2's shape
(6 layers, 384 hidden, 12 heads, its WordPiece vocabulary), written with a fixed seed: the
compute of the real one, with no download. Workload: requests of 1 query x 256 documents of
mixed length (fixed seed; pairs of 20 to 400 tokens, so every bucket), 8 requests in flight.

Arms:
  offline     the worker's own runner in this process: the same rows (the gateway's pair
              tokenizer), sorted by length, batched 32 at a time: the ceiling
  microbatch  redis-server + `microbatch worker` + `microbatch gateway`, POST /v1/rerank
  infinity    infinity-emb's own server on the same folder, POST /v1/rerank (its own venv,
              as in benchmarks/embeddings.py; skipped with the reason when absent)

Every arm runs in `--dtype` (microbatch's `dtype` setting, infinity's `--dtype`): float32,
the exact default, or bfloat16, several times faster on a CPU with AMX or on a GPU.

Judged by: microbatch pairs/s over offline pairs/s (goal >= 0.9) and over infinity's (>= 2).
Each arm is measured `--rounds` times (8 x 256 pairs each, after a warm-up); medians print.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import numpy as np

from benchmarks.embed_servers import ArmUnavailable, Server, infinity, microbatch_redis

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = 256
IN_FLIGHT = 8
MODEL = "reranker"
WORDS_TEXT = (
    "queue batch worker stream redis token bucket latency throughput model gateway request "
    "reply deadline priority padding mask attention layer vector score rank query document "
    "search answer cluster shard replica failover metric dashboard grafana kernel cache "
    "prefix block page memory compute thread core socket network client server python"
)
WORDS = WORDS_TEXT.split()


def write_model(folder: Path) -> Path:
    from worker.encode.tiny_classifier import write_tiny_classifier

    return write_tiny_classifier(folder, layers=6, hidden=384, heads=12, seed=0)


def workload(seed: int = 0) -> list[dict]:
    """IN_FLIGHT requests, each one query and DOCUMENTS documents of mixed length."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(IN_FLIGHT):
        query = " ".join(rng.choice(WORDS, size=8))
        lengths = np.clip(rng.lognormal(4.0, 0.8, size=DOCUMENTS), 10, 380).astype(int)
        docs = [" ".join(rng.choice(WORDS, size=int(n))) for n in lengths]
        bodies.append({"model": MODEL, "query": query, "documents": docs})
    return bodies


def offline_rounds(folder: Path, bodies: list[dict], rounds: int, dtype: str) -> list[float]:
    """Pairs/s of the worker's runner on the same rows, sorted by length, batches of 32."""
    from gateway.tokenize import ModelTokenizer
    from worker.encode.runners.classifier_runner import ClassifierRunner
    from worker.models import describe

    files = describe(str(folder))
    tokenizer = ModelTokenizer(files.tokenizer_json, max_tokens=512, vocab_size=files.vocab_size)
    rows = [
        row
        for b in bodies
        for row in tokenizer.encode_pairs([(b["query"], d) for d in b["documents"]], True)
    ]
    rows.sort(key=len)
    runner = ClassifierRunner(files, dtype=dtype)

    def once() -> float:
        start = time.perf_counter()
        for i in range(0, len(rows), 32):
            runner.embed(rows[i : i + 32])
        return len(rows) / (time.perf_counter() - start)

    once()  # warm-up
    return [once() for _ in range(rounds)]


async def served_round(url: str, bodies: list[dict]) -> tuple[float, list[float]]:
    """All bodies in flight at once: (pairs/s, each request's seconds)."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(body: dict) -> float:
            start = time.perf_counter()
            answer = await client.post(f"{url}/v1/rerank", json=body)
            if answer.status_code != 200:
                raise RuntimeError(f"{answer.status_code}: {answer.text[:300]}")
            if len(answer.json()["results"]) != len(body["documents"]):
                raise RuntimeError("an answer lacks results")
            return time.perf_counter() - start

        start = time.perf_counter()
        latencies = await asyncio.gather(*(one(b) for b in bodies))
        elapsed = time.perf_counter() - start
    return sum(len(b["documents"]) for b in bodies) / elapsed, list(latencies)


def served_rounds(server: Server, bodies: list[dict], rounds: int) -> tuple[list[float], float]:
    """Pairs/s per round and the median request latency over all rounds."""
    asyncio.run(served_round(server.url, bodies))  # warm-up
    rates, latencies = [], []
    for _ in range(rounds):
        rate, seconds = asyncio.run(served_round(server.url, bodies))
        rates.append(rate)
        latencies += seconds
    return rates, statistics.median(latencies)


def infinity_server(
    tmp: Path, folder: Path, venv: Path, dtype: str
) -> AbstractContextManager[Server]:
    return infinity("infinity", tmp, venv, folder, None, dtype=dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default="offline,microbatch,infinity")
    p.add_argument("--infinity-venv", type=Path, default=ROOT / ".bench" / "infinity-venv")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    arms = args.arms.split(",")
    bodies = workload()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mb-rerank-") as tmp_name:
        tmp = Path(tmp_name)
        folder = write_model(tmp / "ms-marco-MiniLM-L6-v2-shape")
        if "offline" in arms:
            rates = offline_rounds(folder, bodies, args.rounds, args.dtype)
            results["offline"] = {"rates": rates, "p50_s": None}
        servers: dict[str, Callable[[], Iterator[Server] | AbstractContextManager[Server]]] = {
            "microbatch": lambda: microbatch_redis(
                "microbatch", tmp, model=folder, served_model_name=MODEL, dtype=args.dtype
            ),
            "infinity": lambda: infinity_server(tmp, folder, args.infinity_venv, args.dtype),
        }
        for arm in (a for a in arms if a in servers):
            try:
                with servers[arm]() as server:  # type: ignore[union-attr]
                    rates, p50 = served_rounds(server, bodies, args.rounds)
                results[arm] = {"rates": rates, "p50_s": p50}
            except ArmUnavailable as exc:
                print(f"{arm}: not run: {exc}", file=sys.stderr)
    report(results, args.dtype)


def report(results: dict[str, dict], dtype: str) -> None:
    print(
        f"rerank: {IN_FLIGHT} requests in flight x 1 query x {DOCUMENTS} documents, "
        f"MiniLM-L6 cross-encoder shape, every arm in {dtype}"
    )
    print(f"{'arm':<12} {'pairs/s (median)':>17} {'rounds':>26} {'p50 request s':>14}")
    medians = {}
    for arm, r in results.items():
        medians[arm] = statistics.median(r["rates"])
        rounds = ", ".join(f"{x:.0f}" for x in r["rates"])
        p50 = "" if r["p50_s"] is None else f"{r['p50_s']:.2f}"
        print(f"{arm:<12} {medians[arm]:>17.0f} {rounds:>26} {p50:>14}")
    if "microbatch" in medians and "offline" in medians:
        ratio = medians["microbatch"] / medians["offline"]
        print(f"microbatch / offline ceiling = {ratio:.2f} (goal >= 0.9)")
    if "microbatch" in medians and "infinity" in medians:
        ratio = medians["microbatch"] / medians["infinity"]
        print(f"microbatch / infinity-emb = {ratio:.2f} (goal >= 2)")


if __name__ == "__main__":
    main()
