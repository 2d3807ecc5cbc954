"""How repeated measurements merge into one figure: plain arithmetic, no I/O."""

from __future__ import annotations

import statistics


def median_of(runs: list[dict]) -> dict:
    """Per key, the median of numbers, the first of anything else; dicts merged key by key,
    lists of numbers item by item, lists of samples (lists or tuples) pooled. A key some runs
    lack is merged over those that have it."""
    merged: dict = {}
    keys = dict.fromkeys(key for r in runs for key in r)
    for key in keys:
        values = [r[key] for r in runs if key in r]
        first = values[0]
        if _numbers(first) and all(_numbers(v) and len(v) == len(first) for v in values):
            merged[key] = [statistics.median(items) for items in zip(*values, strict=True)]
        elif all(_samples(v) for v in values):
            merged[key] = [list(sample) for v in values for sample in v]
        elif isinstance(first, bool) or not isinstance(first, int | float | dict):
            merged[key] = first
        elif isinstance(first, dict):
            merged[key] = median_of([v for v in values if isinstance(v, dict)])
        else:
            numbers = [v for v in values if isinstance(v, int | float)]
            same = len(set(numbers)) == 1
            merged[key] = numbers[0] if same else statistics.median(numbers) if numbers else None
    if len(runs) > 1 and all("texts_per_s" in r for r in runs):
        merged["runs_texts_per_s"] = [r["texts_per_s"] for r in runs]
    return merged


def _numbers(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )


def _samples(value: object) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(v, list | tuple) for v in value)
    )
