"""`BatchProfiler`: PyTorch profiler traces of a few batches, to see where a batch's time goes.

With `profile_dir` set, a worker skips its first `WARMUP_BATCHES` batches (a TorchScript trace
is optimised during its first runs, and first calls allocate), then records the next
`PROFILED_BATCHES` one at a time, each in its own Chrome trace file (`*.pt.trace.json`, which
Perfetto opens and TensorBoard's profiler plugin reads from the folder). Shapes are recorded,
so each op shows its padded (batch, length); the trace's `microbatch` metadata holds the
batch's facts (real and padded tokens, the padding ratio, how long its entries queued), so
one file tells padding, queueing and compute apart.

The profiler runs only around those batches and is never started again after them. It never
fails a batch: a profiler that cannot start leaves the batch unprofiled, and a trace that
cannot be written is logged and dropped. Called on the compute threads; its counters are
guarded by a lock, and two batches are never profiled at once (the profiler is per process).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("microbatch.worker")

T = TypeVar("T")
WARMUP_BATCHES = 2
PROFILED_BATCHES = 5


class BatchProfiler:
    def __init__(
        self,
        directory: str,
        worker: str,
        *,
        device: str = "cpu",
        warmup: int = WARMUP_BATCHES,
        batches: int = PROFILED_BATCHES,
    ) -> None:
        self.directory = Path(directory).expanduser()
        self._worker = re.sub(r"[^A-Za-z0-9_-]", "_", worker)  # TensorBoard splits names on "."
        self._cuda = device.startswith("cuda")
        self._warmup = warmup
        self._batches = batches
        self._lock = threading.Lock()
        self._offered = 0  # batches seen, warm-up included
        self._taken = 0  # batches profiled (or being profiled)
        self._busy = False
        self.finished = False  # every profiled batch taken: the profiler is done for good

    def run(self, kind: str, facts: Mapping[str, object], fn: Callable[[], T]) -> T:
        """`fn()`, under the profiler if this is one of the batches to profile."""
        number = self._claim()
        if number is None:
            return fn()
        try:
            return self._profiled(number, kind, facts, fn)
        finally:
            with self._lock:
                self._busy = False

    def _claim(self) -> int | None:
        """The number of this batch among the profiled ones, or None: not this one."""
        if self.finished:
            return None
        with self._lock:
            self._offered += 1
            if self._offered <= self._warmup or self._busy or self.finished:
                return None
            number, self._taken, self._busy = self._taken, self._taken + 1, True
            self.finished = self._taken >= self._batches
            return number

    def _profiled(
        self, number: int, kind: str, facts: Mapping[str, object], fn: Callable[[], T]
    ) -> T:
        from torch.profiler import record_function

        try:
            profiler = self._start(kind, facts)
        except Exception:
            log.warning("profiler did not start; this batch runs unprofiled", exc_info=True)
            return fn()
        try:
            with record_function(f"microbatch.{kind} {_brief(facts)}"):
                result = fn()
        finally:
            stopped = _stop(profiler)
        if stopped:
            self._write(profiler, number, kind)
        return result

    def _start(self, kind: str, facts: Mapping[str, object]) -> Any:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        profiler = profile(activities=activities, record_shapes=True)
        profiler.preset_metadata_json("microbatch", json.dumps({"kind": kind, **facts}))
        profiler.start()
        return profiler

    def _write(self, profiler: Any, number: int, kind: str) -> None:
        # TensorBoard's file pattern: <worker>.<timestamp>.pt.trace.json
        name = f"{self._worker}-{kind}{number + 1}.{time.time_ns()}.pt.trace.json"
        path = self.directory / name
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except Exception:
            log.warning("could not write the profiler trace %s", path, exc_info=True)
            return
        log.info("profiled %s batch %d of %d: %s", kind, number + 1, self._batches, path)


def _stop(profiler: Any) -> bool:
    try:
        profiler.stop()
    except Exception:
        log.warning("profiler did not stop cleanly; trace dropped", exc_info=True)
        return False
    return True


def _brief(facts: Mapping[str, object]) -> str:
    """The facts as one span name, e.g. `bucket=128 rows=8 padded_tokens=296`."""
    return " ".join(f"{k}={v}" for k, v in facts.items() if not isinstance(v, list | dict))
