"""A tenant's per-minute quota as a pace: its interval and burst, the script's reply read
back, and OpenAI's rate-limit headers as a client reads them."""

from __future__ import annotations

import pytest

from gateway.quota import (
    LEASE_FIRST,
    LEASE_S,
    MINUTE_US,
    UNMETERED,
    Allowance,
    Pace,
    Verdict,
    go_duration,
    lease_size,
    too_large,
)

pytestmark = pytest.mark.unit


def test_a_pace_spends_a_minute_over_its_quota_with_a_twentieth_as_burst() -> None:
    tokens = Pace(6000, 120)
    assert tokens.interval_us == 10_000  # 6000 units a minute
    assert tokens.burst == 300  # 5%: any minute stays within 5% of the quota
    assert tokens.lease_cap == 75  # at most a quarter burst leased ahead
    assert tokens.args(40, 7) == [10_000, 300, 120, 40, 7]  # leasing 40, handing back 7
    assert Pace(10, 1).burst == 1  # a small quota still lets one through
    assert Pace(600, 1).lease_cap == 0  # a small burst is checked every time, exactly
    assert Pace(1_000_000_000, 1).interval_us == 0.06  # past 60M a minute, a fraction
    assert Pace(None, 5).args() == [0, 0, 5, 0, 0]  # interval 0: the script skips it


def test_an_admitted_verdict_tells_each_quota_it_has_and_no_retry() -> None:
    reply = [1, 0, 0, 1, 59, 1_000_000, 5_880, 1_200_000]
    verdict = Verdict.of(reply, Pace(60, 1), Pace(6000, 120))
    assert verdict.admitted and verdict.refused_by == "" and verdict.leased
    assert verdict.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5880",
        "x-ratelimit-reset-tokens": "1.2s",
    }
    # as a response holds them, encoded once for every answer of the lease
    assert dict(verdict.raw_headers()) == {
        k.encode(): v.encode() for k, v in verdict.headers().items()
    }


def test_a_refusal_says_which_quota_and_when_to_retry_rounded_up() -> None:
    verdict = Verdict.of([0, 1_234_567, 2, 0, 0, 0, 0, 3_000_000], Pace(None, 1), Pace(6000, 400))
    assert not verdict.admitted and verdict.refused_by == "tokens"
    headers = verdict.headers()
    assert headers["retry-after-ms"] == "1235"  # the openai client reads this first
    assert headers["Retry-After"] == "2"  # whole seconds, never 0 (a client would not wait)
    assert "x-ratelimit-limit-requests" not in headers  # no requests quota: no headers for it
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "3s"


def test_reset_durations_are_written_as_openai_writes_them() -> None:
    assert go_duration(20_000) == "20ms"
    assert go_duration(1_500_000) == "1.5s"
    assert go_duration(MINUTE_US) == "1m0s"
    assert go_duration(61_250_000) == "1m1.25s"


def test_a_request_larger_than_the_whole_quota_is_named_never_retried() -> None:
    assert too_large(Pace(6000, 6000)) is None
    assert too_large(Pace(None, 10**9)) is None
    message = too_large(Pace(6000, 6001))
    assert message is not None and "6001" in message and "tokens_per_minute" in message


def test_a_lease_is_spent_locally_until_it_runs_out_or_expires() -> None:
    verdict = Verdict.of([1, 0, 0, 1, 0, 0, 0, 0], Pace(None, 1), Pace(6000, 40))
    paces = Pace(None, 1), Pace(6000, 40)
    allowance = Allowance.of(verdict.raw_headers(), *paces, now_s=100.0, leases=(0, 75))
    assert allowance.tokens == 75 and allowance.requests == UNMETERED
    assert allowance.take(1, 40, 100.1) and allowance.tokens == 35
    assert not allowance.take(1, 40, 100.2)  # not enough left: Redis is asked
    assert allowance.used() == (0, 40) and allowance.unspent(*paces) == (0, 35)
    assert allowance.take(1, 35, 100.3) and allowance.tokens == 0
    assert allowance.used() == (0, 75) and allowance.unspent(*paces) == (0, 0)
    fresh = Allowance.of(verdict.raw_headers(), *paces, now_s=100.0, leases=(0, 75))
    assert not fresh.take(1, 1, 100.0 + LEASE_S)  # expired: its rest handed back next time
    assert fresh.unspent(*paces) == (0, 75)
    # the tenants file changed the pace since: nothing handed back (only admits less)
    assert fresh.unspent(Pace(None, 1), Pace(12_000, 40)) == (0, 0)


def test_a_lease_follows_what_the_gateway_used_of_the_last_one() -> None:
    """A first lease holds a few requests' worth; then twice what was used (a lease spent
    out doubles), never more than a quarter burst; a small quota leases nothing."""
    requests, tokens = Pace(10_000_000, 1), Pace(1_000_000_000, 30)
    assert lease_size(requests, 0) == LEASE_FIRST and lease_size(tokens, 0) == LEASE_FIRST * 30
    assert lease_size(requests, 3_000) == 6_000  # a second's traffic, twice over
    assert lease_size(requests, 10**9) == requests.lease_cap == 125_000
    assert lease_size(Pace(600, 1), 500) == 0
    size, runs = LEASE_FIRST, 0
    while size < 4_096:  # spent out each time: it doubles to a second's traffic in a few
        size, runs = lease_size(requests, size), runs + 1
    assert runs == 9


def test_two_leases_taken_at_once_are_kept_as_one() -> None:
    paces = Pace(None, 1), Pace(6000, 40)
    one = Allowance.of((), *paces, now_s=100.0, leases=(0, 75))
    assert one.take(1, 30, 100.1)
    two = Allowance.of((), *paces, now_s=100.2, leases=(0, 60))
    both = one.merged(two)
    assert both.tokens == 45 + 60 and both.requests == UNMETERED
    assert both.used() == (0, 30) and both.until_s == 100.2 + LEASE_S
    other = Allowance.of((), Pace(None, 1), Pace(12_000, 40), now_s=100.2, leases=(0, 60))
    assert one.merged(other) is other  # another pace: the older lease is not mixed in
