"""What the batching policy learns about its own worker: batch cost and arrival rate.

`BatchCost` fits `seconds = fixed + per_token x padded_tokens` to the worker's recent batches
by least squares, so the policy can weigh a batch's padding against its fixed overhead.
`ArrivalRate` estimates entries per second per bucket from the gaps between arrivals. Both
are plain arithmetic over numbers the consumer feeds them: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cost:
    fixed_s: float  # per forward pass, whatever its size
    per_token_s: float  # per padded token

    def seconds(self, padded_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * padded_tokens


class BatchCost:
    """Least squares over the last `window` batches; None until it has seen enough spread."""

    def __init__(self, window: int = 128, min_batches: int = 8) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        self._min = min_batches

    def observe(self, padded_tokens: int, seconds: float) -> None:
        if padded_tokens > 0 and seconds > 0 and math.isfinite(seconds):
            self._seen.append((padded_tokens, seconds))

    def estimate(self) -> Cost | None:
        if len(self._seen) < self._min:
            return None
        n = len(self._seen)
        mean_x = sum(x for x, _ in self._seen) / n
        mean_y = sum(y for _, y in self._seen) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._seen)
        if var_x < 1e-9 * max(1.0, mean_x**2) * n:
            return None  # every batch the same size: no way to tell overhead from tokens
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self._seen) / var_x
        slope = max(slope, 1e-12)
        fixed = max(0.0, mean_y - slope * mean_x)
        return Cost(fixed, slope)


class ArrivalRate:
    """Entries per second, from an exponentially weighted mean of inter-arrival gaps."""

    def __init__(self, weight: float = 0.1, max_gap_s: float = 10.0) -> None:
        self._weight = weight
        self._max_gap_s = max_gap_s
        self._mean_gap_s: float | None = None
        self._last_s: float | None = None

    def observe(self, at_s: float) -> None:
        if self._last_s is not None:
            gap = min(max(at_s - self._last_s, 0.0), self._max_gap_s)
            if self._mean_gap_s is None:
                self._mean_gap_s = gap
            else:
                self._mean_gap_s += self._weight * (gap - self._mean_gap_s)
        self._last_s = at_s

    def per_second(self, now_s: float) -> float:
        """The rate, decayed by the silence since the last arrival (a quiet bucket is slow)."""
        if self._mean_gap_s is None or self._last_s is None:
            return 0.0
        gap = max(self._mean_gap_s, now_s - self._last_s, 1e-6)
        return 1.0 / gap
