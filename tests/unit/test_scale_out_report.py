"""The scale-out benchmark judges each goal from the run's own rows, and says when it could not."""

from __future__ import annotations

from benchmarks.scale_out_report import judge, ratio_to_one, table_lines


def row(redis: str, gateways: int, workers: int, rps: float, pending: tuple[float, float]) -> dict:
    low, high = pending
    return {
        "redis": redis,
        "gateways": gateways,
        "workers": workers,
        "connections": 16 * workers,
        "requests_per_s": rps,
        "p50_ms": 200.0,
        "p99_ms": 300.0,
        "non_2xx": 0,
        "pending": {"min": low, "max": high, "max_over_min": high / low if low else None},
        "machine_busy": 0.5,
        "cores": {"gateways": 0.1, "workers": 0.2, "redis": 0.01},
    }


ROWS = [
    row("single", 1, 1, 80.0, (16, 16)),
    row("single", 2, 1, 40.0, (16, 16)),
    row("single", 1, 8, 600.0, (10, 30)),
    row("single", 2, 8, 600.0, (10, 30)),
    row("single", 1, 16, 1200.0, (12, 20)),
]


def test_a_ratio_is_taken_against_one_worker_of_the_same_series() -> None:
    assert ratio_to_one(ROWS, ROWS[2]) == 7.5
    assert ratio_to_one(ROWS, ROWS[3]) == 15.0  # the 2-gateway series has its own base


def test_each_goal_is_judged_or_marked_not_measured() -> None:
    goals = {g["goal"].split(":")[0]: g for g in judge(ROWS)}
    assert goals["8 workers / 1, single Redis, 1 gateway"]["met"] is True
    assert goals["16 workers / 1, single Redis, 1 gateway"]["met"] is True
    assert goals["8 workers / 1, cluster Redis, 1 gateway"]["met"] is None
    pending = next(g for name, g in goals.items() if name.startswith("pending"))
    assert pending["measured"] == 20 / 12 and pending["met"] is True  # the largest count: 16


def test_a_worker_with_nothing_pending_fails_the_spread_goal() -> None:
    rows = [row("single", 1, 1, 80.0, (16, 16)), row("single", 1, 2, 100.0, (0, 30))]
    assert judge(rows)[-1]["met"] is False


def test_the_table_has_one_line_per_row_under_its_header() -> None:
    lines = table_lines(ROWS, ideal=80.0)
    assert len(lines) == 2 + len(ROWS)
    assert "| single | 1 | 8 | 128 | 600.0 | 640 | 7.50x |" in lines[4]
