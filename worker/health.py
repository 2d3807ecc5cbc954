"""The worker's HTTP port: Prometheus metrics and a `/healthz` that fails when the loop stops.

A liveness probe on a port that only serves metrics proves the process answers, not that it
works: the metrics thread keeps answering while the consume loop is stuck. `/healthz` answers
200 while the intake's last beat (`microbatch_worker_loop_beat_timestamp_seconds`, set where
the intake beats) is recent and 503 otherwise, so an orchestrator restarts a worker whose loop
is wedged. Before the first beat (model loading) it answers 503 "starting": a Kubernetes
startupProbe covers that time. The policy, `check`, is a pure function of now and the beat.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from common import metrics

STALE_FLOOR_S = 30.0  # never fail sooner: a busy host or a GC pause is not a dead loop
BEATS_MISSED = 5  # beats the loop may miss in a row before it counts as stuck


@dataclass(frozen=True, slots=True)
class Health:
    """What `/healthz` answers: `ok` decides 200 or 503; the rest is the JSON body."""

    ok: bool
    status: str  # "ok", "stale" (the loop stopped beating) or "starting" (never beat yet)
    beat_age_s: float | None  # seconds since the last beat; None before the first
    stale_after_s: float

    def body(self) -> bytes:
        fields = {
            "status": self.status,
            "beat_age_s": None if self.beat_age_s is None else round(self.beat_age_s, 3),
            "stale_after_s": self.stale_after_s,
        }
        return json.dumps(fields).encode()


def stale_after_s(heartbeat_interval_ms: int) -> float:
    """How old the last beat may be: a few beat intervals, never under STALE_FLOOR_S."""
    return max(STALE_FLOOR_S, BEATS_MISSED * heartbeat_interval_ms / 1000)


def check(now_s: float, last_beat_s: float | None, stale_after_s: float) -> Health:
    """Alive while the last beat is at most `stale_after_s` old (both in Unix seconds)."""
    if last_beat_s is None:
        return Health(False, "starting", None, stale_after_s)
    age_s = max(0.0, now_s - last_beat_s)
    if age_s > stale_after_s:
        return Health(False, "stale", age_s, stale_after_s)
    return Health(True, "ok", age_s, stale_after_s)


def last_beat_s() -> float | None:
    """The loop's last beat from its gauge; None while it has never beaten (the gauge is 0)."""
    (metric,) = metrics.worker_loop_beat_timestamp_seconds.collect()
    value = metric.samples[0].value
    return value or None


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def app(
    stale_after_s: float,
    registry: CollectorRegistry = REGISTRY,
    last_beat: Callable[[], float | None] = last_beat_s,
    clock: Callable[[], float] = time.time,
) -> WsgiApp:
    """`/healthz` from `check`; every other path is prometheus_client's metrics app."""
    serve_metrics: WsgiApp = make_wsgi_app(registry)

    def health_or_metrics(
        environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            return serve_metrics(environ, start_response)
        health = check(clock(), last_beat(), stale_after_s)
        body = health.body()
        status = "200 OK" if health.ok else "503 Service Unavailable"
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [body]

    return health_or_metrics


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds
        pass


def serve(port: int, addr: str, stale_after_s: float, **app_options: Any) -> WSGIServer:
    """Serve `app` on `addr:port` from a daemon thread (as prometheus_client's own
    `start_http_server` does); the server is returned so a test can read its port."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family  # an IPv6 `host` binds too

    handler = app(stale_after_s, **app_options)
    server = make_server(addr, port, handler, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
