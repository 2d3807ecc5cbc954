"""The tenants file, read again whenever it changes: keys added or revoked, limits changed,
without a restart. A version that cannot be used is refused with its reason logged, and the
last good one stays in force (a typo never opens or closes the gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from common import metrics
from common.tenants import Tenants, TenantsError, load

log = logging.getLogger("microbatch.gateway")
EVERY_S = 1.0


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells a changed file: its modification time and size (None: not there)."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size


class TenantsWatch:
    def __init__(self, path: Path, on_change: Callable[[Tenants], None]) -> None:
        self._path, self._on_change = path, on_change
        self._seen = _stamp(path)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), EVERY_S)
            self.check()

    def check(self) -> None:
        """Load the file again if it changed since last seen."""
        stamp = _stamp(self._path)
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            tenants = load(self._path)
        except TenantsError as exc:
            metrics.tenants_reloads_total.labels("refused").inc()
            log.warning("tenants file refused, the last good one stays in force: %s", exc)
            return
        self._on_change(tenants)
        metrics.tenants_reloads_total.labels("applied").inc()
        log.info("tenants file read again: %d tenants", len(tenants))
