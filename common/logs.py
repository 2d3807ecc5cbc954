"""Logging set-up: one line per event, level from settings."""

from __future__ import annotations

import logging


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
    )
