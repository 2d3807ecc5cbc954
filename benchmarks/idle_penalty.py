"""How much slower a lone text computes when the CPU was idle just before it: no server at all.

    .venv/bin/python benchmarks/idle_penalty.py                  # short texts, ~2 min
    .venv/bin/python benchmarks/idle_penalty.py --mix mixed --backend auto

At one client a server is idle between requests: the client must read the answer before it
sends the next text. The embedding benchmark's 1-client goal compares each latency with that
text's compute from `offline-single`, which runs the texts back to back. This measures, in
this process, the worker's own runner on a lone text (on the threads a worker gives a lone
batch) after an idle gap of 0, 2, 5 and 20 ms between texts, the gap spent either asleep (as
a server's threads are) or busy-waiting on the same thread (the core never idles). Gaps and
modes take turns, round after round, so host drift falls on all alike. It prints the median
compute per setting and its ratio to back to back: what an idle core costs the next forward
on this machine, apart from anything a server does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GAPS_MS = (0.0, 2.0, 5.0, 20.0)
MODES = ("sleep", "spin")


@dataclass(frozen=True, slots=True)
class Row:
    mode: str
    gap_ms: float
    median_ms: float
    vs_back_to_back: float


def summarize(times_ms: dict[tuple[str, float], list[float]]) -> list[Row]:
    """Median compute per (mode, gap) and its ratio to back to back (asleep, gap 0: with no
    gap the mode means nothing, so only that one is measured)."""
    reference = statistics.median(times_ms[(MODES[0], 0.0)])
    rows = [
        Row(mode, gap, statistics.median(times), statistics.median(times) / reference)
        for (mode, gap), times in times_ms.items()
    ]
    return sorted(rows, key=lambda r: (r.gap_ms, r.mode))


def idle(gap_s: float, mode: str) -> None:
    if mode == "sleep":
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def time_lone_texts(
    embed: Callable[[list], object], rows: Sequence, gap_s: float, mode: str
) -> list[float]:
    """Each row alone, after `gap_s` idle (asleep or spinning); compute ms per row."""
    out = []
    for row in rows:
        if gap_s:
            idle(gap_s, mode)
        started = time.perf_counter()
        embed([row])
        out.append((time.perf_counter() - started) * 1000)
    return out


def measure(backend: str, mix: str, texts: int, rounds: int) -> tuple[dict, int]:
    from benchmarks.embed_offline import load_runner, worker_parallelism
    from benchmarks.embed_workload import load_tokenizer, make_workload
    from worker.models import default_model_path

    loaded = load_runner(backend)
    threads = worker_parallelism().threads_for([], more_held=False)
    rows = make_workload(mix, texts, load_tokenizer(default_model_path()), seed=0).token_ids

    def embed(batch: list) -> object:
        return loaded.runner.embed(batch, threads=threads)

    def on_stream_0(gap_s: float, mode: str) -> list[float]:
        # the worker's own compute thread, as `offline-single` and a worker run it
        return loaded.compute.submit(0, time_lone_texts, embed, rows, gap_s, mode).result()

    on_stream_0(0.0, "sleep")  # warm-up, not counted
    times: dict[tuple[str, float], list[float]] = {}
    for _ in range(rounds):
        for gap_ms in GAPS_MS:
            for mode in MODES if gap_ms else MODES[:1]:
                times.setdefault((mode, gap_ms), []).extend(on_stream_0(gap_ms / 1000, mode))
    return times, threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "onnx", "auto"), default="torch")
    parser.add_argument("--mix", choices=("short", "mixed"), default="short")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    times, threads = measure(a.backend, a.mix, a.texts, a.rounds)
    print(
        f"lone {a.mix} texts, backend {a.backend}, {threads} thread(s), "
        f"{a.texts} texts x {a.rounds} interleaved rounds per setting"
    )
    print(f"{'idle gap before each text':<28} {'median compute':>15} {'/ back to back':>15}")
    for row in summarize(times):
        label = "none (back to back)" if row.gap_ms == 0 else f"{row.gap_ms:g} ms, {row.mode}"
        print(f"{label:<28} {row.median_ms:>12.2f} ms {row.vs_back_to_back:>15.2f}")


if __name__ == "__main__":
    main()
