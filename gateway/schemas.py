"""HTTP bodies in OpenAI shapes; validated here, never sent to Redis as they are."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from gateway.tool_calls import ToolUse, forced_schema

TokenId = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16  # n and best_of: more would hold one request's rows over a whole engine
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        description="A string, a list of strings, a token list or a list of token lists"
    )
    model: StrictStr | None = Field(default=None, max_length=256)
    encoding_format: Literal["float", "base64"] = "float"
    truncate: bool = Field(
        default=False, description="Cut inputs to the model's limit instead of 413"
    )
    dimensions: StrictInt | None = Field(default=None, gt=0)
    user: StrictStr | None = None
    # beyond OpenAI, as TEI and vLLM take them
    normalize: bool | None = Field(
        default=None, description="L2-normalize; default: as the model does, or with dimensions"
    )
    truncation_direction: Literal["left", "right"] = "right"
    prompt_name: StrictStr | None = Field(
        default=None, description="A prompt from the model's sentence-transformers config"
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the answer must follow."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr = Field(max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class GenerationParams(BaseModel):
    """What both generation routes share; options microbatch does not implement are refused."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    max_tokens: StrictInt = Field(default=16, ge=1, description="New tokens at most")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None, description="Up to 4 sequences that end generation (not returned)"
    )
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(
        default=1, ge=1, le=MAX_CHOICES, description="Choices per prompt; its prefill is shared"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    return_token_ids: bool = Field(
        default=False, description="Also return each choice's generated token ids (as vLLM)"
    )
    # Sampling controls (OpenAI's, and vLLM's extensions), applied in this order to the
    # logits: logit_bias, min_tokens, repetition_penalty, frequency and presence penalties,
    # then temperature, top_k, top_p, min_p.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0, description="vLLM's: over prompt and output; 1 = off"
    )
    logit_bias: dict[StrictStr, float] | None = Field(
        default=None, description="Token id (as a string) to a bias in -100..100"
    )
    min_tokens: StrictInt = Field(default=0, ge=0, description="No EOS or stop token before")
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = Field(default=False, description="Generate to max_tokens past EOS")
    top_k: StrictInt = Field(default=-1, ge=-1, description="-1 or 0: every token")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    response_format: ResponseFormat | None = Field(
        default=None, description="JSON output: any object, or one JSON schema (enforced)"
    )

    @property
    def candidates(self) -> int:
        """Choices generated per prompt."""
        return self.n

    @property
    def shown_logprobs(self) -> int | None:
        """Alternatives shown per generated token; None: no log probabilities."""
        return None

    @property
    def prompt_logprobs(self) -> int:
        """Alternatives per prompt token to compute; -1: the prompt is not scored."""
        return -1


class CompletionRequest(GenerationParams):
    """OpenAI's legacy completions body."""

    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        description="A string, a list of strings, a token list or a list of token lists"
    )
    max_tokens: StrictInt = Field(
        default=16, ge=0, description="New tokens at most; 0 (with echo) scores the prompt"
    )
    echo: bool = Field(default=False, description="Return the prompt before the completion")
    best_of: StrictInt | None = Field(
        default=None, ge=1, le=MAX_CHOICES, description="Generate this many, return the n best"
    )
    logprobs: StrictInt | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token, 0-20"
    )
    suffix: None = None

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 only scores a prompt: it needs echo")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and self.candidates > self.n:
            raise ValueError("best_of above n cannot be streamed: the best are known at the end")
        return self

    @property
    def candidates(self) -> int:
        """Choices generated per prompt: best_of, else n."""
        return self.best_of or self.n

    @property
    def shown_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int:
        return self.logprobs if self.echo and self.logprobs is not None else -1


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(max_length=64)
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """A call an assistant made earlier in the history."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: StrictStr | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except on an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionTool(BaseModel):
    """A function the model may call: its parameters are a JSON Schema object."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionTool


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: this function must be called."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationParams):
    """OpenAI's chat completions body, rendered with the model's own chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=None, description="Log probabilities of each token")
    top_logprobs: StrictInt | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token (with logprobs)"
    )
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, not among the tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice required needs tools")
        if len(set(names)) != len(names):
            raise ValueError("two tools share a name")
        return self

    @model_validator(mode="after")
    def _forced_call_as_a_schema(self) -> ChatCompletionRequest:
        """A forced call is generated under its schema, as `response_format` answers are
        (gateway/tool_calls.py says why); streamed scores are refused. A `response_format`
        shapes a text answer, and a forced call's turn has none: the call's schema applies
        (as OpenAI answers, and as agent SDKs that send both on every turn expect)."""
        mode = self.tool_mode
        if mode != "none" and (self.logprobs or self.return_token_ids):
            # a choice read for calls is sent whole: per-token details would not match it
            raise ValueError("logprobs and return_token_ids cannot be combined with tools")
        if mode not in ("required", "named"):
            return self
        named = self.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        schema = forced_schema(self.functions, named, self.parallel_tool_calls)
        self.response_format = ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(name="tool_calls", schema=schema)
        )
        return self

    @property
    def functions(self) -> list[dict[str, Any]]:
        """The offered functions as plain dicts (name, description, parameters)."""
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def tool_use(self) -> ToolUse | None:
        """How the answers are read for calls; None where no tools are offered."""
        mode = self.tool_mode
        if mode == "none":
            return None
        names = frozenset(t.function.name for t in self.tools or [])
        parallel = self.parallel_tool_calls and mode == "required"
        return ToolUse(names, forced=mode in ("required", "named"), parallel=parallel)

    @property
    def tool_mode(self) -> str:
        """`none` (no tools offered), `auto`, `required`, or `named`."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def shown_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def new_tokens(self) -> int | None:
        """What the client asked for; None: up to the model's context, as vLLM does."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if "max_tokens" in self.model_fields_set else None


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages rendered with the model's template."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)
    add_special_tokens: bool | None = Field(
        default=None, description="Default: true for a prompt, false for rendered messages"
    )

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    tokens: list[TokenId] = Field(max_length=1 << 17)


def openapi_body(schema: type[BaseModel]) -> dict:
    """A route's OpenAPI request body: its JSON schema, required (the hot routes read the body
    themselves, so FastAPI learns the schema from here)."""
    content = {"application/json": {"schema": schema.model_json_schema()}}
    return {"requestBody": {"required": True, "content": content}}
