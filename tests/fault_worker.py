"""A real worker process whose `noop` model fails or dies on chosen tokens.

    python -m tests.fault_worker [--fail-token N] [--crash-token N]   (settings: MICROBATCH_*)

The fault tests' seam, kept out of the product: the worker is the real one (`run_worker`,
its intake, loop, leases and recovery), given a loader whose `noop` runner raises on a row
holding the fail token (a bad input inside a batch) and exits the process with status 70 on
a batch holding the crash token (what a segfault or the OOM killer looks like from outside).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable
from dataclasses import replace

from common.logs import setup_logging
from common.settings import Settings
from worker.encode.runners.noop import NoopRunner
from worker.loading import LoadedModel, load_model
from worker.main import run_worker


def scripted(fail: int | None, crash: int | None) -> Callable[[Settings], LoadedModel]:
    def load(settings: Settings) -> LoadedModel:
        if settings.model != "noop":
            raise SystemExit("tests.fault_worker serves the noop model only")
        runner = NoopRunner(settings.noop_dim, settings.noop_compute_ms, fail, crash)
        return replace(load_model(settings), runner=runner)

    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fail-token", type=int)
    parser.add_argument("--crash-token", type=int)
    args = parser.parse_args()
    settings = Settings()
    setup_logging(settings.log_level, settings.log_format)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(settings, stop, load=scripted(args.fail_token, args.crash_token))

    asyncio.run(serve())


if __name__ == "__main__":
    main()
