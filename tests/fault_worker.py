"""A real worker process whose `noop` model fails or dies on chosen tokens.

    python -m tests.fault_worker [--fail-token N] [--crash-token N] [--marked]
    (settings: MICROBATCH_*)

The fault tests' seam, kept out of the product: the worker is the real one (`run_worker`,
its intake, loop, leases and recovery), given a loader whose `noop` runner raises on a row
holding the fail token (a bad input inside a batch) and exits the process with status 70 on
a batch holding the crash token (what a segfault or the OOM killer looks like from outside).
`--marked`: each vector's first value is the sum of its row's token ids, so a test can tell
which input an answer belongs to (the plain noop answers zeros).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from common.cli.roles import serve_worker_health
from common.logs import setup_logging
from common.settings import Settings
from worker.encode.runners.noop import NoopRunner
from worker.loading import LoadedModel, load_model
from worker.main import run_worker


class MarkedRunner(NoopRunner):
    """The noop runner, but each row's vector starts with the sum of its token ids."""

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        vectors = super()._forward(rows)
        marked = [v.copy() for v in vectors]
        for vector, row in zip(marked, rows, strict=True):
            vector[0] = float(row.astype(np.int64).sum())
        return marked


def scripted(
    fail: int | None, crash: int | None, marked: bool = False
) -> Callable[[Settings], LoadedModel]:
    def load(settings: Settings) -> LoadedModel:
        if settings.model != "noop":
            raise SystemExit("tests.fault_worker serves the noop model only")
        kind = MarkedRunner if marked else NoopRunner
        runner = kind(settings.noop_dim, settings.noop_compute_ms, fail, crash)
        return replace(load_model(settings), runner=runner)

    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fail-token", type=int)
    parser.add_argument("--crash-token", type=int)
    parser.add_argument("--marked", action="store_true")
    args = parser.parse_args()
    settings = Settings()
    setup_logging(settings.log_level, settings.log_format)
    serve_worker_health(settings)  # /metrics and /healthz, as `microbatch worker` serves them

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(
            settings, stop, load=scripted(args.fail_token, args.crash_token, args.marked)
        )

    asyncio.run(serve())


if __name__ == "__main__":
    main()
