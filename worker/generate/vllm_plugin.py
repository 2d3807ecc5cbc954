"""vLLM's processes die with the worker that started them (a vLLM general plugin).

vLLM runs its engine in a process of its own, and that one its model workers; a worker that
is SIGKILLed (the OOM killer, a crash test) would leave them running, holding the KV cache's
memory, or a GPU, until someone kills them. vLLM loads `vllm.general_plugins` in each of its
processes: there, where a microbatch worker started vLLM (`MICROBATCH_ENGINE=vllm`, which it
sets), this asks Linux to SIGKILL the process when its parent dies (PR_SET_PDEATHSIG), so the
engine goes with the worker and its model workers with the engine.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a process vLLM started for a microbatch worker: die when the parent does."""
    parent = multiprocessing.parent_process()
    if os.environ.get("MICROBATCH_ENGINE") != "vllm" or parent is None:
        return
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return
    if os.getppid() != parent.pid:  # it died before the request took hold
        os._exit(1)
