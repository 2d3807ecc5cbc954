"""`POST /v1/chat/completions`: messages rendered with the model's own chat template.

The template is the Jinja text the worker registered from the model's tokenizer config, run
in Jinja's immutable sandbox as transformers' `apply_chat_template` runs it (same globals,
`add_generation_prompt=True`), then tokenized without adding special tokens again. From
there a chat request is a one-prompt completion: same queue, engine, streaming and errors.
"""

from __future__ import annotations

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


def render(model: ModelEntry, chat: list[ChatMessage]) -> str:
    """The prompt text the model was trained to continue; 400 when the template refuses."""
    info = model.info
    if not info.chat_template:
        raise InvalidRequest(
            f"model {info.name!r} has no chat template; use /v1/completions", param="model"
        )
    messages = [{"role": m.role, "content": m.text()} for m in chat]
    try:
        return _compiled(info.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=info.bos_token,
            eos_token=info.eos_token,
        )
    except TemplateError as exc:
        raise InvalidRequest(
            f"the model's chat template refused: {exc}", param="messages"
        ) from None


async def _chat_prompt(
    services: Services, model: ModelEntry, req: ChatCompletionRequest
) -> Prompts:
    text = render(model, req.messages)
    ids = await services.tokenize.run(len(text), model.tokenizer.encode_plain, text)
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return Prompts([ids], new_token_limits([ids], req.new_tokens, model.info.max_tokens, param))


async def chat_completions(request: Request) -> Response:
    return await serve_generation(request, CHAT, ChatCompletionRequest, _chat_prompt)
