"""Compare two lm-eval `--log_samples` output folders: lm-eval's `hf` backend and the server.

Per document and choice, the log-likelihoods (and is_greedy) of loglikelihood tasks; per
document, the text of generate_until tasks. Exit 1 if a log-likelihood differs by more than
`--tol`, is_greedy or a generation differs, or the two runs did not cover the same documents.

    python compare.py OUT_HF OUT_SERVER [--tol 1e-3]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

SAMPLES = re.compile(r"^samples_(?P<task>.+)_(?P<ts>\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")


def load(root: Path) -> dict[str, dict[int, list]]:
    """Each task's latest samples: doc id -> its responses (`resps`)."""
    latest: dict[str, tuple[str, Path]] = {}
    for path in root.rglob("samples_*.jsonl"):
        match = SAMPLES.match(path.name)
        if match and match["ts"] > latest.get(match["task"], ("", path))[0]:
            latest[match["task"]] = (match["ts"], path)
    out: dict[str, dict[int, list]] = {}
    for task, (_, path) in latest.items():
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[task] = {int(rec["doc_id"]): rec["resps"] for rec in lines}
    return out


def _is_true(value: object) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() == "true"


def compare(a: dict[str, dict[int, list]], b: dict[str, dict[int, list]], tol: float) -> list[str]:
    """Every disagreement, as a line to print; also prints what was compared."""
    failures, largest, values, texts = [], 0.0, 0, 0
    if set(a) != set(b) or not a:
        return [f"tasks differ: {sorted(a)} vs {sorted(b)}"]
    for task in sorted(a):
        if set(a[task]) != set(b[task]):
            failures.append(f"{task}: the runs scored different documents")
        for doc in sorted(set(a[task]) & set(b[task])):
            ra, rb = a[task][doc], b[task][doc]
            if not isinstance(ra[0][0], list):  # generate_until: [[text]]
                texts += 1
                if ra[0][0] != rb[0][0]:
                    failures.append(f"{task}/{doc}: generated {ra[0][0]!r} vs {rb[0][0]!r}")
                continue
            for choice, (x, y) in enumerate(zip(ra, rb, strict=True)):
                diff = abs(float(x[0][0]) - float(y[0][0]))
                largest, values = max(largest, diff), values + 1
                if diff > tol:
                    failures.append(f"{task}/{doc}/{choice}: loglikelihood differs by {diff:.3g}")
                if _is_true(x[0][1]) != _is_true(y[0][1]):
                    failures.append(f"{task}/{doc}/{choice}: is_greedy differs")
    print(f"log-likelihoods compared: {values}, largest difference {largest:.3g} (tol {tol})")
    print(f"generations compared: {texts}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reference", type=Path)
    parser.add_argument("candidate", type=Path)
    parser.add_argument("--tol", type=float, default=1e-3)
    args = parser.parse_args()
    failures = compare(load(args.reference), load(args.candidate), args.tol)
    for line in failures:
        print("FAIL", line)
    print("RESULT:", "FAIL" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
