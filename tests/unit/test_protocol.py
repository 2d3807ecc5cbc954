"""Wire round trips and the strict decoder: garbage is a ProtocolError, never anything else."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.protocol import (
    MAX_MESSAGE_BYTES,
    VERSION,
    DeadLetter,
    EmbeddingResult,
    ErrorReply,
    GenerateEntry,
    GenerationChunk,
    ModelInfo,
    ProtocolError,
    RequestEntry,
    Scores,
    decode,
    encode,
    pack_rows,
    pack_tokens,
    pack_vector,
)


def entry(**over: object) -> RequestEntry:
    fields = dict(
        id="abc.0",
        request_id="req-1",
        model="m",
        tokens=pack_tokens([101, 7, 102]),
        lengths=pack_tokens([3]),
        deadline_ms=2_000,
        priority=1,
        reply_to="mb:reply:g",
        enqueued_ms=1_000,
    )
    fields.update(over)
    if "tokens" in over and "lengths" not in over:  # one row of all the tokens
        fields["lengths"] = pack_tokens([len(over["tokens"]) // 4])  # type: ignore[arg-type]
    return RequestEntry(**fields)


MESSAGES = [
    entry(),
    EmbeddingResult(
        id="abc.0",
        embeddings=pack_vector(np.arange(4, dtype=np.float32)),
        rows=1,
        n_tokens=3,
        batch_ids=["w:1"],
        batch_size=2,
        bucket=128,
        queue_ms=1.5,
        compute_ms=3.25,
        worker="w",
    ),
    ErrorReply(
        id="abc.0", status=413, type="invalid_request_error", code="c", message="m", worker="w"
    ),
    DeadLetter(stream="s", entry_id="1-0", reason="r", deliveries=3, payload=b"\x00", worker="w"),
    ModelInfo(
        name="m",
        kind="embedding",
        dim=384,
        max_tokens=512,
        vocab_size=30522,
        tokenizer_sha256="ab",
        chat_template="{{ messages }}",
        bos_token="<s>",
        eos_token="</s>",
        aliases=["short-name", "other"],
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message) -> None:
    assert decode(encode(message)) == message


def test_tokens_travel_as_packed_uint32() -> None:
    decoded = decode(encode(entry(tokens=pack_tokens([0, 1, 2**32 - 1]))))
    assert decoded.token_ids().tolist() == [0, 1, 2**32 - 1]
    assert decoded.n_tokens == 3


def test_an_entry_carries_many_rows_and_gives_each_back() -> None:
    rows = [np.array([101, 5, 102]), np.array([101, 102]), np.array([7] * 40)]
    tokens, lengths = pack_rows(rows)
    decoded = decode(encode(entry(tokens=tokens, lengths=lengths)))
    assert [r.tolist() for r in decoded.rows()] == [r.tolist() for r in rows]
    assert (decoded.n_tokens, decoded.longest) == (45, 40)


@pytest.mark.parametrize(
    ("lengths", "why"),
    [
        ([3, 0], "every row has tokens"),  # an empty row
        ([2], "add up"),  # fewer tokens named than carried
        ([2, 2], "add up"),  # more
        ([], "row lengths"),
        ([1] * 1025, "row lengths"),
    ],
)
def test_row_lengths_must_describe_the_tokens(lengths: list[int], why: str) -> None:
    tokens = pack_tokens([1] * max(3, len(lengths)))
    if len(lengths) > 3:
        tokens = pack_tokens([1] * len(lengths))
    bad = entry(tokens=tokens, lengths=pack_tokens(lengths))
    with pytest.raises(ProtocolError, match=why):
        decode(encode(bad))


def test_a_reply_carries_rows_times_dim_floats() -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    message = dataclasses.replace(MESSAGES[1], embeddings=pack_vector(vectors), rows=3)
    assert decode(encode(message)).vectors().tolist() == vectors.tolist()
    with pytest.raises(ProtocolError, match="rows x dim"):
        decode(encode(dataclasses.replace(message, rows=5)))


def test_vectors_travel_as_float32_bytes() -> None:
    vector = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    message = dataclasses.replace(MESSAGES[1], embeddings=pack_vector(vector))
    assert decode(encode(message)).vectors().tolist() == [[0.5, -1.25, 3.0]]


def _fields(message) -> dict:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}


def raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


GOOD = {"t": "req", **_fields(entry())}


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xc1\xc1\xc1", "not a msgpack"),
        (b"", "not a msgpack"),
        (pickle.dumps({"t": "req"}), "not a msgpack"),
        (raw([1, 2, 3]), "not a map"),
        (raw(list(range(2000))), "not a msgpack"),  # long arrays are refused while parsing
        (raw({**GOOD, "model": ["a", "b"]}), "req.model"),
        (raw("a string"), "not a map"),
        (raw({**GOOD, "t": "nope"}), "unknown message tag"),
        (raw({**GOOD, "v": VERSION + 1}), f"req of wire version {VERSION + 1}; this release reads"),
        ({k: v for k, v in GOOD.items() if k != "model"}, "missing fields"),
        (raw({**GOOD, "extra": 1}), "unknown"),
        (raw({**GOOD, "deadline_ms": "soon"}), "req.deadline_ms"),
        (raw({**GOOD, "priority": True}), "req.priority"),
        (raw({**GOOD, "tokens": b"\x00\x01\x02"}), "not a uint32 list"),
        (raw({**GOOD, "tokens": b""}), "not a uint32 list"),
        (raw({**GOOD, "model": {"nested": {"deep": 1}}}), "req.model"),
    ],
)
def test_malformed_bytes_are_rejected_with_a_reason(payload, why: str) -> None:
    data = raw(payload) if isinstance(payload, dict) else payload
    with pytest.raises(ProtocolError, match=why):
        decode(data)


def test_deeply_nested_bomb_is_rejected() -> None:
    bomb = b"\x81\xa1a" * 100_000 + b"\xc0"  # {"a": {"a": ... }} a hundred thousand deep
    with pytest.raises(ProtocolError):
        decode(bomb)


def test_huge_declared_length_is_rejected_without_allocating() -> None:
    lying = b"\xc6\xff\xff\xff\xf0" + b"x" * 10  # bin32 claiming ~4 GiB
    with pytest.raises(ProtocolError):
        decode(lying)


def test_oversized_message_is_rejected_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


@given(st.binary(max_size=256))
def test_random_bytes_never_raise_anything_but_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data)


GEN = {
    "t": "genreq",
    "v": VERSION,
    "id": "g.0",
    "request_id": "r",
    "model": "tiny",
    "tokens": pack_tokens([5, 6, 7]),
    "deadline_ms": 1,
    "priority": 1,
    "reply_to": "mb:reply:g",
    "enqueued_ms": 0,
    "max_tokens": 16,
    "temperature": 0.7,
    "top_p": 0.9,
    "seed": 42,
    "stop": ["\n\n", "END"],
    "stream": True,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.1,
    "bias_tokens": pack_tokens([9, 11]),
    "bias_values": np.asarray([-100.0, 2.5], "<f4").tobytes(),
    "min_tokens": 2,
    "stop_token_ids": pack_tokens([3]),
    "ignore_eos": False,
    "top_k": 40,
    "min_p": 0.05,
    "n": 3,
    "logprobs": 5,
    "prompt_logprobs": 5,
    "response_format": "json_schema",
    "json_schema": '{"type": "object"}',
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "congo=t61rcWkgMzE",
}


def test_a_generate_entry_round_trips_with_its_stop_list_and_stream_flag() -> None:
    entry = decode(raw(GEN))
    assert isinstance(entry, GenerateEntry)
    assert entry.stop == ["\n\n", "END"] and entry.stream is True
    assert list(entry.token_ids()) == [5, 6, 7]
    assert decode(encode(entry)) == entry
    bias_ids, biases = entry.logit_bias()
    assert bias_ids.tolist() == [9, 11] and biases.tolist() == [-100.0, 2.5]
    assert entry.stop_ids().tolist() == [3]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"stop": ["ok", 3]}, "items must be strings"),
        ({"stop": "END"}, "genreq.stop"),
        ({"stream": 1}, "genreq.stream"),
        ({"max_tokens": True}, "genreq.max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "more than 4 sequences"),
        ({"bias_values": b"\0\0\0\0"}, "one float32 bias per bias token"),
        ({"stop_token_ids": b"\0\0\0"}, "uint32 lists"),
        ({"ignore_eos": 0}, "genreq.ignore_eos"),
        ({"top_k": 1.5}, "genreq.top_k"),
    ],
)
def test_a_malformed_generate_entry_is_rejected(change: dict, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode(raw({**GEN, **change}))


def _chunk(**fields) -> GenerationChunk:
    base = dict(
        id="g.0",
        attempt="w:1-0:0",
        index=0,
        text="hi",
        tokens=pack_tokens([7, 8]),
        finish_reason="",
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=0,
        queue_ms=0.0,
        worker="w",
    )
    return GenerationChunk(**{**base, **fields})


def test_a_chunk_carries_its_tokens_scores_and_its_prompts() -> None:
    scores = Scores(
        np.asarray([-0.5, -1.5], "<f4"),
        np.asarray([[7, 1], [8, 2]], "<u4"),
        np.asarray([[-0.5, -2.0], [-1.5, -3.0]], "<f4"),
    )
    prompt = Scores(
        np.asarray([np.nan, -4.0, -2.0], "<f4"),
        np.zeros((3, 1), "<u4"),
        np.asarray([[np.nan], [-1.0], [-0.1]], "<f4"),
    )
    chunk = _chunk(
        choice=2, **scores.pack(), **{f"prompt_{k}": v for k, v in prompt.pack().items()}
    )
    back = decode(encode(chunk))
    assert isinstance(back, GenerationChunk) and back.choice == 2
    got = back.scores()
    assert got is not None and got.top_ids.tolist() == [[7, 1], [8, 2]]
    assert got.top_logprobs.tolist() == [[-0.5, -2.0], [-1.5, -3.0]]
    got_prompt = back.prompt_scores()
    assert got_prompt is not None and np.isnan(got_prompt.logprobs[0])
    assert got_prompt.logprobs[1:].tolist() == [-4.0, -2.0]
    assert _chunk().scores() is None and _chunk().prompt_scores() is None


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"logprobs": b"\x00" * 4}, "one float32 per token"),  # 1 score, 2 tokens
        ({"logprobs": b"\x00" * 8, "top_ids": b"\x00" * 8}, "top_ids"),  # no values
        ({"prompt_logprobs": b"\x00" * 5}, "prompt_logprobs"),
    ],
)
def test_scores_that_do_not_fit_their_tokens_are_refused(fields: dict, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode(encode(_chunk(**fields)))


@pytest.mark.parametrize("dim", [1, 384, 1024, 4096, 8192])
def test_the_rows_an_entry_carries_fit_their_answer_in_one_reply(dim: int) -> None:
    from common.protocol import MAX_MESSAGE_BYTES, REPLY_HEADROOM_BYTES, rows_that_fit

    rows = rows_that_fit(dim)
    assert rows * dim * 4 + REPLY_HEADROOM_BYTES <= MAX_MESSAGE_BYTES
    assert (rows + 1) * dim * 4 + REPLY_HEADROOM_BYTES > MAX_MESSAGE_BYTES  # no tighter


def test_a_reply_over_the_message_limit_becomes_an_error_saying_so() -> None:
    from common.protocol import MAX_MESSAGE_BYTES, ErrorReply
    from worker.replies import within_limit

    entry = RequestEntry(
        id="e.1", request_id="r", model="m", tokens=b"", lengths=b"",
        deadline_ms=1, priority=1, reply_to="mb:reply:g", enqueued_ms=0,
    )  # fmt: skip
    small = ("mb:reply:g", b"x" * 10)
    assert within_limit(small, entry, "w") is small
    stream, payload = within_limit(("mb:reply:g", b"x" * (MAX_MESSAGE_BYTES + 1)), entry, "w")
    error = decode(payload)
    assert stream == "mb:reply:g" and isinstance(error, ErrorReply)
    assert (error.status, error.code) == (413, "reply_too_large")


def test_what_is_not_a_message_is_refused_with_a_reason_at_each_gate() -> None:
    import msgpack

    with pytest.raises(ProtocolError, match="expected bytes, got str"):
        decode("text")  # type: ignore[arg-type]
    at_limit = b"\x00" * MAX_MESSAGE_BYTES  # the limit itself is allowed past the size gate
    with pytest.raises(ProtocolError, match=r"not a msgpack message|not a map"):
        decode(at_limit)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(at_limit + b"\x00")
    with pytest.raises(ProtocolError, match="message is not a map"):
        decode(msgpack.packb([1, 2]))
    for tag in (None, ["req"], 7):  # no tag, an unhashable one, a number
        body = {"v": VERSION} if tag is None else {"t": tag, "v": VERSION}
        with pytest.raises(ProtocolError, match="unknown message tag"):
            decode(msgpack.packb(body))
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        decode(msgpack.packb({1: "int key"}))  # strict_map_key: keys are strings
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        decode(msgpack.packb(msgpack.ExtType(1, b"x")))  # no extension types at all
    wide = {f"k{i}": i for i in range(49)}  # more fields than any message has
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        decode(msgpack.packb(wide))


@pytest.mark.parametrize(
    ("traceparent", "tracestate"),
    [
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331", ""),  # no flags
        ("00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01", ""),  # upper case
        ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", ""),  # not as written
        ("", "congo=t61rcWkgMzE"),  # a state with no parent
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x" * 513),
    ],
)
def test_an_entry_trace_context_is_w3c_and_bounded_or_the_entry_is_refused(
    traceparent: str, tracestate: str
) -> None:
    with pytest.raises(ProtocolError, match="traceparent"):
        decode(raw({**GEN, "traceparent": traceparent, "tracestate": tracestate}))


def test_a_traced_entry_keeps_its_context_and_an_untraced_one_costs_no_bytes() -> None:
    traced = decode(raw(GEN))
    assert isinstance(traced, GenerateEntry)
    assert traced.traceparent == GEN["traceparent"] and decode(encode(traced)) == traced
    plain = dataclasses.replace(traced, traceparent="", tracestate="")
    assert b"traceparent" not in encode(plain) and b"traceparent" in encode(traced)


def test_a_vector_is_packed_as_little_endian_float32_whatever_its_dtype() -> None:
    """pack_vector writes '<f4' bytes from float64 and big-endian input alike."""
    expected = np.array([0.5, -1.25, 3.0], dtype="<f4").tobytes()
    assert pack_vector(np.array([0.5, -1.25, 3.0], dtype=np.float64)) == expected
    assert pack_vector(np.array([0.5, -1.25, 3.0], dtype=">f4")) == expected


def test_rows_that_fit_is_a_whole_count_and_never_below_one() -> None:
    """Floor division into the reply's room, and one row even when two would not fit."""
    from common.protocol import rows_that_fit

    assert rows_that_fit(1000) == 1032  # (4 MiB - 64 KiB) / 4000 B = 1032.19...
    assert type(rows_that_fit(1000)) is int
    assert rows_that_fit(600_000) == 1  # one 2.4 MB row fits, two do not
    assert rows_that_fit(2_000_000) == 1  # not even one fits: still one (refused later)


def test_a_fields_default_is_its_factorys_fresh_value_else_its_plain_default() -> None:
    """What an older writer left out is filled with: [] and {} from factories, else the value."""
    from common.protocol import _default

    fields = dataclasses.fields(ModelInfo)
    defaults = {
        f.name: _default(f)
        for f in fields
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    assert defaults == {
        "fingerprint": "",
        "labels": [],
        "activation": "",
        "normalized": False,
        "matryoshka": False,
        "matryoshka_dims": [],
        "prompts": {},
        "default_prompt": "",
        "v": VERSION,
    }
    labels = next(f for f in fields if f.name == "labels")
    assert _default(labels) is not _default(labels)  # a new list each time, never shared
