"""Workloads have the token lengths they promise; tune picks under the target."""

from __future__ import annotations

from tokenizers import Tokenizer

from common.cli.loadgen import MIXES, Sample, padding_from_metrics, summarize, workload
from common.cli.tune import best_under, grid
from worker.models import default_model_path


def token_counts(texts: list[str]) -> list[int]:
    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return [len(tok.encode(t).ids) for t in texts]


def test_short_texts_are_8_to_48_tokens() -> None:
    counts = token_counts(workload("short", 300, seed=1))
    assert min(counts) >= 8 and max(counts) <= 48


def test_the_mixed_workload_has_the_promised_shares() -> None:
    counts = token_counts(workload("mixed", 2000, seed=2))
    assert max(counts) <= 500
    shares = [
        sum(low <= c <= high for c in counts) / len(counts) for _, low, high in MIXES["mixed"]
    ]
    assert (
        abs(shares[0] - 0.60) < 0.05
        and abs(shares[1] - 0.25) < 0.05
        and abs(shares[2] - 0.15) < 0.05
    )


def test_a_workload_file_is_cycled(tmp_path) -> None:
    path = tmp_path / "texts.txt"
    path.write_text("one\n\ntwo\n")
    assert workload(str(path), 5) == ["one", "two", "one", "two", "one"]


def test_summary_counts_errors_by_status_and_percentiles_over_successes() -> None:
    samples = [Sample(0, i / 1000, 200, 4) for i in range(1, 101)] + [Sample(0, 9, 503, None)]
    summary = summarize(samples, elapsed_s=2.0)
    assert summary["ok"] == 100 and summary["requests_per_s"] == 50
    assert summary["errors_by_status"] == {"503": 1}
    assert summary["p50_ms"] == 51 and summary["p99_ms"] == 100 and summary["max_ms"] == 100
    assert summary["mean_batch_size"] == 4


def test_padding_is_read_across_every_label_set() -> None:
    text = (
        'microbatch_padding_ratio_sum{bucket="128",model="m"} 1.5\n'
        'microbatch_padding_ratio_count{bucket="128",model="m"} 3.0\n'
        'microbatch_padding_ratio_sum{bucket="256",model="m"} 0.5\n'
        'microbatch_padding_ratio_count{bucket="256",model="m"} 1.0\n'
    )
    assert padding_from_metrics(text) == (2.0, 4.0)


def test_tune_picks_the_fastest_setting_that_meets_the_target_without_errors() -> None:
    rows = [
        {
            "max_wait_ms": 0,
            "max_batch_size": 1,
            "requests_per_s": 50,
            "p99_ms": 20,
            "errors_by_status": {},
        },
        {
            "max_wait_ms": 5,
            "max_batch_size": 8,
            "requests_per_s": 90,
            "p99_ms": 80,
            "errors_by_status": {},
        },
        {
            "max_wait_ms": 20,
            "max_batch_size": 32,
            "requests_per_s": 120,
            "p99_ms": 300,
            "errors_by_status": {},
        },
        {
            "max_wait_ms": 5,
            "max_batch_size": 16,
            "requests_per_s": 95,
            "p99_ms": 90,
            "errors_by_status": {"503": 2},
        },
    ]
    assert best_under(rows, 100) is rows[1]
    assert best_under(rows, 10) is None


def test_tune_breaks_throughput_ties_by_the_lower_p99() -> None:
    rows = [
        {
            "max_wait_ms": 0,
            "max_batch_size": 8,
            "requests_per_s": 57.9,
            "p99_ms": 250,
            "errors_by_status": {},
        },
        {
            "max_wait_ms": 5,
            "max_batch_size": 16,
            "requests_per_s": 57.8,
            "p99_ms": 130,
            "errors_by_status": {},
        },
        {
            "max_wait_ms": 0,
            "max_batch_size": 1,
            "requests_per_s": 50.0,
            "p99_ms": 100,
            "errors_by_status": {},
        },
    ]
    assert best_under(rows, 500) is rows[1]


def test_the_grid_covers_every_pair() -> None:
    assert grid([0, 2.5], [1, 4]) == [
        {"max_wait_ms": "0", "max_batch_size": "1"},
        {"max_wait_ms": "0", "max_batch_size": "4"},
        {"max_wait_ms": "2.5", "max_batch_size": "1"},
        {"max_wait_ms": "2.5", "max_batch_size": "4"},
    ]
