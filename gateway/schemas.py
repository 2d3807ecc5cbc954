"""HTTP bodies in OpenAI shapes; validated here, never sent to Redis as they are."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

TokenId = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's legacy completions body; options microbatch does not implement are refused."""

    model_config = ConfigDict(extra="ignore")

    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        description="A string, a list of strings, a token list or a list of token lists"
    )
    model: StrictStr | None = Field(default=None, max_length=256)
    max_tokens: StrictInt = Field(default=16, ge=1, description="New tokens at most")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None, description="Up to 4 sequences that end generation (not returned)"
    )
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(default=1, ge=1, le=1, description="Only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    return_token_ids: bool = Field(
        default=False, description="Also return each choice's generated token ids (as vLLM)"
    )
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    logprobs: None = None
    suffix: None = None
