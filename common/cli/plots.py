"""PNG plots for `bench` (latency distribution, throughput over time) and `tune` (frontier)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from common.cli.loadgen import Sample


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def bench_plot(samples: Sequence[Sample], title: str, path: Path) -> None:
    plt = _pyplot()
    ok = [s for s in samples if s.status == 200]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    latencies = sorted(s.latency_s * 1000 for s in ok)
    if latencies:
        left.hist(latencies, bins=60, color="#3b7dd8")
        for q, style in ((0.5, "--"), (0.99, ":")):
            value = latencies[min(len(latencies) - 1, int(q * len(latencies)))]
            left.axvline(
                value, color="black", linestyle=style, label=f"p{int(q * 100)} {value:.1f} ms"
            )
        left.legend()
    left.set_xlabel("latency (ms)")
    left.set_ylabel("requests")
    left.set_title("latency distribution")
    if ok:
        seconds = int(max(s.start_s + s.latency_s for s in ok)) + 1
        done = [0] * seconds
        for s in ok:
            done[min(seconds - 1, int(s.start_s + s.latency_s))] += 1
        right.plot(range(seconds), done, color="#d8643b")
    right.set_xlabel("time (s)")
    right.set_ylabel("answers per second")
    right.set_title("throughput over time")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def frontier_plot(
    rows: Sequence[dict], best: dict | None, p99_target_ms: float, path: Path
) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    points = [r for r in rows if r["p99_ms"] is not None]
    ax.scatter(
        [r["p99_ms"] for r in points], [r["requests_per_s"] for r in points], color="#3b7dd8"
    )
    for r in points:
        ax.annotate(
            f"w{r['max_wait_ms']:g} b{r['max_batch_size']}",
            (r["p99_ms"], r["requests_per_s"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    frontier, best_rps = [], -1.0
    for r in sorted(points, key=lambda r: r["p99_ms"]):
        if r["requests_per_s"] > best_rps:
            frontier.append(r)
            best_rps = r["requests_per_s"]
    ax.plot(
        [r["p99_ms"] for r in frontier],
        [r["requests_per_s"] for r in frontier],
        color="#d8643b",
        label="frontier",
    )
    ax.axvline(
        p99_target_ms, color="grey", linestyle="--", label=f"p99 target {p99_target_ms:g} ms"
    )
    if best is not None:
        ax.scatter(
            [best["p99_ms"]],
            [best["requests_per_s"]],
            s=120,
            facecolors="none",
            edgecolors="green",
            label="best under target",
        )
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("requests per second")
    ax.set_title("throughput-latency frontier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
