"""Which entries may cost compute: decide() per entry, before any batch is formed."""

from __future__ import annotations

from common.protocol import ErrorReply, ModelInfo, encode, pack_tokens
from tests.unit.test_protocol import GEN, entry
from worker.triage import DeadLetter, EntryLimits, Process, Reject, decide

LIMITS = EntryLimits(model="m", max_tokens=512, vocab_size=1000, max_deliveries=3)
NOW = 1_500


def test_a_good_entry_is_processed() -> None:
    assert isinstance(decide(encode(entry()), 1, NOW, LIMITS), Process)


def test_a_lost_payload_is_dead_lettered_never_run() -> None:
    decision = decide(None, 1, NOW, LIMITS)
    assert isinstance(decision, DeadLetter)
    assert "payload lost" in decision.reason


def test_garbage_bytes_are_dead_lettered() -> None:
    decision = decide(b"\x80\x03garbage", 1, NOW, LIMITS)
    assert isinstance(decision, DeadLetter)
    assert decision.entry is None


def test_a_message_that_is_not_a_request_is_dead_lettered() -> None:
    info = ModelInfo(
        name="m",
        kind="embedding",
        dim=1,
        max_tokens=1,
        vocab_size=1,
        tokenizer_sha256="",
        chat_template="",
        bos_token="",
        eos_token="",
        aliases=[],
    )
    assert isinstance(decide(encode(info), 1, NOW, LIMITS), DeadLetter)


def test_past_max_deliveries_is_dead_lettered_with_the_entry_so_the_client_hears() -> None:
    decision = decide(encode(entry()), 4, NOW, LIMITS)
    assert isinstance(decision, DeadLetter)
    assert decision.entry is not None
    assert "4 times" in decision.reason


def test_an_expired_entry_is_answered_504_without_compute() -> None:
    decision = decide(encode(entry(deadline_ms=NOW)), 1, NOW, LIMITS)
    assert isinstance(decision, Reject)
    assert decision.status == 504


def test_an_over_long_entry_is_rejected_413() -> None:
    decision = decide(encode(entry(tokens=pack_tokens([1] * 513))), 1, NOW, LIMITS)
    assert isinstance(decision, Reject)
    assert decision.status == 413


def test_token_ids_outside_the_vocabulary_are_rejected() -> None:
    decision = decide(encode(entry(tokens=pack_tokens([1, 1000]))), 1, NOW, LIMITS)
    assert isinstance(decision, Reject)
    assert decision.status == 400


def test_an_entry_for_another_model_is_rejected() -> None:
    decision = decide(encode(entry(model="other")), 1, NOW, LIMITS)
    assert isinstance(decision, Reject)
    assert decision.code == "wrong_model"


# ---- every decision whole: its kind, the entry it carries, status, code and message --------

GEN_LIMITS = EntryLimits(
    model="tiny", max_tokens=64, vocab_size=1000, max_deliveries=3, generates=True
)


def _gen(**over: object) -> bytes:
    from common.protocol import GenerateEntry

    fields = {k: v for k, v in GEN.items() if k not in ("t", "v")}
    fields.update({"deadline_ms": 2_000, **over})
    return encode(GenerateEntry(**fields))  # type: ignore[arg-type]


def _rejected(payload: bytes, limits: EntryLimits = LIMITS) -> Reject:
    decision = decide(payload, 1, NOW, limits)
    assert isinstance(decision, Reject), decision
    assert decision.entry is not None and decision.entry.id in ("abc.0", "g.0")
    return decision


def test_each_refusal_says_its_status_code_and_numbers() -> None:
    cases = [
        (encode(entry(deadline_ms=NOW - 7)), LIMITS, 504, "deadline_exceeded",
         "deadline passed 7 ms before compute"),
        (encode(entry(model="other")), LIMITS, 400, "wrong_model",
         "entry for 'other' on a 'm' worker"),
        (encode(entry()), GEN_LIMITS, 400, "wrong_model", "entry for 'm' on a 'tiny' worker"),
        (_gen(model="m"), LIMITS, 400, "wrong_kind", "'m' is served for embedding only"),
        (encode(entry(model="tiny")), GEN_LIMITS, 400, "wrong_kind",
         "'tiny' is served for generation only"),
        (_gen(max_tokens=62), GEN_LIMITS, 400, "context_length_exceeded",
         "prompt of 3 tokens plus max_tokens 62 exceeds the model's context of 64 tokens"),
        (encode(entry(tokens=pack_tokens([1] * 513))), LIMITS, 413, "input_too_long",
         "input has 513 tokens; this model takes at most 512"),
        (encode(entry(tokens=pack_tokens([1, 1000]))), LIMITS, 400, "invalid_token",
         "token id out of range for vocab 1000"),
    ]  # fmt: skip
    for payload, limits, status, code, message in cases:
        decision = _rejected(payload, limits)
        assert (decision.status, decision.code, decision.message) == (status, code, message)


def test_each_limit_is_inclusive_and_a_good_entry_carries_itself() -> None:
    at_limits = [
        (encode(entry(tokens=pack_tokens([999] * 512))), LIMITS),  # 512 tokens, the last id
        (_gen(max_tokens=61), GEN_LIMITS),  # 3 + 61 = the whole context of 64
        (encode(entry(deadline_ms=NOW + 1)), LIMITS),
    ]
    for payload, limits in at_limits:
        decision = decide(payload, 3, NOW, limits)  # max_deliveries 3: still this one
        assert isinstance(decision, Process), decision
        assert decision.entry.id in ("abc.0", "g.0")


def test_a_dead_letter_says_why_and_keeps_what_it_could_read() -> None:
    lost = decide(None, 1, NOW, LIMITS)
    assert lost == DeadLetter(
        "payload lost: the entry was trimmed or deleted before it was processed", None
    )
    garbage = decide(b"\x80\x03garbage", 1, NOW, LIMITS)
    assert isinstance(garbage, DeadLetter) and garbage.reason.startswith("malformed entry: ")
    reply = encode(
        ErrorReply(id="x", status=500, type="server_error", code="c", message="m", worker="w")
    )
    stray = decide(reply, 1, NOW, LIMITS)
    assert stray == DeadLetter("not a request entry: ErrorReply", None)
    again = decide(encode(entry()), 4, NOW, LIMITS)
    assert isinstance(again, DeadLetter) and again.entry is not None
    assert again.reason == "delivered 4 times (max_deliveries 3); giving up"


def test_an_entry_of_a_wire_version_this_release_cannot_read_is_answered_not_dead_lettered() -> (
    None
):
    import msgpack

    from common.wire_compat import VERSION
    from worker.triage import Misversioned

    body = msgpack.unpackb(encode(entry()))
    future = msgpack.packb({**body, "v": VERSION + 1})
    decision = decide(future, 1, NOW, LIMITS)
    assert isinstance(decision, Misversioned)
    assert (decision.id, decision.reply_to) == ("abc.0", "mb:reply:g")
    assert decision.message.startswith("this worker cannot read the entry: ")
    assert f"wire version {VERSION + 1}" in decision.message
    for unaddressed in ({"id": None}, {"reply_to": None}):  # nobody to answer: dead letter
        blind = decide(msgpack.packb({**body, "v": VERSION + 1, **unaddressed}), 1, NOW, LIMITS)
        assert isinstance(blind, DeadLetter) and blind.entry is None
        assert blind.reason.startswith("malformed entry: ")
