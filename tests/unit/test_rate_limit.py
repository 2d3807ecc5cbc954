"""The per-key token bucket: bursts, sustained rate, and keys that do not affect each other."""

from __future__ import annotations

import pytest

from gateway.auth import RateLimiter


def test_a_burst_passes_then_the_next_request_waits_one_token() -> None:
    limiter = RateLimiter(rate_per_s=2, burst=3)
    assert [limiter.acquire("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a", 0.0) == pytest.approx(0.5)


def test_tokens_refill_at_the_rate_up_to_the_burst() -> None:
    limiter = RateLimiter(rate_per_s=2, burst=3)
    for _ in range(3):
        limiter.acquire("a", 0.0)
    assert limiter.acquire("a", 0.5) == 0.0  # one token back after 0.5 s
    assert limiter.acquire("a", 0.5) > 0
    # 100 s idle refill at most `burst` tokens: three go at once, the fourth waits
    after_idle = [limiter.acquire("a", 100.0) for _ in range(4)]
    assert after_idle[:3] == [0.0, 0.0, 0.0]
    assert after_idle[3] == pytest.approx(0.5)  # uncapped, 200 tokens would have let it go


def test_one_key_over_its_rate_does_not_slow_another() -> None:
    limiter = RateLimiter(rate_per_s=1, burst=1)
    assert limiter.acquire("a", 0.0) == 0.0
    assert limiter.acquire("a", 0.0) > 0
    assert limiter.acquire("b", 0.0) == 0.0
