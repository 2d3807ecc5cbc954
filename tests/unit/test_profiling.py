"""`BatchProfiler`: a few batches after a warm-up, one trace each, never a failed batch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from worker.profiling import BatchProfiler


def _batch() -> tuple[bool, torch.Tensor]:
    """A small torch batch that reports whether the profiler was on while it ran."""
    on = torch._C._autograd._profiler_enabled()
    out = torch.nn.functional.linear(torch.ones(4, 7, 8), torch.ones(3, 8))  # (B, T, D)
    return on, out


def test_only_the_batches_after_the_warm_up_are_profiled_one_trace_each(tmp_path: Path) -> None:
    profiler = BatchProfiler(str(tmp_path), "host.example-12", warmup=2, batches=3)
    seen = [profiler.run("embed", {"rows": 4}, _batch)[0] for _ in range(8)]

    assert seen == [False, False, True, True, True, False, False, False]
    assert profiler.finished
    traces = sorted(tmp_path.glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == [
        "host_example-12-embed1",
        "host_example-12-embed2",
        "host_example-12-embed3",
    ]
    trace = json.loads(traces[0].read_text())
    assert trace["microbatch"] == {"kind": "embed", "rows": 4}
    linear = [e for e in trace["traceEvents"] if e.get("name") == "aten::linear"]
    assert linear and linear[0]["args"]["Input Dims"][0] == [4, 7, 8]  # shapes recorded


def test_a_trace_that_cannot_be_written_is_logged_and_the_batch_still_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    profiler = BatchProfiler(str(blocker / "traces"), "w", warmup=0, batches=1)
    with caplog.at_level(logging.WARNING, "microbatch.worker"):
        on, out = profiler.run("embed", {}, _batch)
    assert on and out.shape == (4, 7, 3)
    assert "could not write the profiler trace" in caplog.text
    assert not torch._C._autograd._profiler_enabled()


def test_a_batch_that_raises_under_the_profiler_raises_and_leaves_it_off(tmp_path: Path) -> None:
    profiler = BatchProfiler(str(tmp_path), "w", warmup=0, batches=2)

    def broken() -> None:
        raise ValueError("this input fails")

    with pytest.raises(ValueError, match="this input fails"):
        profiler.run("embed", {}, broken)
    assert not torch._C._autograd._profiler_enabled()
    assert profiler.run("embed", {}, _batch)[0]  # the next one is still profiled
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 1
