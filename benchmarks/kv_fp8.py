"""FP8 KV cache: bytes per cached token and what it costs in quality, against full precision.

    .venv/bin/python benchmarks/kv_fp8.py                   # SmolLM2-135M shape, 64 x 64
    .venv/bin/python benchmarks/kv_fp8.py --shape tiny      # a quick check
    .venv/bin/python benchmarks/kv_fp8.py --model ~/.cache/microbatch-models/smollm2-135m-instruct

With `--model` (a trained model, from ../shared/models/fetch-trained.sh) the prompts are chat
questions under its own template, the engine and its control run in `--dtype` (default
bfloat16), and the figure judged is top-1 agreement: each step of the quantized run is fed
the control's token, so every one of the 64 x 64 positions compares the two caches' choice
on the same text (goal: >= 0.95 against bfloat16).

The same 64 prompts (16-256 random tokens, fixed seed) decode 64 greedy tokens each through
the engine three times, all together: with `kv_cache_dtype=auto` (the model's float32),
`bfloat16` and `fp8_e4m3`. Printed: cache bytes per token of each (fp8: 1 byte a value plus
a 2-byte scale per token and head), the ratios, and against float32 the share of generated
tokens identical position by position and the largest absolute logit difference over the
steps where both runs had fed identical tokens so far. bfloat16 is the control: a random-
weight model amplifies any perturbation of its cache through its layers, so what it costs
shows how much of fp8's cost is the model's sensitivity rather than fp8's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(
    engine, prompts: list[list[int]], new: int, forced: list[list[int]] | None = None
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens per prompt, and each step's logits per prompt (the engine's own forward,
    observed, not changed). With `forced`, each step feeds that token instead of its own pick
    (the pick is still what is returned)."""
    from worker.generate.sampling import Sampling
    from worker.generate.steps import Admission

    seen: list = []
    forward = engine._forward

    def observed(*args, **kwargs):
        logits = forward(*args, **kwargs)
        seen.append(logits[:, -1].float().numpy().copy())
        return logits

    engine._forward = observed
    greedy = dict(temperature=0.0, top_p=1.0, seed=-1)
    admissions = [
        Admission(i, np.asarray(p, dtype=np.uint32), Sampling(**greedy))
        for i, p in enumerate(prompts)
    ]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    picked = engine.step(admissions)
    # prefills run in groups, each appending its rows in the order of its logits
    flat = np.concatenate(seen, axis=0)
    for row_index, row in enumerate(engine._rows):
        tokens[row.key].append(picked[row.key].token)
        logits[row.key].append(flat[row_index])
    for step in range(new - 1):
        if forced is not None:
            for row in engine._rows:
                row.last = forced[row.key][step]
        seen.clear()
        keys = [row.key for row in engine._rows]
        picked = engine.step([])
        for row_index, key in enumerate(keys):
            tokens[key].append(picked[key].token)
            logits[key].append(seen[0][row_index])
    engine.retire(list(range(len(prompts))))
    engine._forward = forward
    return tokens, [np.stack(x) for x in logits]


def main() -> None:
    from benchmarks.generation import SHAPES, model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--model", type=Path, default=None, help="a trained model's folder")
    parser.add_argument("--dtype", default="bfloat16", help="with --model: the engine's dtype")
    args = parser.parse_args()
    if args.model is not None:
        trained(args.model.expanduser(), args.prompts, args.new, args.dtype)
        return

    from worker.generate.engine import GenerationEngine

    path = model_path(args.shape)
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.shape][5]
    prompts = [
        rng.integers(3, vocab, int(rng.integers(16, 257))).tolist() for _ in range(args.prompts)
    ]
    kv = 64 * 1024
    full = GenerationEngine(path, kv_tokens=kv)
    ref_tokens, ref_logits = run(full, prompts, args.new)
    sizes = {"float32": full.store.bytes_per_token()}
    quality = {}
    for kind in ("bfloat16", "fp8_e4m3"):
        engine = GenerationEngine(path, kv_tokens=kv, kv_dtype=kind)
        sizes[kind] = engine.store.bytes_per_token()
        quality[kind] = compare(ref_tokens, ref_logits, *run(engine, prompts, args.new))
        del engine
    print(f"{args.prompts} prompts x {args.new} greedy tokens, shape {args.shape}")
    for name, size in sizes.items():
        same, worst = quality.get(name, (1.0, 0.0))
        print(
            f"  {name:9s} {size:8d} bytes per cached token   identical tokens {same:6.1%}   "
            f"max |logit difference| while inputs agree {worst:.4f}"
        )
    print(f"fp8 / bfloat16: {sizes['fp8_e4m3'] / sizes['bfloat16']:.3f} (goal 0.5)")
    print(f"fp8 / float32:  {sizes['fp8_e4m3'] / sizes['float32']:.3f} (goal 0.25)")
    print(json.dumps({"bytes": sizes, "quality": quality}))


