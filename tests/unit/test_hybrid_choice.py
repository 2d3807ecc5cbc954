"""`--backend auto`: which engine keeps each bucket, from timings taken at load."""

from __future__ import annotations

import numpy as np
import pytest

from worker.encode.runners.base import example_rows
from worker.encode.runners.hybrid_runner import (
    Calibration,
    calibration_length,
    faster_engines,
    time_engines,
)


def test_each_bucket_goes_to_the_engine_that_clearly_wins_it_else_to_torch() -> None:
    seconds = {  # (lone text, small batch)
        ("torch", 128): (0.016, 0.060),
        ("onnx", 128): (0.010, 0.050),  # short texts: the lower fixed cost wins
        ("torch", 256): (0.030, 0.120),
        ("onnx", 256): (0.036, 0.090),  # 0.9 of torch's product: too close to call on noise
        ("torch", 512): (0.080, 0.330),
        ("onnx", 512): (0.098, 0.310),  # a faster batch does not outweigh a slower lone text
    }
    assert faster_engines(seconds) == {128: "onnx", 256: "torch", 512: "torch"}


def test_calibration_shapes_sit_mid_bucket_within_the_model_and_hold_no_padding() -> None:
    buckets = [128, 256, 512]
    assert [calibration_length(b, buckets, 512) for b in buckets] == [64, 192, 384]
    assert calibration_length(512, buckets, 300) == 300  # the model's own limit
    rows = example_rows([384] * 4, pad_id=0, vocab_size=30522)
    assert len(rows) == 4 and all(len(r) == 384 for r in rows)
    assert all(r.min() >= 1 and r.max() < 30522 for r in rows)
    assert example_rows([128], pad_id=0, vocab_size=50)[0].max() < 50


class Clocked:
    """An engine whose every call advances a shared fake clock by the next listed duration."""

    def __init__(self, durations: list[float], clock: list[float]) -> None:
        self.durations, self.clock, self.calls = durations, clock, []

    def embed(self, rows, threads=None):
        self.calls.append((len(rows), len(rows[0]), threads))
        self.clock[0] += self.durations.pop(0)
        return [np.zeros(2, np.float32) for _ in rows]


def test_an_engine_is_timed_by_its_fastest_repeat_not_a_slow_one_after_a_warm_up() -> None:
    now = [0.0]
    # per shape: a warm-up each, then three turns; a busy host slowed one run of each
    torch = Clocked([9.0, 0.020, 0.500, 0.021, 9.0, 0.060, 0.061, 0.400], now)
    onnx = Clocked([9.0, 0.300, 0.012, 0.013, 9.0, 0.050, 0.600, 0.051], now)
    at = Calibration([64], 30522, 512, lone_threads=2, batch_threads=1)
    seconds = time_engines({"torch": torch, "onnx": onnx}, at, clock=lambda: now[0])
    assert seconds[("torch", 64)] == pytest.approx((0.020, 0.060))
    assert seconds[("onnx", 64)] == pytest.approx((0.012, 0.050))
    assert torch.calls[:4] == [(1, 32, 2)] * 4  # a lone text on the lone batch's threads
    assert torch.calls[4:] == [(2, 32, 1)] * 4  # a small batch on one stream's threads
