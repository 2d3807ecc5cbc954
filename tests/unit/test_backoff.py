"""The one retry rule every Redis loop follows: doubling delays, capped, reset on success."""

from __future__ import annotations

from common.backoff import CAP_S, FIRST_S, Backoff


def test_delays_double_from_the_first_up_to_the_cap() -> None:
    backoff = Backoff()
    delays = [backoff.next_s() for _ in range(8)]
    assert delays[:3] == [FIRST_S, 2 * FIRST_S, 4 * FIRST_S]
    assert max(delays) == CAP_S
    assert delays == sorted(delays)


def test_a_success_starts_the_next_outage_from_the_first_delay() -> None:
    backoff = Backoff()
    for _ in range(5):
        backoff.next_s()
    backoff.reset()
    assert backoff.next_s() == FIRST_S


def test_a_fixed_delay_is_a_backoff_whose_cap_is_its_first() -> None:
    backoff = Backoff(first_s=0.5, cap_s=0.5)
    assert [backoff.next_s() for _ in range(3)] == [0.5, 0.5, 0.5]
