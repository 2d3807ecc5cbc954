"""Which entries may cost compute: decide() per entry, before any batch is formed."""

from __future__ import annotations

from common.protocol import ModelInfo, encode, pack_tokens
from tests.unit.test_protocol import entry
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
