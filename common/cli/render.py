"""Rich tables for the operator commands: queue status, a load run's summary, a tune sweep."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from common.status import queue_name


def status_table(models: list) -> Any:
    table = Table(title="microbatch queues")
    for column in ("model", "bucket", "depth", "lag", "pending", "oldest", "dead", "workers"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for m in models:
        workers = (
            ", ".join(
                f"{w.name} ({w.last_beat_age_s:.1f}s ago)" + ("" if w.live else " stale")
                for w in m.workers
            )
            or "none"
        )
        for i, b in enumerate(m.queues):
            oldest = "-" if b.oldest_age_s is None else f"{b.oldest_age_s:.1f}s"
            lag = str(b.lag) + ("" if b.lag_from_redis else "*")
            first = i == 0
            table.add_row(
                m.model if first else "",
                queue_name(b.bucket),
                str(b.depth),
                lag,
                str(b.pending),
                oldest,
                str(m.dead_letters) if first else "",
                workers if first else "",
            )
    table.caption = (
        "depth = waiting + in progress; * lag derived as depth - pending; "
        "affinity = prompts routed to the workers caching their prefixes"
    )
    return table


def tenants_table(models: list) -> Any:
    """Per model, each tenant's lane (a tenants file's tenants with traffic): its depth."""
    table = Table(title="microbatch tenants' lanes")
    for column in ("model", "tenant", "depth"):
        table.add_column(column, justify="right" if column == "depth" else "left")
    for m in models:
        for tenant, depth in sorted(m.lanes.items()):
            table.add_row(m.model, tenant, str(depth))
    table.caption = "depth = waiting + in progress in the tenant's lane, all buckets"
    return table


def batches_table(batches: list[dict]) -> Any:
    table = Table(title="microbatch batches (unfinished)")
    for column in (
        "batch",
        "endpoint",
        "status",
        "total",
        "answered",
        "failed",
        "pending",
        "driver",
    ):
        table.add_column(column, justify="left" if column in ("batch", "endpoint") else "right")
    for b in batches:
        counts = b["request_counts"]
        pending = counts["total"] - counts["completed"] - counts["failed"]
        table.add_row(
            b["id"],
            b["endpoint"],
            b["status"],
            str(counts["total"]),
            str(counts["completed"]),
            str(counts["failed"]),
            str(max(0, pending)),
            b["driver"] or "none (taken up within a lease)",
        )
    return table


def summary_table(title: str, summary: dict) -> Any:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    table = Table(title=title)
    for column in (
        "requests",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "errors",
        "mean batch",
        "padding",
    ):
        table.add_column(column, justify="right")
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors_by_status"].items()) or "none"
    padding = summary.get("padding_ratio")
    table.add_row(
        str(summary["requests"]),
        f"{summary['requests_per_s']:.1f}",
        ms(summary["p50_ms"]),
        ms(summary["p90_ms"]),
        ms(summary["p99_ms"]),
        ms(summary["max_ms"]),
        errors,
        "-" if summary["mean_batch_size"] is None else f"{summary['mean_batch_size']:.2f}",
        "-" if padding is None else f"{padding:.1%}",
    )
    return table


def tune_table(rows: list[dict], best: dict | None, p99_target_ms: float) -> Any:
    table = Table(title=f"tune: best throughput with p99 <= {p99_target_ms:g} ms marked *")
    for column in (
        "max_wait_ms",
        "max_batch_size",
        "req/s",
        "p50 ms",
        "p99 ms",
        "mean batch",
        "errors",
        "",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r['max_wait_ms']:g}",
            str(r["max_batch_size"]),
            f"{r['requests_per_s']:.1f}",
            f"{r['p50_ms'] or 0:.1f}",
            f"{r['p99_ms'] or 0:.1f}",
            f"{r['mean_batch_size'] or 0:.2f}",
            str(sum(r["errors_by_status"].values())),
            "*" if r is best else "",
        )
    return table
