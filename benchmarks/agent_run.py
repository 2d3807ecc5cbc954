"""Tool calling on a trained model: forced calls sampled, then an OpenAI Agents SDK agent.

    ../shared/models/fetch-trained.sh                  # SmolLM2-135M-Instruct, once
    .venv/bin/python benchmarks/agent_run.py           # 200 forced calls, 10 + 10 agent runs

First `--calls` choices (temperature 1, seeded, 10 per request) with `tool_choice` required
and one call each: how many parse and validate against the tool's schema (goal: all).

The agent runs twice over: on chat completions (`OpenAIChatCompletionsModel`) and on the
Responses API (`OpenAIResponsesModel`, the SDK's default, streamed). Each run asks for the
weather in another city; the first turn must call the tool
(`tool_choice` required, the SDK resets it to auto after), the tool answers a temperature
drawn for that run, and the run ends with the model's answer. Printed per run: whether it
completed, the call's arguments (valid against the tool's schema: the grammar guarantees it),
and whether the final answer quotes the temperature the tool returned; then the shares.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.embed_servers import microbatch_serve

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome", "Seoul", "Perth"]


async def one_run(url: str, city: str, degrees: int, api: str) -> dict:
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
    )

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is {degrees} degrees Celsius and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather using the get_weather tool.",
        model=(OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
            model="smol", openai_client=client
        ),
        model_settings=ModelSettings(
            tool_choice="required", temperature=0.0, max_tokens=96, parallel_tool_calls=False
        ),
        tools=[get_weather],
    )
    async with client:
        result = await Runner.run(agent, f"What is the weather in {city}?", max_turns=4)
    answer = str(result.final_output)
    return {"calls": calls, "answer": answer, "uses_output": str(degrees) in answer}


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}


def forced_calls(url: str, choices: int) -> int:
    """Sampled forced calls that parse and validate against their tool's schema."""
    import json

    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    valid = 0
    for seed in range(0, choices // 10 * 10, 10):  # choice c draws from seed + c
        answer = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Weather in Lima?"}],
            tools=[tool], tool_choice="required", parallel_tool_calls=False, n=10,
            temperature=1.0, seed=seed, max_tokens=256,
            extra_headers={"X-Microbatch-Timeout-Ms": "300000"},
        )  # fmt: skip
        for choice in answer.choices:
            if choice.finish_reason != "tool_calls":
                print(f"  not a call: {choice.finish_reason} {choice.message.content!r:.160}")
            for call in choice.message.tool_calls or []:
                try:
                    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
                except (ValueError, jsonschema.ValidationError):
                    continue
                valid += call.function.name == "get_weather"
    return valid


async def all_runs(url: str, runs: int, api: str) -> tuple[int, int, int]:
    """Completed runs, runs that called the tool, answers that quote its output."""
    rng = random.Random(0)
    done = called = used = 0
    for i in range(runs):
        city, degrees = CITIES[i % len(CITIES)], rng.randint(3, 39)
        try:
            run = await one_run(url, city, degrees, api)
        except Exception as exc:  # a run that fails is counted, with why
            print(f"{city}: FAILED {exc!r}"[:300])
            continue
        done += 1
        called += bool(run["calls"])
        used += run["uses_output"]
        print(f"{city} ({degrees}): calls {run['calls']} answer {run['answer'][:120]!r}")
    return done, called, used


def main() -> None:
    from agents import set_tracing_disabled

    default = Path("~/.cache/microbatch-models/smollm2-135m-instruct").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run ../shared/models/fetch-trained.sh")
    set_tracing_disabled(True)
    with (
        tempfile.TemporaryDirectory() as tmp,
        microbatch_serve("agent", Path(tmp), model=args.model, served_model_name="smol") as s,
    ):
        valid = forced_calls(s.url, args.calls)
        print(f"forced calls that parse and validate: {valid}/{args.calls // 10 * 10}")
        for api in ("chat", "responses"):
            done, called, used = asyncio.run(all_runs(s.url, args.runs, api))
            print(
                f"{api}: completed {done}/{args.runs}, tool called {called}/{args.runs}, "
                f"answer quotes the tool's output {used}/{args.runs}"
            )


if __name__ == "__main__":
    main()
