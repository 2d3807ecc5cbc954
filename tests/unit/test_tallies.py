"""A tally scrapes as the prometheus_client metric it replaces would after the same updates:
the same samples, names, labels, bucket bounds and values (the client's `_created` series
aside, which a tally does not keep)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from common.tallies import Tally, TallyHistogram

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TENANTS = st.sampled_from(["a", "b", "c"])


def _scraped(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if "_created" not in line)


@given(st.lists(st.tuples(TENANTS, st.sampled_from(["200", "429"]), st.integers(0, 1000))))
def test_a_tally_scrapes_as_a_counter(updates: list[tuple[str, str, int]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("m_tenant_total", "calls", ["tenant", "status"], registry=theirs)
    tally = Tally("m_tenant_total", "calls", ["tenant", "status"], registry=ours)
    for tenant, status, amount in updates:
        counter.labels(tenant, status).inc(amount)
        tally.add((tenant, status), amount)
    assert _scraped(ours) == _scraped(theirs)


# values on the bounds, between them and past the last: a value on a bound is in its bucket
VALUES = st.one_of(st.sampled_from(BOUNDS), st.floats(0, 60, allow_nan=False))


@given(st.lists(st.tuples(TENANTS, VALUES)))
def test_a_tally_histogram_scrapes_as_a_histogram(updates: list[tuple[str, float]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("m_wait_seconds", "wait", ["tenant"], buckets=BOUNDS, registry=theirs)
    tally = TallyHistogram("m_wait_seconds", "wait", ["tenant"], BOUNDS, registry=ours)
    for tenant, value in updates:
        histogram.labels(tenant).observe(value)
        tally.observe((tenant,), value)
    assert _scraped(ours) == _scraped(theirs)


def test_a_name_taken_twice_in_one_registry_is_refused() -> None:
    """Registered as the client's own metrics are: a second metric of the name is an error
    at start-up, not two families in one scrape."""
    registry = CollectorRegistry()
    Counter("m_total", "calls", ["tenant"], registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Tally("m_total", "calls", ["tenant"], registry=registry)
