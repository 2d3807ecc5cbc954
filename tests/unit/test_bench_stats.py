"""How the embedding benchmark merges interleaved rounds into the figures it reports."""

from __future__ import annotations

import json

from benchmarks.embed_docs import compact_json
from benchmarks.embed_stats import median_of


def _round(serve: float, limit: float, per_text: list[float]) -> dict:
    return {
        "serve": {"short": {"c32": {"texts_per_s": serve, "errors": {}, "label": "x"}}},
        "offline-single": {"short": {"offline": {"text_compute_ms": per_text}}},
        "offline-limit": {"short": {"offline": {"texts_per_s": limit}}},
    }


def test_a_median_of_three_rounds_drops_the_round_the_host_slowed_down() -> None:
    rounds = [
        _round(147.0, 201.0, [10.0, 20.0]),
        _round(70.0, 183.0, [30.0, 40.0]),  # the slow round
        _round(150.0, 190.0, [11.0, 21.0]),
    ]
    merged = median_of(rounds)
    serve = merged["serve"]["short"]["c32"]
    assert serve["texts_per_s"] == 147.0
    assert serve["runs_texts_per_s"] == [147.0, 70.0, 150.0]
    assert serve["label"] == "x" and serve["errors"] == {}
    assert merged["offline-limit"]["short"]["offline"]["texts_per_s"] == 190.0
    per_text = merged["offline-single"]["short"]["offline"]["text_compute_ms"]
    assert per_text == [11.0, 21.0]  # item by item, not the first round's list


def test_an_arm_that_failed_in_one_round_keeps_the_others_figures_and_the_reason() -> None:
    ok = {"infinity-512": {"short": {"c1": {"texts_per_s": 30.0}}}}
    failed = {"infinity-512": {"unavailable": "ArmUnavailable: port in use"}}
    merged = median_of([failed, ok, {"infinity-512": {"short": {"c1": {"texts_per_s": 34.0}}}}])
    arm = merged["infinity-512"]
    assert arm["short"]["c1"]["texts_per_s"] == 32.0
    assert arm["unavailable"].startswith("ArmUnavailable")


def test_per_request_samples_are_pooled_over_rounds_not_taken_from_the_first() -> None:
    """The 1-client goal is a median over requests: every round's requests count."""
    rounds = [
        {"c1": {"per_text": [[0, 20.0], [1, 30.0]], "p50_ms": 25.0}},
        {"c1": {"per_text": [[0, 22.0]], "p50_ms": 22.0}},
        {"c1": {"per_text": [(1, 31.0)], "p50_ms": 31.0}},
    ]
    merged = median_of(rounds)
    assert merged["c1"]["per_text"] == [[0, 20.0], [1, 30.0], [0, 22.0], [1, 31.0]]
    assert merged["c1"]["p50_ms"] == 25.0


def test_the_one_client_goal_is_each_texts_latency_minus_that_texts_own_compute() -> None:
    from benchmarks.embed_report import _p50_over_compute

    results = {
        "arms": {
            "offline-single": {"short": {"offline": {"text_compute_ms": [19.0, 30.0, 17.0]}}},
            # text 1 is slow to compute, not to serve; text 7 has no compute time: left out
            "serve": {"short": {"c1": {"per_text": [[0, 20.0], [1, 35.0], [2, 18.0], [7, 99.0]]}}},
        }
    }
    figure = _p50_over_compute(results, "serve", "short")
    assert figure["value"] == 1.0 and figure["met"] is True
    assert _p50_over_compute(results, "redis", "short")["value"] is None  # arm not run


def test_the_results_file_keeps_sample_lists_on_one_line_and_reads_back_the_same() -> None:
    c1 = {"per_text": [[0, 12.5], [1, 13.25]], "ok": 2}
    c32 = {"latencies": [float(i) for i in range(100)]}
    results = {
        "arms": {"serve": {"short": {"c1": c1, "c32": c32}}},
        "runs": [{"round": 1, "seconds": [1.0, 2.0]}, {"round": 2, "seconds": []}],
        "empty": {},
        "note": 'a "quoted" text',
    }
    text = compact_json(results)
    assert json.loads(text) == results
    assert '"per_text": [[0,12.5],[1,13.25]]' in text
    lone_numbers = [x for x in text.splitlines() if x.strip(" ,[]").replace(".", "").isdigit()]
    assert lone_numbers == []  # indent=2 would give every number a line of its own
    assert len(text.splitlines()) < len(json.dumps(results, indent=2).splitlines()) / 4


def test_the_idle_penalty_is_each_settings_median_over_the_back_to_back_median() -> None:
    from benchmarks.idle_penalty import summarize

    rows = summarize(
        {
            ("sleep", 0.0): [6.0, 5.0, 7.0],  # back to back: the reference, median 6
            ("sleep", 2.0): [9.0, 8.0, 100.0],  # a slow outlier does not move a median
            ("spin", 2.0): [6.0, 6.6, 7.2],
        }
    )
    assert [(r.mode, r.gap_ms) for r in rows] == [("sleep", 0.0), ("sleep", 2.0), ("spin", 2.0)]
    assert [r.median_ms for r in rows] == [6.0, 9.0, 6.6]
    assert [round(r.vs_back_to_back, 3) for r in rows] == [1.0, 1.5, 1.1]


def test_lone_texts_are_timed_one_by_one_after_their_gap() -> None:
    from benchmarks.idle_penalty import time_lone_texts

    calls: list[list[str]] = []
    times = time_lone_texts(calls.append, ["a", "b", "c"], 0.001, "spin")
    assert calls == [["a"], ["b"], ["c"]]  # each text alone, in order
    assert len(times) == 3 and all(t >= 0 for t in times)
