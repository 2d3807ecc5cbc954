"""`microbatch worker --profile-dir DIR`: traces of a few real batches, then no profiler at all.

Real processes (redis-server, a worker with the real default model or the tiny causal LM, a
gateway) and real HTTP; the traces are read back as the JSON Perfetto and TensorBoard load.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.conftest import Processes, wait_ready
from worker.profiling import PROFILED_BATCHES, WARMUP_BATCHES

HIDDEN = 384  # all-MiniLM-L6-v2


def _traces(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.pt.trace.json"))]


def _ops(trace: dict) -> dict[str, list[dict]]:
    ops: dict[str, list[dict]] = {}
    for event in trace["traceEvents"]:
        if event.get("cat") == "cpu_op":
            ops.setdefault(event["name"], []).append(event)
    return ops


def test_a_worker_traces_a_few_embedding_batches_with_their_padded_shapes(
    processes: Processes, redis_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "traces"
    processes.start("worker", "--profile-dir", str(folder), redis_url=redis_url)
    gateway = processes.start("gateway", redis_url=redis_url)
    wait_ready(gateway)

    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        for i in range(WARMUP_BATCHES + PROFILED_BATCHES + 5):  # one after another
            body = {"input": [f"short {i}", "a longer text that pads its neighbour " * (1 + i)]}
            answer = client.post("/v1/embeddings", json=body)
            assert answer.status_code == 200, answer.text

    # a trace is written before its batch answers: every one is there, and no more
    traces = _traces(folder)
    assert len(traces) == PROFILED_BATCHES
    for trace in traces:
        facts = trace["microbatch"]
        assert facts["kind"] == "embed" and facts["bucket"] == 128
        assert facts["padded_tokens"] == facts["rows"] * facts["longest"]
        assert 0 < facts["real_tokens"] <= facts["padded_tokens"]
        assert facts["queue_wait_ms_max"] >= 0
        ops = _ops(trace)
        assert {"aten::linear", "aten::layer_norm"} <= set(ops)  # the encoder's layers
        padded = [facts["rows"], facts["longest"], HIDDEN]
        assert padded in [op["args"]["Input Dims"][0] for op in ops["aten::linear"]]


def test_a_generation_worker_traces_a_few_engine_steps(
    processes: Processes, redis_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    folder = tmp_path / "traces"
    settings = {"redis_url": redis_url, "model": tiny_model}
    processes.start("worker", "--profile-dir", str(folder), **settings)
    gateway = processes.start("gateway", **settings)
    wait_ready(gateway)

    body = {"prompt": "kalo mine", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text

    traces = _traces(folder)
    assert len(traces) == PROFILED_BATCHES
    for trace in traces:
        assert trace["microbatch"]["kind"] == "generate"
        assert trace["microbatch"]["running"] == 1
        ops = set(_ops(trace))  # the model's forward: bfloat16 linears run packed for oneDNN
        assert "aten::embedding" in ops and ops & {"aten::linear", "mkldnn::_linear_pointwise"}
