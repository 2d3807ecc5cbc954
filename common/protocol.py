"""Wire messages: one frozen dataclass per message, one strict msgpack codec, never pickle.

Every message is a flat msgpack map `{"t": tag, "v": version, <fields>}`. Decoding checks the
size, the tag, the version, the exact field set and every field's type before a dataclass is
built, so a malformed entry becomes a `ProtocolError` value the caller dead-letters.
Token ids travel as packed little-endian uint32 bytes and vectors as float32 bytes.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import msgpack
import numpy as np

from common.message_checks import MAX_ENTRY_ROWS as MAX_ENTRY_ROWS
from common.message_checks import MAX_STOP_SEQUENCES as MAX_STOP_SEQUENCES
from common.message_checks import ProtocolError as ProtocolError
from common.message_checks import VersionMismatch as VersionMismatch
from common.message_checks import addressed, check_consistent, check_field, field_types
from common.scores import Scores as Scores
from common.wire_compat import OLDEST, VERSION, downgraded, readable, upgraded

MAX_MESSAGE_BYTES = 1 << 22  # 4 MiB: a 512-token entry is ~2 KiB; a 4096-d vector 16 KiB
REPLY_HEADROOM_BYTES = 1 << 16  # a reply's fields besides its vectors (batch ids, names)


def rows_that_fit(dim: int) -> int:
    """Most rows of `dim` float32s one reply can carry: what a gateway sizes entries by."""
    return max(1, (MAX_MESSAGE_BYTES - REPLY_HEADROOM_BYTES) // (4 * max(1, dim)))


PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 1
PRIORITY_BACKGROUND = 2  # a Batch API line, below all online traffic (v5 reads it as batch)


class ModelKind(StrEnum):
    """How a model runs, and so which routes serve it. A `StrEnum`: on the wire (ModelInfo's
    `kind`) it is its plain value, so every wire version reads it the same."""

    EMBEDDING = "embedding"  # an encoder: one pooled vector per input
    CLASSIFIER = "classifier"  # a cross-encoder or classifier: logits per input or pair
    CAUSAL_LM = "causal-lm"  # generation


MAX_LABELS = 1024  # a classifier's labels: the longest list a message may carry


class _Tokens:
    """Token ids carried as packed uint32 bytes in a `tokens` field."""

    __slots__ = ()
    tokens: bytes

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // 4

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<u4")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestEntry(_Tokens):
    """Rows of one client request that share a length bucket, queued on that bucket's stream.

    A request's rows travel in as few entries as its buckets and `max_entry_rows` allow, so
    Redis costs a few commands per request rather than per input; the worker batches rows
    across entries and answers each entry once, when all its rows are computed.
    """

    TAG: ClassVar[str] = "req"
    id: str  # "<gateway-unique id>.<part>": the key the reply is routed by
    request_id: str  # the client's X-Request-ID (or the generated one), for logs
    model: str
    tokens: bytes  # every row's uint32 little-endian token ids, special tokens included
    lengths: bytes  # uint32 little-endian: each row's token count, in order
    deadline_ms: int  # unix epoch ms after which nobody waits for the answer
    priority: int  # PRIORITY_INTERACTIVE, PRIORITY_BATCH or PRIORITY_BACKGROUND
    reply_to: str  # the reply stream of the gateway process that asked
    enqueued_ms: int  # unix epoch ms when the gateway queued it
    traceparent: str = ""  # W3C trace context of the request that queued it; "" untraced
    tracestate: str = ""
    v: int = VERSION

    def row_lengths(self) -> np.ndarray:
        return np.frombuffer(self.lengths, dtype="<u4")

    @property
    def longest(self) -> int:
        """Its longest row's tokens: what its bucket and the model's limit are judged by."""
        if len(self.lengths) == 4:  # one row, the common case: no array for it
            return int.from_bytes(self.lengths, "little")
        return int(self.row_lengths().max())

    def rows(self) -> list[np.ndarray]:
        """Each row's token ids, as views of `tokens`."""
        if len(self.lengths) == 4:
            return [self.token_ids()]
        ids, ends = self.token_ids(), np.cumsum(self.row_lengths()).tolist()
        return [ids[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateEntry(_Tokens):
    """One prompt of a completion request, queued on its model's bucket stream by length."""

    TAG: ClassVar[str] = "genreq"
    id: str
    request_id: str
    model: str
    tokens: bytes  # the prompt, uint32 little-endian
    deadline_ms: int
    priority: int
    reply_to: str
    enqueued_ms: int
    max_tokens: int  # new tokens at most
    temperature: float  # 0 = greedy
    top_p: float
    seed: int  # -1 = unseeded
    stop: list[str]  # stop sequences, at most MAX_STOP_SEQUENCES
    stream: bool  # send a chunk per step, or one final answer
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    repetition_penalty: float = 1.0  # vLLM's: divides (multiplies) prompt and output logits
    bias_tokens: bytes = b""  # logit_bias token ids, uint32 little-endian
    bias_values: bytes = b""  # their biases, float32 little-endian, in the same order
    min_tokens: int = 0  # EOS and stop_token_ids are impossible before this many tokens
    stop_token_ids: bytes = b""  # uint32 little-endian: generating one ends the sequence
    ignore_eos: bool = False  # EOS is an ordinary token: generate to max_tokens
    top_k: int = 0  # sample among the k likeliest tokens; 0 = all
    min_p: float = 0.0  # drop tokens under min_p x the likeliest one's probability
    n: int = 1  # choices generated from this prompt, its prefill shared
    logprobs: int = -1  # alternatives reported per generated token; -1: no log probabilities
    prompt_logprobs: int = -1  # the same for the prompt's tokens (echo); -1: none
    response_format: str = ""  # "", "json_object" or "json_schema"
    json_schema: str = ""  # the schema, as JSON text, when response_format is "json_schema"
    traceparent: str = ""  # as RequestEntry's
    tracestate: str = ""
    v: int = VERSION

    @property
    def longest(self) -> int:
        return self.n_tokens

    def stop_ids(self) -> np.ndarray:
        return np.frombuffer(self.stop_token_ids, dtype="<u4")

    def logit_bias(self) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(self.bias_tokens, "<u4"), np.frombuffer(self.bias_values, "<f4")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationChunk(_Tokens):
    """New text of one generating sequence; the last chunk of an attempt has `finish_reason`.

    `attempt` names one worker's run of the entry: after a crash a peer starts over under a
    new attempt, which tells the gateway that text it already streamed would be repeated.
    """

    TAG: ClassVar[str] = "gen"
    id: str
    attempt: str
    index: int  # chunk number within the attempt, from 0
    text: str
    tokens: bytes  # the token ids this chunk adds, uint32 little-endian
    finish_reason: str  # "" while generating, else "stop" or "length"
    prompt_tokens: int
    completion_tokens: int  # generated so far, this chunk included
    cached_tokens: int  # prompt tokens its first prefill took from the prefix cache
    queue_ms: float  # enqueue to first scheduling
    worker: str
    choice: int = 0  # which of the entry's `n` choices
    logprobs: bytes = b""  # float32 per token of `tokens`: its raw log probability
    top_ids: bytes = b""  # uint32 [tokens x k]: each token's k likeliest alternatives
    top_logprobs: bytes = b""  # float32 [tokens x k]: their log probabilities
    prompt_logprobs: bytes = b""  # float32 per prompt token (the first NaN); first chunk only
    prompt_top_ids: bytes = b""  # uint32 [prompt x k]
    prompt_top_logprobs: bytes = b""  # float32 [prompt x k]
    v: int = VERSION

    def scores(self) -> Scores | None:
        """The generated tokens' log probabilities, when they were asked for."""
        return Scores.unpack(self.logprobs, self.top_ids, self.top_logprobs)

    def prompt_scores(self) -> Scores | None:
        return Scores.unpack(self.prompt_logprobs, self.prompt_top_ids, self.prompt_top_logprobs)


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingResult:
    """The answer to one `RequestEntry`: a vector per row, with the timings that become tuning
    headers."""

    TAG: ClassVar[str] = "emb"
    id: str
    embeddings: bytes  # float32 little-endian, [rows x dim], the entry's row order
    rows: int
    n_tokens: int  # of all rows
    batch_ids: list[str]  # the batches its rows ran in
    batch_size: int  # the largest of them
    bucket: int
    queue_ms: float  # enqueue to its first batch's start
    compute_ms: float  # of its batches, together
    worker: str
    v: int = VERSION

    def vectors(self) -> np.ndarray:
        return np.frombuffer(self.embeddings, dtype="<f4").reshape(self.rows, -1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply:
    """A request that failed in the worker; `status` and `type` reach the client as is."""

    TAG: ClassVar[str] = "err"
    id: str
    status: int
    type: str
    code: str
    message: str
    worker: str
    v: int = VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """An entry no worker could process, kept with its raw bytes for an operator."""

    TAG: ClassVar[str] = "dead"
    stream: str
    entry_id: str
    reason: str
    deliveries: int
    payload: bytes
    worker: str
    v: int = VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """What a worker registers so gateways can validate and tokenize without model files."""

    TAG: ClassVar[str] = "model"
    name: str
    kind: str  # a ModelKind value
    dim: int
    max_tokens: int
    vocab_size: int
    tokenizer_sha256: str
    chat_template: str  # Jinja, as in tokenizer_config.json; "" when the model has none
    bos_token: str  # the special tokens a chat template may name
    eos_token: str
    aliases: list[str]  # other names clients may use for it (served_model_name), at most 4
    fingerprint: str = ""  # changes when the weights, config or serving code change
    labels: list[str] = dataclasses.field(default_factory=list)  # a classifier's, by id
    activation: str = ""  # a classifier's default score function: sigmoid, softmax, identity
    normalized: bool = False  # an embedding model whose own modules L2-normalize its vectors
    matryoshka: bool = False  # trained so a vector's first dimensions are an embedding too
    matryoshka_dims: list[int] = dataclasses.field(default_factory=list)  # [] with it: any
    prompts: dict[str, str] = dataclasses.field(default_factory=dict)  # sentence-transformers'
    default_prompt: str = ""  # the prompt name used when a request names none
    v: int = VERSION


Message = (
    RequestEntry
    | GenerateEntry
    | GenerationChunk
    | EmbeddingResult
    | ErrorReply
    | DeadLetter
    | ModelInfo
)
_CLASSES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        RequestEntry,
        GenerateEntry,
        GenerationChunk,
        EmbeddingResult,
        ErrorReply,
        DeadLetter,
        ModelInfo,
    )
}


_SCHEMAS = {tag: field_types(cls) for tag, cls in _CLASSES.items()}
# per field, the exact builtins msgpack makes that pass at a glance; others: `check_field`
_PLAIN = {
    tag: {
        name: frozenset() if allowed[0] in (list, dict) else frozenset(allowed)
        for name, allowed in schema.items()
    }
    for tag, schema in _SCHEMAS.items()
}


_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _CLASSES.values()}


