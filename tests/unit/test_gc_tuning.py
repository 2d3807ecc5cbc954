"""Serving processes' garbage collection: young collections rare, the startup heap frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from common import gc_tuning


@pytest.fixture
def restored_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


@pytest.mark.usefixtures("restored_gc")
def test_young_collections_wait_for_many_allocations_and_older_keep_their_spacing() -> None:
    _, older, oldest = gc.get_threshold()
    gc_tuning.relax()
    assert gc.get_threshold() == (gc_tuning.YOUNG_THRESHOLD, older, oldest)


@pytest.mark.usefixtures("restored_gc")
def test_what_startup_built_leaves_later_scans() -> None:
    survivor = [object() for _ in range(100)]
    gc_tuning.freeze_startup_heap()
    assert gc.get_freeze_count() >= len(survivor)
