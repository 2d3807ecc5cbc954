"""HTTP bodies of the rerank, classify and TEI routes, in each ecosystem's own shape.

Jina's and Cohere's rerank (as vLLM and infinity serve it), vLLM's classify, and Hugging Face
text-embeddings-inference's embed, rerank, predict and decode. Unknown fields are ignored, as
the peers do; a field that would change the answer and is not served is refused, not ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from gateway.schemas import TokenId

Direction = Literal["left", "right"]


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    """Jina's and vLLM's `/v1/rerank`, Cohere's `/v2/rerank`: documents as strings or `{text}`."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    query: StrictStr
    documents: list[StrictStr | TextDocument]
    top_n: StrictInt | None = Field(default=None, ge=0, description="0 or none: all")
    return_documents: bool = True
    truncate: bool = Field(default=False, description="Cut documents to fit instead of 413")
    truncation_direction: Direction = "right"
    raw_scores: bool = Field(default=False, description="Logits instead of relevance scores")
    # Cohere's: documents cut to this many tokens (its default truncates to 4096)
    max_tokens_per_doc: StrictInt | None = Field(default=None, gt=0)
    relevant_spans: bool | dict | None = None  # Cohere's; not served: refused when asked for
    # vLLM's: not served; refused (it would change the answer), never ignored
    truncate_prompt_tokens: None = Field(default=None, description="not served: use truncate")

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class TeiRerankRequest(BaseModel):
    """TEI's `/rerank`: `texts` for `documents`, answered as a bare list."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = False
    truncation_direction: Direction = "right"


class ClassifyRequest(BaseModel):
    """vLLM's `/classify`: one text or several, each scored over the model's labels."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    input: StrictStr | list[StrictStr]
    truncate: bool = False
    activation: bool = Field(default=True, description="false: raw logits")
    truncate_prompt_tokens: None = Field(default=None, description="not served: use truncate")


Sequence = StrictStr | tuple[StrictStr, StrictStr]


class PredictParameters(BaseModel):
    """The `parameters` Hugging Face's InferenceClient sends with text classification."""

    model_config = ConfigDict(extra="ignore")

    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    top_k: StrictInt | None = Field(default=None, gt=0)


class PredictRequest(BaseModel):
    """TEI's `/predict`: a text, a [text, text] pair, or a list of either."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    inputs: Sequence | list[Sequence]
    raw_scores: bool = False
    truncate: bool | None = False
    truncation_direction: Direction = "right"
    parameters: PredictParameters | None = None


class TeiEmbedRequest(BaseModel):
    """TEI's `/embed` (and what Hugging Face's InferenceClient sends for feature extraction)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    inputs: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    normalize: bool = True
    truncate: bool | None = False
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None
    dimensions: StrictInt | None = Field(default=None, gt=0)
    encoding_format: Literal["float"] | None = Field(
        default=None, description="TEI answers floats; base64 is /v1/embeddings'"
    )


class TeiDecodeRequest(BaseModel):
    """TEI's `/decode`: token ids (one list or several) back to text."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    ids: list[TokenId] | list[list[TokenId]]
    skip_special_tokens: bool = True


class TeiTokenizeRequest(BaseModel):
    """TEI's `/tokenize`: `inputs` (a text or texts), answered with each token's text and
    character span."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(default=None, max_length=256)
    inputs: StrictStr | list[StrictStr]
    add_special_tokens: bool = True
    prompt_name: StrictStr | None = None