QUESTIONS = [
    "Why is the sky blue?",
    "Explain how a hash map handles collisions.",
    "What are the main causes of inflation?",
    "Give three tips for learning a new language.",
    "Describe the water cycle to a child.",
    "How does a compiler differ from an interpreter?",
    "Write a short poem about the sea at night.",
    "What is the difference between weather and climate?",
]
SYSTEMS = ["", "You are a concise assistant.", "Answer like a teacher.", "Reply in one paragraph."]
STYLES = ["", " Be brief.", " Use an example."]


def share_same(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of positions where two runs' tokens are the same."""
    pairs = [a == b for r, q in zip(ref, got, strict=True) for a, b in zip(r, q, strict=True)]
    return float(np.mean(pairs))


def trained(path: Path, count: int, new: int, dtype: str) -> None:
    """FP8 against the model's own dtype on a trained model: top-1 agreement, teacher-forced."""
    from transformers import AutoTokenizer

    from worker.generate.engine import GenerationEngine

    tokenizer = AutoTokenizer.from_pretrained(path)
    chats = [
        [*([{"role": "system", "content": s}] if s else []), {"role": "user", "content": q + t}]
        for s in SYSTEMS
        for t in STYLES
        for q in QUESTIONS
    ][:count]
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    control = GenerationEngine(path, kv_tokens=64 * 1024, dtype=dtype)
    ref_tokens, _ = run(control, prompts, new)
    fp8 = GenerationEngine(path, kv_tokens=64 * 1024, dtype=dtype, kv_dtype="fp8_e4m3")
    tokens, _ = run(fp8, prompts, new, forced=ref_tokens)
    agree = share_same(ref_tokens, tokens)
    free, _ = run(fp8, prompts, new)
    same = share_same(ref_tokens, free)
    sizes = (control.store.bytes_per_token(), fp8.store.bytes_per_token())
    print(f"{len(prompts)} chat prompts x {new} greedy tokens, {path.name} in {dtype}")
    print(
        f"  bytes per cached token: {dtype} {sizes[0]}, fp8 {sizes[1]} ({sizes[1] / sizes[0]:.3f})"
    )
    print(f"  top-1 agreement, fp8 fed the {dtype} run's tokens: {agree:.4f} (goal >= 0.95)")
    print(f"  identical tokens position by position, each run free: {same:.4f}")
    print(json.dumps({"agreement": agree, "identical": same, "bytes": sizes}))


def compare(ref_tokens, ref_logits, tokens, logits) -> tuple[float, float]:
    """Share of tokens identical position by position, and the largest logit difference
    over the steps whose inputs were still identical (up to the first divergence)."""
    same = sum(
        a == b for r, q in zip(ref_tokens, tokens, strict=True) for a, b in zip(r, q, strict=True)
    )
    worst = 0.0
    for r, q, rl, ql in zip(ref_tokens, tokens, ref_logits, logits, strict=True):
        upto = next((i for i, (a, b) in enumerate(zip(r, q, strict=True)) if a != b), len(r))
        worst = max(worst, float(np.abs(rl[: upto + 1] - ql[: upto + 1]).max()))
    return same / sum(len(r) for r in ref_tokens), worst


if __name__ == "__main__":
    main()
