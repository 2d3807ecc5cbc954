"""What a JSON-schema grammar costs a decode step, side by side in one run.

    .venv/bin/python benchmarks/structured.py                  # SmolLM2-135M shape
    .venv/bin/python benchmarks/structured.py --shape tiny     # a 512-token vocabulary
    .venv/bin/python benchmarks/structured.py --schema tools --model PATH --dtype bfloat16
                                                  # a forced tool call on a trained model

The generation engine in-process on a random-weight model, `--rows` sequences decoding
together (temperature 1, seeded). Two arms, interleaved step by step so drift hits both:
  (free) no constraint;
  (json) every sequence under the same strict JSON schema (llguidance), each with its own
         matcher: its mask computed, applied to its row, and its token accepted, every step.
A constrained sequence whose JSON is complete starts over, so every step has all its rows.
Printed: median step time per arm and the grammar's share of a constrained step,
(json - free) / json (goal <= 20% at 16 sequences).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.generation import SHAPES, model_path  # noqa: E402

SCHEMA = (
    '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},'
    '"tags":{"type":"array","items":{"type":"string"}}},'
    '"required":["name","age","tags"],"additionalProperties":false}'
)


def tools_schema() -> str:
    """The schema a forced call of one of two tools is generated under (gateway/tool_calls)."""
    import json

    from gateway.tool_calls import forced_schema

    city = {"type": "string", "maxLength": 24}
    tools = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": city}}},
        {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": city}}},
    ]
    return json.dumps(forced_schema(tools, None, parallel=False))


def _engine_and_grammars(path: Path, threads: int, dtype: str = "float32"):
    from tokenizers import Tokenizer

    from worker.generate.constraints import Grammars
    from worker.generate.engine import GenerationEngine

    engine = GenerationEngine(path, threads=threads, dtype=dtype)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return engine, Grammars(tokenizer.to_str(), engine.vocab_size, engine.eos_ids)


def run(
    engine, grammars, rows: int, steps: int, constrained: bool, seed: int, schema: str = SCHEMA
) -> list[float]:
    """Step times (s) of `rows` sequences decoding together for `steps` steps."""
    from worker.generate.sampling import Sampling
    from worker.generate.steps import Admission

    prompt = np.random.default_rng(seed).integers(3, 200, 32).astype(np.uint32)

    def sampling(key: int) -> Sampling:
        constraint = grammars.constraint("json_schema", schema) if constrained else None
        return Sampling(1.0, 1.0, seed * 1000 + key, constraint=constraint)

    samplings = {key: sampling(key) for key in range(rows)}
    engine.step([Admission(k, prompt, s) for k, s in samplings.items()])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step([])
        times.append(time.perf_counter() - start)
        for s in samplings.values():  # a finished JSON starts over: all rows stay busy
            if s.constraint is not None and s.constraint.complete:
                s.constraint = grammars.constraint("json_schema", schema)
    engine.retire(list(samplings))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schema", choices=("person", "tools"), default="person")
    parser.add_argument("--model", type=Path, default=None, help="a model folder (any shape)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    path = args.model.expanduser() if args.model else model_path(args.shape)
    engine, grammars = _engine_and_grammars(path, args.threads, args.dtype)
    schema = tools_schema() if args.schema == "tools" else SCHEMA
    rows, steps = args.rows, args.steps
    run(engine, grammars, rows, 5, True, 99, schema)  # warm up both paths
    run(engine, grammars, rows, 5, False, 99, schema)
    times: dict[str, list[float]] = {"free": [], "json": []}
    for r in range(args.rounds):
        times["free"] += run(engine, grammars, rows, steps, False, r, schema)
        times["json"] += run(engine, grammars, rows, steps, True, r, schema)
    free, json_ = (float(np.median(times[arm])) for arm in ("free", "json"))
    print(
        f"{path.name} ({args.dtype}, vocabulary {engine.vocab_size}), schema {args.schema}, "
        f"{args.rows} sequences, "
        f"{args.rounds} x {args.steps} steps per arm, median step:"
    )
    print(f"  free  {free * 1000:8.2f} ms")
    print(f"  json  {json_ * 1000:8.2f} ms")
    print(f"grammar share of a constrained step: {(json_ - free) / json_:.1%} (goal <= 20%)")


if __name__ == "__main__":
    main()
