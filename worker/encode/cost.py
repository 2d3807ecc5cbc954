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
    """Least squares over the last `window` batches; None until it has seen enough spread.

    Asked before every batch, so it keeps running sums (O(1) per batch, not O(window)),
    recomputed from the window now and then so float drift cannot build up.
    """

    def __init__(self, window: int = 128, min_batches: int = 8) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        self._min = min_batches
        self._sums = [0.0, 0.0, 0.0, 0.0]  # x, y, x*x, x*y over the window
        self._since_exact = 0
        self._estimate: Cost | None = None
        self._fresh = True

    def observe(self, padded_tokens: int, seconds: float) -> None:
        if not (padded_tokens > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        if len(self._seen) == self._seen.maxlen:
            self._add(*self._seen[0], sign=-1.0)
        self._seen.append((padded_tokens, seconds))
        self._add(padded_tokens, seconds, sign=1.0)
        self._since_exact += 1
        if self._since_exact >= (self._seen.maxlen or 1):
            self._sums = [0.0, 0.0, 0.0, 0.0]
            for x, y in self._seen:
                self._add(x, y, sign=1.0)
            self._since_exact = 0
        self._fresh = False

    def _add(self, x: float, y: float, *, sign: float) -> None:
        sums = self._sums
        sums[0] += sign * x
        sums[1] += sign * y
        sums[2] += sign * x * x
        sums[3] += sign * x * y

    def estimate(self) -> Cost | None:
        if not self._fresh:
            self._estimate = self._fit()
            self._fresh = True
        return self._estimate

    def _fit(self) -> Cost | None:
        n = len(self._seen)
        if n < self._min:
            return None
        sx, sy, sxx, sxy = self._sums
        mean_x, mean_y = sx / n, sy / n
        var_x = sxx - sx * mean_x  # sum of squared deviations
        if var_x < 1e-6 * max(1.0, mean_x**2) * n:
            return None  # (nearly) every batch the same size: overhead and tokens blur
        slope = max((sxy - sx * mean_y) / var_x, 1e-12)
        fixed = max(0.0, mean_y - slope * mean_x)
        return Cost(fixed, slope)


class ArrivalRate:
    """Entries per second, from an exponentially weighted mean of inter-arrival gaps."""

    def __init__(self, weight: float = 0.1, max_gap_s: float = 10.0) -> None:
        self._weight = weight
        self._max_gap_s = max_gap_s
        self._mean_gap_s: float | None = None
        self._last_s: float | None = None

    def observe(self, at_s: float, count: int = 1) -> None:
        """`count` arrivals at `at_s` (the rows of one entry): one gap, then `count - 1` gaps
        of zero, folded into the mean in one step."""
        if self._last_s is not None:
            gap = min(max(at_s - self._last_s, 0.0), self._max_gap_s)
            if self._mean_gap_s is None:
                self._mean_gap_s = gap
            else:
                self._mean_gap_s += self._weight * (gap - self._mean_gap_s)
            count -= 1
        elif count > 1:  # the first arrival starts the clock; the rest arrived with it
            self._mean_gap_s, count = 0.0, count - 1
        if count > 0 and self._mean_gap_s is not None:
            self._mean_gap_s *= (1 - self._weight) ** count
        self._last_s = at_s

    def per_second(self, now_s: float) -> float:
        """The rate, decayed by the silence since the last arrival (a quiet bucket is slow)."""
        if self._mean_gap_s is None or self._last_s is None:
            return 0.0
        gap = max(self._mean_gap_s, now_s - self._last_s, 1e-6)
        return 1.0 / gap


class Observations:
    """Everything the loop has measured: batch cost fits per thread count, overall and per
    bucket (a batch's time depends on the threads it ran on), and arrival rates per bucket."""

    def __init__(self, buckets: tuple[int, ...] | list[int]) -> None:
        self._costs: dict[int, BatchCost] = {}
        self._bucket_costs: dict[tuple[int, int], BatchCost] = {}
        self._arrivals = {b: ArrivalRate() for b in buckets}
        self.last_online_s = float("-inf")  # when the last online (not background) entry came

    def arrival(self, bucket: int, at_s: float, count: int = 1, online: bool = True) -> None:
        self._arrivals[bucket].observe(at_s, count)
        if online:
            self.last_online_s = max(self.last_online_s, at_s)

    def batch(self, threads: int, bucket: int, padded_tokens: int, seconds: float) -> None:
        self._costs.setdefault(threads, BatchCost()).observe(padded_tokens, seconds)
        fit = self._bucket_costs.setdefault((threads, bucket), BatchCost())
        fit.observe(padded_tokens, seconds)

    def rates(self, now_s: float) -> dict[int, float]:
        return {b: rate.per_second(now_s) for b, rate in self._arrivals.items()}

    def cost_at(self, threads: int) -> tuple[Cost | None, dict[int, Cost]]:
        """The cost at `threads` per batch (where the policy's choices matter), else at any
        thread count already fitted; and per bucket at `threads`."""
        loaded = self._costs.get(threads)
        cost = loaded.estimate() if loaded is not None else None
        if cost is None:
            cost = next((c for c in (f.estimate() for f in self._costs.values()) if c), None)
        per_bucket = {}
        for (fit_threads, bucket), fit in self._bucket_costs.items():
            estimate = fit.estimate() if fit_threads == threads else None
            if estimate is not None:
                per_bucket[bucket] = estimate
        return cost, per_bucket
