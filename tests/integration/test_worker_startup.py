"""A worker's start: a configuration error ends it with its message; an outage is waited out."""

from __future__ import annotations

import asyncio

import pytest

from common.settings import Settings
from worker.main import run_worker


def test_a_configuration_error_at_registration_stops_the_worker_with_its_message(
    redis_url: str,
) -> None:
    """A `default_prompt_name` the model lacks is the operator's mistake, not an outage:
    retrying it forever (as every error once was) hides it behind a worker that never serves."""
    settings = Settings(redis_url=redis_url, model="noop", default_prompt_name="query")
    with pytest.raises(ValueError, match="default_prompt_name 'query' is not among"):
        asyncio.run(asyncio.wait_for(run_worker(settings, asyncio.Event()), 30))
