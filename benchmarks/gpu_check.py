"""The checks to run whenever a GPU machine is lent: one script, well inside 10 minutes.

    .venv/bin/python benchmarks/gpu_check.py                  # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu     # the same path here, to try it

1. embeddings, offline against served (`benchmarks/embeddings.py --quick`, short mix, the
   offline limit and `serve` arms): the ratio that says the queue keeps the device busy;
2. generation on the device through the HTTP API with the `openai` client: greedy, sampled
   with a seed (twice: same text), log-probabilities with top 5, `logit_bias` forcing a
   token, and a JSON-schema `response_format` whose answer must parse and validate, in
   float32 and in `dtype auto` (bfloat16 on CUDA);
   and the same with `engine vllm` where vLLM is installed (`microbatch[vllm]`) and the
   trained model is built (the tiny model's 16-wide heads are below vLLM's kernels' sizes);
3. the generation servers side by side (`benchmarks/gen_servers.py`, float32 and bfloat16),
   on the trained SmolLM2 where `../shared/models/fetch-trained.sh` has built it.
Each part prints PASS or FAIL with what it saw; the exit status is the number of failures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.embed_servers import microbatch_serve

ROOT = Path(__file__).resolve().parent.parent
TRAINED = Path("~/.cache/microbatch-models/smollm2-135m-instruct").expanduser()
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def script(name: str, *args: str, timeout: int) -> tuple[bool, str]:
    """Run a sibling benchmark; its success and the tail of what it printed."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return run.returncode == 0, (run.stdout + run.stderr)[-1500:]


def generation_checks(url: str) -> list[str]:
    """What is wrong with the device's answers (empty: nothing)."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "Name one colour."}]
    problems = []

    def chat(**kw):
        return client.chat.completions.create(model="m", messages=ask, **{"max_tokens": 16, **kw})

    greedy = [chat(temperature=0).choices[0].message.content for _ in range(2)]
    if greedy[0] != greedy[1] or not greedy[0]:
        problems.append(f"greedy differs or is empty: {greedy}")
    sampled = [chat(temperature=0.9, seed=7).choices[0].message.content for _ in range(2)]
    if sampled[0] != sampled[1]:
        problems.append(f"a seeded sample differs: {sampled}")
    scored = chat(temperature=0, logprobs=True, top_logprobs=5).choices[0]
    content = scored.logprobs.content if scored.logprobs else []
    if not content or any(len(t.top_logprobs) != 5 for t in content):
        problems.append("log-probabilities missing or without 5 alternatives")
    forced = chat(temperature=0, max_tokens=3, logit_bias={"42": 100}, logprobs=True).choices[0]
    tokens = forced.logprobs.content if forced.logprobs else []
    if len(tokens) != 3 or len({t.token for t in tokens}) != 1:
        problems.append(f"logit_bias 100 did not force one token: {[t.token for t in tokens]}")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    answer = client.chat.completions.create(
        # room for the schema's whitespace runs (16 at most each, between every two tokens)
        model="m",
        messages=ask,
        max_tokens=256,
        temperature=0.7,
        seed=1,
        response_format=fmt,
    )
    try:
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), PERSON)
    except (ValueError, jsonschema.ValidationError) as exc:
        problems.append(f"structured output does not validate: {exc}")
    return problems


def on(args: argparse.Namespace, dtype: str) -> dict[str, str]:
    return {"device": args.device, "dtype": dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    failures = 0

    def report(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}\n{detail}\n", flush=True)

    quick = ["--quick", "--mixes", "short", "--arms", "offline-limit,serve"]
    ok, out = script("embeddings.py", *quick, "--device", args.device, timeout=240)
    report("embeddings", ok and "unavailable" not in out, out)
    model = TRAINED if (TRAINED / "config.json").is_file() else None
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from worker.generate.tiny_model import write_tiny_model

            model = write_tiny_model(Path(tmp) / "tiny")
        variants: list[tuple[str, dict[str, object]]] = [("float32", {}), ("auto", {})]
        if importlib.util.find_spec("vllm") and model == TRAINED:
            variants.append(("auto", {"engine": "vllm", "kv_cache_tokens": 65_536}))
        for dtype, extra in variants:
            name = f"generation on {args.device}, dtype {dtype}, {model.name} {extra or ''}"
            try:
                with microbatch_serve(
                    "check",
                    Path(tmp),
                    model=model,
                    served_model_name="m",
                    **on(args, dtype),
                    **extra,
                ) as server:
                    problems = generation_checks(server.url)
                report(name, not problems, "; ".join(problems) or "every answer well formed")
            except Exception as exc:  # a check that cannot start is a failure, said
                report(name, False, repr(exc)[:800])
    if model == TRAINED:
        small = ["--requests", "32", "--arms", "mb-fp32,mb-bf16", "--device", args.device]
        report("generation servers", *script("gen_servers.py", *small, timeout=300))
    else:
        print("SKIP generation servers: no trained model (../shared/models/fetch-trained.sh)")
    sys.exit(failures)


if __name__ == "__main__":
    main()
