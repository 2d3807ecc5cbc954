"""Tenants' quotas through real gateways on one real Redis: one limit for the fleet, not one
per gateway; a refusal is OpenAI's 429 with its rate-limit headers, which the `openai`
client's own retry waits out; a generation is settled with the tokens it used; a request no
quota can hold is a 400; and a Redis that cannot answer the check fails open or closed as
set."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess

PREFIX = "mbquota"
TENANTS = {
    "tenants": {
        "paced": {"api_keys": ["sk-paced"], "requests_per_minute": 30},  # one each 2 s
        "metered": {"api_keys": ["sk-metered"], "tokens_per_minute": 600},  # one each 100 ms
        "free": {"api_keys": ["sk-free"]},
        "leased": {"api_keys": ["sk-leased"], "tokens_per_minute": 6000},  # a lease of 75
        "capped": {"api_keys": ["sk-capped"], "max_queued_tokens": 300},
    }
}
TOKEN_US = 100_000  # a token's interval at 600 a minute


@pytest.fixture(scope="module")
def fleet(module_redis: RedisServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("quotas") / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    deployment = InProcess()
    common = {"redis_url": module_redis.url, "prefix": PREFIX, "read_block_ms": 100}
    try:
        urls = []
        for _ in range(2):
            port = free_port()
            settings = Settings(**common, port=port, gateway_id=f"q-{port}", tenants=path)
            urls.append(deployment.start_gateway(settings))
        deployment.start_worker(Settings(**common, model="noop", worker_id="q-noop"))
        deployment.start_worker(
            Settings(**common, model=str(tiny_model), served_model_name="lm", worker_id="q-lm")
        )
        for name in ("noop", "lm"):
            wait_until(
                lambda name=name: _models(urls[0]),
                60,
                f"{name} served",
                until=lambda served, name=name: name in served,
            )
        yield urls, deployment, common, path
    finally:
        deployment.close()


def _models(url: str) -> list[str]:
    got = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-free"})
    return [m["id"] for m in got.json()["data"]] if got.status_code == 200 else []


def _embed(url: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/embeddings",
        json={"model": "noop", "input": "a"},
        headers={"Authorization": f"Bearer {key}"},
    )


def test_a_requests_quota_is_one_limit_across_gateways_and_the_client_retry_waits_it(
    fleet,
) -> None:
    (a, b), _, common, _ = fleet
    # the tenant's lane found by the worker first (within a second), and its pace rested
    wait_until(
        lambda: _embed(a, "sk-paced").status_code, 30, "a first answer", until=lambda s: s == 200
    )
    store = redis.Redis.from_url(common["redis_url"])
    key = f"{PREFIX}:{{tenant:paced}}:quota:requests"
    wait_until(lambda: float(store.get(key) or 0) <= _redis_us(store), 10, "the pace rested")
    first = _embed(a, "sk-paced")
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "30"
    assert first.headers["x-ratelimit-remaining-requests"] == "29"
    refused = _embed(b, "sk-paced")  # the other gateway: the same pace
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests_per_minute" in error["message"]
    assert 0 < int(refused.headers["retry-after-ms"]) <= 2000
    assert refused.headers["Retry-After"] in {"1", "2"}
    assert refused.headers["x-ratelimit-remaining-requests"] == "29"  # a refusal charges none
    assert "x-ratelimit-limit-tokens" not in refused.headers  # no tokens quota, no headers
    assert _embed(b, "sk-free").status_code == 200  # another tenant is untouched
    # the openai client retries a 429 after the retry-after-ms it was given, as on OpenAI
    with openai.OpenAI(base_url=f"{b}/v1", api_key="sk-paced", max_retries=3) as client:
        started = time.monotonic()
        answer = client.embeddings.with_raw_response.create(model="noop", input="b")
    assert answer.http_response.status_code == 200
    assert answer.retries_taken >= 1 and time.monotonic() - started > 0.1


def test_a_generation_is_charged_its_max_tokens_and_settled_with_what_it_used(fleet) -> None:
    (a, b), *_ = fleet
    prompt = "the quota"
    free = openai.OpenAI(base_url=f"{a}/v1", api_key="sk-free", max_retries=0)
    metered = openai.OpenAI(base_url=f"{b}/v1", api_key="sk-metered", max_retries=0)
    with free, metered:
        greedy = free.completions.create(model="lm", prompt=prompt, max_tokens=4, temperature=0)
        text = greedy.choices[0].text
        assert text.strip(), "the tiny model's greedy text is needed to stop it early"
        stop = text.strip()[0]
        store = redis.Redis.from_url(fleet[2]["redis_url"])
        key = f"{PREFIX}:{{tenant:metered}}:quota:tokens"
        # the tenant's lane found by the worker first (within a second), and its pace rested
        wait_until(
            lambda: metered.completions.create(model="lm", prompt=prompt, max_tokens=1).usage,
            30,
            "a first metered answer",
        )
        wait_until(lambda: float(store.get(key) or 0) <= _redis_us(store), 10, "the pace rested")
        before = _redis_us(store)
        answer = metered.completions.with_raw_response.create(
            model="lm", prompt=prompt, max_tokens=40, temperature=0, stop=[stop]
        )
        after = _redis_us(store)
        usage = answer.parse().usage
        assert usage is not None and usage.completion_tokens < 40  # stopped early
        charged = usage.prompt_tokens + 40
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) == 600 - charged
        # settled: the pace holds only what was used, charged at some moment within the call
        wait_until(
            lambda: float(store.get(key) or 0) - usage.total_tokens * TOKEN_US,
            10,
            "the unused tokens handed back",
            until=lambda charged_at: before <= charged_at <= after,
        )
    # 40-odd tokens is more than the burst (30): it goes only on a rested pace, so not now
    again = httpx.post(
        f"{a}/v1/completions",
        json={"model": "lm", "prompt": prompt, "max_tokens": 40},
        headers={"Authorization": "Bearer sk-metered"},
    )
    assert again.status_code == 429, again.text
    assert "tokens_per_minute" in again.json()["error"]["message"]
    assert again.headers["x-ratelimit-limit-tokens"] == "600"
    # more than the whole quota can never pass: a 400 naming it, not a 429 retried forever
    huge = httpx.post(
        f"{a}/v1/completions",
        json={"model": "lm", "prompt": prompt, "max_tokens": 700},
        headers={"Authorization": "Bearer sk-metered"},
    )
    assert huge.status_code == 400, huge.text
    assert huge.json()["error"]["code"] == "request_too_large"


def _redis_us(store: redis.Redis) -> int:
    seconds, micros = store.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_a_quota_redis_cannot_check_fails_open_or_closed_as_set(fleet, mode: str) -> None:
    _, deployment, common, path = fleet
    # a Redis user that may do all the gateway does but run a script: every check fails
    admin = redis.Redis.from_url(common["redis_url"])
    admin.acl_setuser(
        "noscript", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-eval"],
    )  # fmt: skip
    port = free_port()
    url = deployment.start_gateway(
        Settings(
            **{**common, "redis_url": common["redis_url"].replace("//", "//noscript:pw@")},
            port=port,
            gateway_id=f"q-{mode}-{port}",
            tenants=path,
            quota_on_redis_error=mode,
        )
    )
    try:
        answer = _embed(url, "sk-paced")
        assert answer.status_code == (200 if mode == "open" else 503), answer.text
        if mode == "closed":
            assert "quota_on_redis_error" in answer.json()["error"]["message"]
        assert _embed(url, "sk-free").status_code == 200  # no quota, nothing to check
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-free"}).text
        outcome = "unchecked_admitted" if mode == "open" else "unchecked_refused"
        assert f'microbatch_quota_checks_total{{outcome="{outcome}"}}' in metrics
    finally:
        deployment.stop_gateway(url)


def test_a_large_quota_is_spent_from_a_lease_without_asking_redis_each_time(fleet) -> None:
    (a, _), *_ = fleet

    def leased() -> float:
        metrics = httpx.get(f"{a}/metrics", headers={"Authorization": "Bearer sk-free"}).text
        line = 'microbatch_quota_checks_total{outcome="admitted_leased"} '
        found = [x for x in metrics.splitlines() if x.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    # the tenant's lane found by the worker first (within a second): a lease lives 1 s
    wait_until(
        lambda: _embed(a, "sk-leased").status_code, 30, "a first answer", until=lambda s: s == 200
    )
    before = leased()
    answers = [_embed(a, "sk-leased") for _ in range(3)]  # a few tokens each, well under 75
    assert all(r.status_code == 200 for r in answers)
    assert all(r.headers["x-ratelimit-limit-tokens"] == "6000" for r in answers)
    assert leased() - before >= 2  # the first took the lease from Redis, the rest spent it


def test_a_tenants_backlog_cap_refuses_past_its_queued_tokens(fleet) -> None:
    """`max_queued_tokens`, one cap across the fleet: with 200 of the tenant's tokens held by
    a request another gateway admitted (its reservation, written here as that gateway
    writes it), one that would take it past 300 is a 429 saying so; another tenant is not
    held back; a request of more than 300 alone is a 400; a reservation past its deadline
    (a gateway that died holding it) no longer counts; and an answered request hands its
    own back."""
    (a, b), _, common, _ = fleet
    store = redis.Redis.from_url(common["redis_url"])
    held = f"{PREFIX}:{{tenant:capped}}:backlog:lm"
    ask = {"model": "lm", "prompt": "the backlog", "temperature": 0, "max_tokens": 150}
    key = {"Authorization": "Bearer sk-capped"}
    now_ms = int(time.time() * 1000)
    store.zadd(held, {"elsewhere": now_ms + 60_000})
    store.hset(f"{held}:tokens", "elsewhere", 200)
    refused = httpx.post(f"{a}/v1/completions", json=ask, headers=key)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tenant_queue_full", error
    assert "has 200 tokens" in error["message"] and "max_queued_tokens 300" in error["message"]
    assert "Retry-After" in refused.headers
    other = httpx.post(f"{b}/v1/completions", json=ask, headers={"Authorization": "Bearer sk-free"})
    assert other.status_code == 200, other.text  # another tenant's backlog is its own
    alone = httpx.post(f"{b}/v1/completions", json={**ask, "max_tokens": 400}, headers=key)
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "request_too_large"
    store.zadd(held, {"elsewhere": now_ms - 1})  # its deadline passed: its gateway died
    served = httpx.post(f"{b}/v1/completions", json=ask, headers=key)
    assert served.status_code == 200, served.text
    wait_until(
        lambda: store.hgetall(f"{held}:tokens"), 10, "every reservation handed back",
        until=lambda left: left == {},
    )  # fmt: skip


def test_a_background_response_hands_its_backlog_back_when_it_finishes(fleet) -> None:
    """A background run holds its tenant's backlog like any generation; whichever gateway
    finishes it (here the one polling it) hands it back, not the run's deadline. A streamed
    turn hands it back when its stream ends."""
    (a, b), _, common, _ = fleet
    store = redis.Redis.from_url(common["redis_url"])
    held = f"{PREFIX}:{{tenant:capped}}:backlog:lm:tokens"
    # Redis's own record of what was done to the hold, in order: 8 tokens of the tiny model
    # can end (and hand the hold back) before a read of the hash after `create` returns
    store.config_set("notify-keyspace-events", "Kh")
    with contextlib.closing(store.pubsub()) as events:
        events.subscribe(f"__keyspace@0__:{held}")
        assert _next_event(events) == "subscribe"
        with openai.OpenAI(base_url=f"{a}/v1", api_key="sk-capped", max_retries=0) as capped:
            made = capped.responses.create(
                model="lm", input="later", background=True, max_output_tokens=8
            )
        assert _next_event(events) == "hset"  # held from admission
        with openai.OpenAI(base_url=f"{b}/v1", api_key="sk-capped", max_retries=0) as other:
            done = wait_until(
                lambda: other.responses.retrieve(made.id),
                30,
                "the background run finished",
                until=lambda r: r.status in ("completed", "incomplete", "failed"),
            )
        assert done.status in ("completed", "incomplete"), done.error
        assert _next_event(events) == "hdel"  # handed back by the gateway that finished it
        with openai.OpenAI(base_url=f"{a}/v1", api_key="sk-capped", max_retries=0) as capped:
            streamed = capped.responses.create(
                model="lm", input="now", stream=True, max_output_tokens=8
            )
            ends = {"response.completed", "response.incomplete"}
            assert any(event.type in ends for event in streamed)
        assert [_next_event(events), _next_event(events)] == ["hset", "hdel"]
    assert store.hlen(held) == 0


def _next_event(events: redis.client.PubSub, timeout_s: float = 10.0) -> str:
    """The next keyspace event's name (or the subscription's confirmation)."""
    message = events.get_message(timeout=timeout_s)
    assert message is not None, f"no event within {timeout_s} s"
    kind = message["type"]
    return kind if kind == "subscribe" else message["data"].decode()


# Structured output ends even the random tiny model's answer, well before its max_output_tokens
ENDS_SOON = {
    "format": {
        "type": "json_schema",
        "name": "flag",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    }
}


@pytest.mark.parametrize("mode", ["background", "stream"])
def test_a_responses_turn_is_settled_with_the_tokens_it_used(fleet, mode: str) -> None:
    """A Responses turn is charged its prompt and max_output_tokens like any generation, and
    handed back what it did not use when it ends: a streamed turn when its stream ends, a
    background run by the gateway that finishes it (here another than the one it came in)."""
    (a, b), _, common, _ = fleet
    store = redis.Redis.from_url(common["redis_url"])
    key = f"{PREFIX}:{{tenant:metered}}:quota:tokens"
    asked = {"model": "lm", "input": "q", "max_output_tokens": 60, "text": ENDS_SOON}
    metered = openai.OpenAI(base_url=f"{a}/v1", api_key="sk-metered", max_retries=0)
    other = openai.OpenAI(base_url=f"{b}/v1", api_key="sk-metered", max_retries=0)
    with metered, other:
        wait_until(lambda: float(store.get(key) or 0) <= _redis_us(store), 30, "the pace rested")
        before = _redis_us(store)
        if mode == "background":
            made = metered.responses.create(**asked, background=True)
            after = _redis_us(store)
            done = wait_until(
                lambda: other.responses.retrieve(made.id),
                30,
                "the background run finished",
                until=lambda r: r.status in ("completed", "incomplete", "failed"),
            )
            usage = done.usage
        else:
            events = list(metered.responses.create(**asked, stream=True))
            after = _redis_us(store)
            usage = events[-1].response.usage
    assert usage is not None and usage.output_tokens < 60, usage  # ended early
    wait_until(
        lambda: float(store.get(key) or 0) - usage.total_tokens * TOKEN_US,
        10,
        "the unused tokens handed back",
        until=lambda charged_at: before <= charged_at <= after,
    )


def test_a_background_run_that_could_not_be_queued_hands_back_what_it_held(
    fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused at the enqueue (Redis, or its deadline, failing it there), a background run
    is deleted and answered 503: nobody will finish it, so its backlog and the unused part
    of its tokens charge go back at once, not at the backlog's deadline."""
    from common.errors import ServiceUnavailable
    from gateway.routes import responses as route

    async def refused(*_: object) -> None:
        raise ServiceUnavailable("the queue is not answering")

    (a, _), _, common, _ = fleet
    store = redis.Redis.from_url(common["redis_url"])
    backlog = f"{PREFIX}:{{tenant:capped}}:backlog:lm:tokens"
    pace = f"{PREFIX}:{{tenant:metered}}:quota:tokens"
    monkeypatch.setattr(route, "enqueue_within", refused)  # the gateways run in this process
    asked = {"model": "lm", "input": "q", "max_output_tokens": 60, "background": True}

    def create(key: str) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key}"}
        return httpx.post(f"{a}/v1/responses", json=asked, headers=auth)

    assert create("sk-capped").status_code == 503
    wait_until(lambda: store.hlen(backlog), 10, "the backlog handed back", until=lambda n: n == 0)
    monkeypatch.undo()
    plain = {**asked, "background": False, "max_output_tokens": 1}
    prompt = httpx.post(
        f"{a}/v1/responses", json=plain, headers={"Authorization": "Bearer sk-free"}
    )
    prompt_tokens = prompt.json()["usage"]["input_tokens"]
    monkeypatch.setattr(route, "enqueue_within", refused)
    wait_until(lambda: float(store.get(pace) or 0) <= _redis_us(store), 30, "the pace rested")
    before = _redis_us(store)
    assert create("sk-metered").status_code == 503
    # charged its prompt and 60 tokens at some moment after `before`, settled to its prompt.
    # Unsettled, the key lives at least 7 s; settled, a second past its prompt's pace: a key
    # gone within 6 s (Redis's clock, read after it) is one that was settled
    unsettled_s = 6
    at, now = wait_until(
        lambda: (store.get(pace), _redis_us(store)),
        unsettled_s,
        "the unused tokens handed back",
        until=lambda seen: (
            seen[0] is None or float(seen[0]) - before <= (prompt_tokens + 1) * TOKEN_US
        ),
    )
    assert at is not None or now - before < unsettled_s * 1_000_000, "looked too late to tell"
