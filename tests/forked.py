"""Test processes forked from a preloaded server instead of started cold.

A worker process spends about 2 s of CPU importing torch and transformers before it does
anything a test looks at, and the suite starts a few hundred of them on two cores. Here one
forkserver per pytest process imports them once; each `microbatch <role>` is then a fork of
it that runs the CLI module as `python -m` would: its own pid, environment, argv, log file,
signals and exit code, `atexit` handlers run at exit. What only a cold interpreter shows
(the imports themselves) stays proven by the tests that start processes cold
(`Processes(cold=True)`) and by every `subprocess` the product starts itself.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing.process import BaseProcess
from pathlib import Path

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload([__name__, "tests.forked_preload"])


def run_module(module: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """The child: `python -m module argv` with `env`, writing both streams to `log`."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[0:0] = [cwd]
    sys.argv = [module, *argv]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # as the interpreter turns `sys.exit(x)` into a status
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        atexit._run_exitfuncs()
        os.kill(os.getpid(), signal.SIGINT)  # as CPython exits on one: by the signal
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Forked:
    """The parts of `subprocess.Popen` the tests use, over a forkserver's child."""

    def __init__(self, process: BaseProcess, args: list[str]) -> None:
        self.process = process
        self.args = args

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(module: str, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Forked:
    process = _context.Process(
        target=run_module, args=(module, argv, env, str(cwd), str(log)), daemon=False
    )
    process.start()
    return Forked(process, [sys.executable, "-m", module, *argv])
