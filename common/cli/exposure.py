"""Whether a gateway may listen where it is asked to: never open to a network unguarded.

A gateway bound beyond loopback with no `api_keys` serves anyone who can reach the host,
every model and every route. That is refused unless `allow_unauthenticated` says it is
meant (a network of its own, a proxy that authenticates), and then it is logged loudly on
every start. Loopback needs no keys: only this host reaches it.
"""

from __future__ import annotations

import ipaddress
import logging

from common.settings import Settings

log = logging.getLogger("microbatch")
LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def open_bind_refusal(settings: Settings) -> str | None:
    """Why this gateway must not start as set, or None; warns when it is allowed anyway."""
    if is_loopback(settings.host) or settings.api_keys or settings.tenants:
        return None
    if settings.allow_unauthenticated:
        log.warning(
            "the gateway listens on %s with no api_keys: anyone who reaches it is served "
            "(allow_unauthenticated is set)",
            settings.host,
        )
        return None
    return (
        f"the gateway would listen on {settings.host} with no api_keys, open to anyone who "
        "reaches it: set api_keys (MICROBATCH_API_KEYS), listen on 127.0.0.1, or set "
        "allow_unauthenticated true if something in front of it authenticates"
    )
