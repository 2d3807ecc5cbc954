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
