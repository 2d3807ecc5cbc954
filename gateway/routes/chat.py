"""`POST /v1/chat/completions`: messages rendered with the model's own chat template.

The template is the Jinja text the worker registered from the model's tokenizer config, run
in Jinja's immutable sandbox as transformers' `apply_chat_template` runs it (same globals,
`add_generation_prompt=True`), then tokenized without adding special tokens again. From
there a chat request is a one-prompt completion: same queue, engine, streaming and errors.

Tools are offered as transformers offers them, through the template's own `tools` variable,
where the template reads one; otherwise the default tool prompt (gateway/tool_calls.py) joins
the system message, and a history's calls and tool results are written in its format.
"""

from __future__ import annotations

import json
from functools import lru_cache

from fastapi import Request
from fastapi.responses import Response
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidRequest
from gateway.catalog import ModelEntry
from gateway.routes.answers import Format
from gateway.routes.generation import Prompts, new_token_limits, serve_generation
from gateway.schemas import ChatCompletionRequest, ChatMessage, openapi_body
from gateway.services import Services
from gateway.tool_calls import as_text, default_prompt

ROUTE = "/v1/chat/completions"
SCHEMA = openapi_body(ChatCompletionRequest)
CHAT = Format(ROUTE, "chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=32)
def _compiled(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render(model: ModelEntry, chat: list[ChatMessage], tools: list[dict] | None = None) -> str:
    """The prompt text the model was trained to continue; 400 when the template refuses."""
    info = model.info
    if not info.chat_template:
        raise InvalidRequest(
            f"model {info.name!r} has no chat template; use /v1/completions", param="model"
        )
    native = "tools" in info.chat_template
    messages = [_message(m, native) for m in chat]
    if tools and not native:
        messages = _offered(messages, default_prompt(tools))
    extra = (
        {"tools": [{"type": "function", "function": t} for t in tools]} if tools and native else {}
    )
    try:
        return _compiled(info.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=info.bos_token,
            eos_token=info.eos_token,
            **extra,
        )
    except TemplateError as exc:
        raise InvalidRequest(
            f"the model's chat template refused: {exc}", param="messages"
        ) from None


def _message(m: ChatMessage, native: bool) -> dict:
    """One message as a template reads it: calls and tool results as transformers passes
    them to a template that takes tools, else written out in the default prompt's format."""
    calls = m.tool_calls or []
    if native:
        out: dict = {"role": m.role, "content": m.text()}
        if calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": _function(c.function)} for c in calls
            ]
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        return out
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    written = [as_text(c.function.name, c.function.arguments) for c in calls]
    return {"role": m.role, "content": "\n".join([m.text(), *written]).strip()}


def _function(function) -> dict:
    """A past call's function with its arguments as an object, as templates expect them."""
    try:
        arguments = json.loads(function.arguments)
    except ValueError:
        arguments = function.arguments
    return {"name": function.name, "arguments": arguments}


def _offered(messages: list[dict], prompt: str) -> list[dict]:
    """The tool prompt joined to the system message, or as one where there is none."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


async def chat_prompt(services: Services, model: ModelEntry, req: ChatCompletionRequest) -> Prompts:
    text = render(model, req.messages, req.functions if req.tool_mode != "none" else None)
    ids = await services.tokenize.run(len(text), model.tokenizer.encode_plain, text)
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return Prompts([ids], new_token_limits([ids], req.new_tokens, model.info.max_tokens, param))


async def chat_completions(request: Request) -> Response:
    return await serve_generation(request, CHAT, ChatCompletionRequest, chat_prompt)
