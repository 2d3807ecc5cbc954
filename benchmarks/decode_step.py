"""The generation engine alone, one change at a time: prefill and decode step per dtype.

    .venv/bin/python benchmarks/decode_step.py        # SmolLM2-135M-Instruct, 3 rounds

No server, no queue: `--batch` sizes of sequences with 100-token prompts (fixed seed) prefill
together, then decode `--steps` steps; each arm is built fresh per round and the rounds
interleave the arms, so drift on a shared host lands on every arm alike. The arms:
  float32        the engine as it ran before dtype existed
  bf16-plain     bfloat16 with plain matmuls (oneDNN reorders each weight on every call)
  bf16-packed    bfloat16 with the weights packed for oneDNN once at load (what serves)
Printed: median prefill time and decode step per arm and batch size, tokens/s, and each
arm's ratio to float32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARMS = ("float32", "bf16-plain", "bf16-packed")


def one_arm(path: Path, arm: str, batches: list[int], steps: int) -> dict[int, tuple[float, float]]:
    """(prefill seconds, decode step seconds) per batch size, on a fresh engine."""
    import worker.generate.engine as engine_module
    from worker.generate.sampling import Sampling
    from worker.generate.steps import Admission

    real = engine_module.pack_linears
    if arm == "bf16-plain":
        engine_module.pack_linears = lambda model, device: 0
    try:
        dtype = "float32" if arm == "float32" else "bfloat16"
        engine = engine_module.GenerationEngine(path, kv_tokens=8192, dtype=dtype)
    finally:
        engine_module.pack_linears = real
    greedy = Sampling(temperature=0.0, top_p=1.0, seed=-1)
    out = {}
    for batch in batches:
        rng = np.random.default_rng(0)
        keys = list(range(batch * 1000, batch * 1000 + batch))
        admissions = [
            Admission(k, rng.integers(100, 40000, 100).astype(np.uint32), greedy) for k in keys
        ]
        start = time.perf_counter()
        engine.step(admissions)
        prefill = time.perf_counter() - start
        for _ in range(2):  # warm
            engine.step([])
        start = time.perf_counter()
        for _ in range(steps):
            engine.step([])
        out[batch] = (prefill, (time.perf_counter() - start) / steps)
        engine.retire(keys)
    return out


def main() -> None:
    import torch

    default = Path("~/.cache/microbatch-models/smollm2-135m-instruct").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", default="1,16", help="sequence counts, comma-separated")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run ../shared/models/fetch-trained.sh")
    batches = [int(b) for b in args.batch.split(",")]
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for arm in ARMS:
            for batch, figures in one_arm(args.model, arm, batches, args.steps).items():
                samples.setdefault((arm, batch), []).append(figures)
    print(f"{args.model.name}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    base = {}
    for (arm, batch), runs in samples.items():
        prefill = float(np.median([p for p, _ in runs]))
        step = float(np.median([d for _, d in runs]))
        if arm == "float32":
            base[batch] = step
        print(
            f"{arm:12s} x{batch:<3d} prefill {prefill * 1000:7.0f} ms   decode step "
            f"{step * 1000:6.1f} ms   {batch / step:6.0f} tok/s   "
            f"step / float32 {step / base[batch]:.2f}"
        )


if __name__ == "__main__":
    main()
