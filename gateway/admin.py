"""The admin port: where probes and metrics are served apart from the API (`admin_port`).

A connection is on the admin port when the socket it came in on listens there (uvicorn's
`scope["server"]`); only `ADMIN_PATHS` answer on it, and `/metrics` answers only there, so
the API port can face clients while the admin port faces the cluster alone.
"""

from __future__ import annotations

ADMIN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})


def on_admin_port(scope: dict, admin_port: int | None) -> bool:
    """Whether this connection came in on the admin port."""
    server = scope.get("server")
    return admin_port is not None and server is not None and server[1] == admin_port
