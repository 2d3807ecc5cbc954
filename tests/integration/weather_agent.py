"""The OpenAI Agents SDK agent both generation APIs are proven with: one bounded weather
tool (a random model's string closes within its tokens), the first turn forced to call it.

`run_agent` runs it to its end on a model class of the SDK's (chat completions or the
Responses API) and returns the run and the calls its tool received."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import openai
from pydantic import Field


def run_agent(base: str, model_class: str, **agent: Any) -> tuple[Any, list[tuple[str, str]]]:
    """Run the weather agent against `base` on `agents.<model_class>`; `agent` adds to (or
    replaces) the Agent's arguments."""
    import agents

    agents.set_tracing_disabled(True)  # the SDK would export its traces to OpenAI
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(
        city: Annotated[str, Field(max_length=12)], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return f"18 degrees {unit} in {city}"

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    settings = agents.ModelSettings(
        tool_choice="required", temperature=1.0, max_tokens=200, parallel_tool_calls=False
    )
    built = agents.Agent(
        **{
            "name": "weather",
            "instructions": "Answer with the weather.",
            "model": getattr(agents, model_class)(model="tiny", openai_client=client),
            "model_settings": settings,
            "tools": [get_weather],
            **agent,
        }
    )

    async def run() -> Any:
        async with client:  # closed on the loop that opened its connections
            return await agents.Runner.run(built, "Weather in Paris?", max_turns=4)

    return asyncio.run(run()), calls
