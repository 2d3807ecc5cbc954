"""The body of `POST /v1/responses`, as OpenAI's `CreateResponse` describes it.

Input is a string or items: messages (string or `input_text`/`output_text` parts),
`function_call` and `function_call_output`. Options that would change the answer and are not
built here (built-in tools, reasoning, truncation `auto`, log probabilities, stored prompts,
conversations) are refused by name; bookkeeping fields (`service_tier`, `safety_identifier`,
`stream_options`, `max_tool_calls`, which counts built-in tools only) are read and left.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    model_validator,
)

from gateway.schemas import JsonSchemaFormat

MAX_ITEMS = 1024
# OpenAI's Metadata: at most 16 pairs, keys to 64 characters, values to 512
Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


class _ResponseItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = Field(default=None, max_length=256)


class ResponseInputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: StrictStr


class ResponseMessageItem(_ResponseItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[ResponseInputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFunctionCallItem(_ResponseItem):
    type: Literal["function_call"]
    call_id: StrictStr = Field(max_length=256)
    name: StrictStr = Field(max_length=64)
    arguments: StrictStr


class ResponseFunctionCallOutputItem(_ResponseItem):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(max_length=256)
    output: StrictStr | list[ResponseInputText]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = Annotated[
    ResponseMessageItem | ResponseFunctionCallItem | ResponseFunctionCallOutputItem,
    Field(discriminator="type"),
]


class ResponseFunctionTool(BaseModel):
    """A Responses function tool: flat (`name` beside `type`), unlike chat's."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseNamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: StrictStr


class ResponseTextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or one JSON schema (flat, as Responses
    writes it: `name` and `schema` beside `type`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = Field(default=None, max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseTextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError(
                "text.format needs name and schema with type json_schema, and only then"
            )
        return self

    def as_json_schema(self) -> JsonSchemaFormat | None:
        if self.type != "json_schema":
            return None
        assert self.name is not None and self.schema_ is not None
        return JsonSchemaFormat(
            name=self.name, description=self.description, schema=self.schema_, strict=self.strict
        )


class ResponseTextParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)
    verbosity: Literal["medium"] | None = None  # low/high would change the answer: refused


class CreateResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    input: StrictStr | list[InputItem] = Field(max_length=MAX_ITEMS)
    instructions: StrictStr | None = None
    tools: list[ResponseFunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseTextParam | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    previous_response_id: StrictStr | None = Field(default=None, max_length=256)
    metadata: Metadata | None = Field(default=None, max_length=16)
    user: StrictStr | None = Field(default=None, max_length=256)
    prompt_cache_key: StrictStr | None = Field(default=None, max_length=256)
    truncation: Literal["disabled"] | None = None
    # refused when set: each would change the answer, and none is built here
    reasoning: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    conversation: Any = None
    prompt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        """An input message may leave out `"type": "message"` (OpenAI's EasyInputMessage);
        a non-function tool is named in its refusal rather than lost in a union's errors."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [_typed(i) for i in data["input"]]}
        for tool in data.get("tools") or [] if isinstance(data, dict) else []:
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(
                    f"tools of type {tool.get('type')!r} are not served here; only function tools"
                )
        return data

    @model_validator(mode="after")
    def _refused(self) -> CreateResponse:
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none") or (self.reasoning or {}).get("summary"):
            raise ValueError("reasoning is not served here: the models served do not reason")
        if self.include:
            raise ValueError(f"include {self.include} is not served here")
        if self.top_logprobs:
            raise ValueError(
                "top_logprobs is not served on /v1/responses; use /v1/chat/completions"
            )
        if self.conversation is not None or self.prompt is not None:
            raise ValueError(
                "conversation and prompt objects are not served here; "
                "use previous_response_id and input"
            )
        if self.background and self.store is False:
            raise ValueError("background needs store: true")
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("two tools share a name")
        choice = self.tool_choice
        if isinstance(choice, ResponseNamedFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, not among the tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice required needs tools")
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False


def _typed(item: Any) -> Any:
    if isinstance(item, dict) and "type" not in item and "role" in item:
        return {**item, "type": "message"}
    return item
