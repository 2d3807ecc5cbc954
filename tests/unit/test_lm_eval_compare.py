"""benchmarks/lm_eval/compare.py, the judge of the lm-eval parity run (issue 40, item 8):
it must pass equal runs and fail each kind of disagreement, or the parity it reports means
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.lm_eval.compare import compare, load


def _run(root: Path, task: str, docs: dict[int, list], ts: str = "2026-12-06T10-00-00.0") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"doc_id": doc, "resps": resps}) for doc, resps in docs.items()]
    (root / f"samples_{task}_{ts}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _choices(*values: float, greedy: bool = False) -> list:
    return [[[str(v), str(greedy)]] for v in values]


def test_equal_runs_pass_and_within_tolerance_is_equal(tmp_path: Path) -> None:
    hf = load(_run(tmp_path / "hf", "arc", {0: _choices(-1.0, -2.0), 1: [["text"]]}))
    served = load(_run(tmp_path / "srv", "arc", {0: _choices(-1.0005, -2.0), 1: [["text"]]}))
    assert compare(hf, served, tol=1e-3) == []


@pytest.mark.parametrize(
    ("served", "says"),
    [
        ({0: _choices(-1.01, -2.0), 1: [["text"]]}, "loglikelihood differs by 0.01"),
        ({0: _choices(-1.0, -2.0, greedy=True), 1: [["text"]]}, "is_greedy differs"),
        ({0: _choices(-1.0, -2.0), 1: [["other"]]}, "generated 'text' vs 'other'"),
        ({0: _choices(-1.0, -2.0)}, "the runs scored different documents"),
    ],
)
def test_each_disagreement_fails_by_name(tmp_path: Path, served: dict, says: str) -> None:
    hf = load(_run(tmp_path / "hf", "arc", {0: _choices(-1.0, -2.0), 1: [["text"]]}))
    failures = compare(hf, load(_run(tmp_path / "srv", "arc", served)), tol=1e-3)
    assert any(says in line for line in failures), failures


def test_the_latest_samples_of_a_task_are_read_and_different_tasks_fail(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _run(root, "arc", {0: _choices(-9.0)}, ts="2026-12-06T09-00-00.0")
    _run(root, "arc", {0: _choices(-1.0)}, ts="2026-12-06T10-00-00.0")
    assert load(root)["arc"][0] == _choices(-1.0)
    other = load(_run(tmp_path / "other", "hellaswag", {0: _choices(-1.0)}))
    assert compare(load(root), other, 1e-3) == [f"tasks differ: {['arc']} vs {['hellaswag']}"]
    assert compare({}, {}, 1e-3) != []  # nothing compared is not a pass
