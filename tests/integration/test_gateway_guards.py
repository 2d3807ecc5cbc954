"""API keys and a Redis outage: clear 401/503 answers, fast, never a 500 or a hang."""

from __future__ import annotations

import time

import httpx

from tests.conftest import Processes, RedisServer, free_port, wait_ready, wait_until


def test_api_keys_are_required_when_configured(redis_url: str, processes: Processes) -> None:
    settings = {"redis_url": redis_url, "model": "noop", "api_keys": "key-one,key-two"}
    processes.start("worker", **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    url = f"{gateway.base_url}/v1/embeddings"
    missing = httpx.post(url, json={"input": "x"})
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(url, json={"input": "x"}, headers={"Authorization": "Bearer key-three"})
    assert wrong.status_code == 401
    assert "key-three" not in wrong.text and "key-one" not in wrong.text
    for key in ("key-one", "key-two"):
        ok = httpx.post(url, json={"input": "x"}, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    assert "key-one" not in gateway.output() and "key-three" not in gateway.output()


def test_redis_down_gets_a_fast_503_with_retry_after(processes: Processes, tmp_path) -> None:
    redis = RedisServer(free_port(), tmp_path)
    redis.start()
    settings = {"redis_url": redis.url, "model": "noop"}
    processes.start("worker", **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    redis.kill()
    wait_until(  # the catalog has noticed: GET /readyz runs a refresh and says what it found
        lambda: httpx.get(f"{gateway.base_url}/readyz", timeout=30).json()["redis"] is False,
        10,
        "the gateway's catalog seeing Redis down",
    )
    started = time.monotonic()
    r = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    elapsed = time.monotonic() - started
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "service_unavailable"
    assert elapsed < 1, f"503 took {elapsed:.1f}s"  # 20 ms seen; a socket timeout is 5 s
    ready = httpx.get(f"{gateway.base_url}/readyz", timeout=30)
    assert ready.status_code == 503 and ready.json()["redis"] is False


def test_a_key_over_its_rate_gets_429_and_other_keys_are_unaffected(
    redis_url: str, processes: Processes
) -> None:
    settings = {
        "redis_url": redis_url,
        "model": "noop",
        "api_keys": "busy,calm",
        "rate_limit_per_key": 1,
        "rate_limit_burst": 3,
    }
    processes.start("worker", **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    url = f"{gateway.base_url}/v1/embeddings"
    busy = [
        httpx.post(url, json={"input": "x"}, headers={"Authorization": "Bearer busy"})
        for _ in range(5)
    ]
    assert [r.status_code for r in busy[:3]] == [200] * 3
    limited = busy[3]
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"
    calm = httpx.post(url, json={"input": "x"}, headers={"Authorization": "Bearer calm"})
    assert calm.status_code == 200


def test_a_password_protected_redis_works_and_a_wrong_password_fails_fast(
    processes: Processes, tmp_path
) -> None:
    server = RedisServer(free_port(), tmp_path)
    server.start()
    import redis as redis_client

    admin = redis_client.Redis(port=server.port)
    admin.config_set("requirepass", "s3cret")
    good = f"redis://:s3cret@127.0.0.1:{server.port}/0"
    bad = f"redis://:wrong@127.0.0.1:{server.port}/0"
    for role in ("worker", "gateway"):
        refused = processes.start(role, redis_url=bad, model="noop")
        assert refused.wait(30) == 2
        output = refused.output()
        assert "refused the credentials" in output and "wrong" not in output
    processes.start("worker", redis_url=good, model="noop")
    gateway = processes.start("gateway", redis_url=good, model="noop")
    wait_ready(gateway)
    r = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 200
    assert "s3cret" not in gateway.output()
    server.kill()


def test_the_readme_acl_user_serves_and_cannot_flush_or_configure(
    processes: Processes, tmp_path
) -> None:
    import re

    import redis as redis_client

    from tests.conftest import ROOT

    server = RedisServer(free_port(), tmp_path)
    server.start()
    readme = (ROOT / "docs" / "operations.md").read_text()
    acl = re.search(r"^ACL SETUSER microbatch .*$", readme, re.M).group(0)
    admin = redis_client.Redis(port=server.port)
    admin.execute_command(*acl.split())
    url = f"redis://microbatch:password@127.0.0.1:{server.port}/0"
    quick = {"heartbeat_interval_ms": 200, "worker_stale_ms": 1000}
    worker = processes.start("worker", redis_url=url, model="noop", **quick)
    gateway = processes.start("gateway", redis_url=url, model="noop", **quick)
    wait_ready(gateway)
    r = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 200, r.text

    # The periodic commands (the gateway's reply-stream check, the worker's look at its
    # peers) only log a failure: each must have run, and no log may hold a NOPERM.
    def ran(command: str) -> int:
        return admin.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)

    for command in ("xinfo|stream", "xinfo|consumers", "zrangebyscore"):
        wait_until(lambda c=command: ran(c), 15, f"{command} allowed and run")
    for proc in (worker, gateway):
        assert "NOPERM" not in proc.output(), proc.output()[-2000:]
    limited = redis_client.Redis(port=server.port, username="microbatch", password="password")
    for forbidden in (("FLUSHALL",), ("CONFIG", "GET", "maxmemory"), ("KEYS", "*")):
        try:
            limited.execute_command(*forbidden)
        except redis_client.exceptions.NoPermissionError:
            continue
        raise AssertionError(f"{forbidden[0]} was allowed")
    limited.close()
    admin.close()
    server.kill()


def test_only_keys_the_operator_lists_may_ask_for_interactive_priority(
    redis_url: str, processes: Processes
) -> None:
    settings = {
        "redis_url": redis_url,
        "model": "noop",
        "api_keys": "fast,slow",
        "interactive_api_keys": "fast",
    }
    processes.start("worker", **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)
    url = f"{gateway.base_url}/v1/embeddings"

    def post(key: str, priority: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}", "X-Microbatch-Priority": priority}
        return httpx.post(url, json={"input": "x"}, headers=headers, timeout=30)

    refused = post("slow", "interactive")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("permission_error", "permission_denied")
    assert error["param"] == "X-Microbatch-Priority" and "slow" not in refused.text
    assert post("fast", "interactive").status_code == 200
    assert post("slow", "batch").status_code == 200


def test_with_keys_metrics_and_docs_are_not_open_and_an_admin_port_serves_probes(
    redis_url: str, processes: Processes
) -> None:
    admin_port = free_port()
    common = {"redis_url": redis_url, "model": "noop", "api_keys": "sk-1"}
    processes.start("worker", **common)
    apart = processes.start("gateway", admin_port=admin_port, **common)
    keyed = processes.start("gateway", **common)
    shown = processes.start("gateway", public_docs="true", **common)
    for proc in (apart, keyed, shown):
        wait_ready(proc)
    admin = f"http://127.0.0.1:{admin_port}"
    key = {"Authorization": "Bearer sk-1"}

    moved = httpx.get(f"{apart.base_url}/metrics", headers=key)
    assert moved.status_code == 404 and f"admin port {admin_port}" in moved.text
    assert "microbatch_requests_total" in httpx.get(f"{admin}/metrics").text  # no key there
    assert httpx.get(f"{admin}/healthz").status_code == 200
    assert httpx.get(f"{admin}/readyz").status_code == 200
    assert httpx.get(f"{apart.base_url}/readyz").status_code == 200  # probes stay where they were
    only_probes = httpx.post(f"{admin}/v1/embeddings", json={"input": "x"}, headers=key)
    assert only_probes.status_code == 404 and "admin port serves" in only_probes.text
    assert httpx.get(f"{admin}/v1/models", headers=key).status_code == 404
    answered = httpx.post(f"{apart.base_url}/v1/embeddings", json={"input": "x"}, headers=key)
    assert answered.status_code == 200

    assert httpx.get(f"{keyed.base_url}/metrics").status_code == 401
    assert httpx.get(f"{keyed.base_url}/metrics", headers=key).status_code == 200
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{keyed.base_url}{path}").status_code == 404, path
    assert httpx.get(f"{shown.base_url}/openapi.json").status_code == 200