def _default(field: dataclasses.Field[Any]) -> object:
    return field.default_factory() if callable(field.default_factory) else field.default


_DEFAULTS = {  # per tag, the fields that have a default: what an older writer left out
    tag: {
        f.name: _default(f)
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    for tag, cls in _CLASSES.items()
}


def encode(message: Message) -> bytes:
    """The message in the oldest wire version that can say it (`wire_compat`)."""
    body = {name: getattr(message, name) for name in _FIELDS[type(message)]}
    tag = message.TAG
    written = downgraded(tag, body, _DEFAULTS[tag]) or body
    written["t"] = tag
    packed: bytes = msgpack.packb(written, use_bin_type=True)
    return packed


def decode(data: bytes) -> Message:
    """Strictly decode one message; every failure is a `ProtocolError`, never anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_MESSAGE_BYTES,
            max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=MAX_LABELS,  # flat maps; the arrays: stop lists, aliases, labels
            max_map_len=48,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"not a msgpack message: {exc}") from None
    return _build(body)


def _build(body: object) -> Message:
    """Check tag, version, field set and field types, then build the dataclass."""
    if not isinstance(body, dict):
        raise ProtocolError("message is not a map")
    tag = body.pop("t", None)
    cls = _CLASSES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    try:
        return _checked(tag, cls, body)
    except ProtocolError as exc:
        raise addressed(exc, body) from None


def _checked(tag: str, cls: type[Message], body: dict[str, Any]) -> Message:
    version = body.get("v")
    if not readable(version):
        raise VersionMismatch(
            f"{tag} of wire version {version!r}; this release reads {OLDEST} to {VERSION}"
        )
    if version != VERSION:
        body = upgraded(tag, body, _DEFAULTS[tag])
    schema, plain = _SCHEMAS[tag], _PLAIN[tag]
    if body.keys() != schema.keys():
        missing, extra = schema.keys() - body.keys(), body.keys() - schema.keys()
        raise ProtocolError(f"{tag}: missing fields {sorted(missing)}, unknown {sorted(extra)}")
    for name, value in body.items():
        if type(value) not in plain[name]:
            check_field(tag, name, value, schema[name])
    message = cls(**body)
    check_consistent(tag, message)
    return message


def pack_tokens(ids: typing.Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def pack_rows(rows: typing.Sequence[np.ndarray]) -> tuple[bytes, bytes]:
    """(tokens, lengths) of a `RequestEntry` carrying these rows."""
    lengths = np.fromiter((len(r) for r in rows), dtype="<u4", count=len(rows))
    return np.concatenate(rows).astype("<u4", copy=False).tobytes(), lengths.tobytes()


def pack_vector(vector: np.ndarray) -> bytes:
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()
