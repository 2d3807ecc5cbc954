"""A streamed choice is relayed in order, whole, or not at all."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.stream_order import ChoiceState, follow


@dataclass
class Chunk:
    attempt: str
    index: int


def _verdicts(chunks: list[tuple[str, int]]) -> list[str]:
    state = ChoiceState()
    out = []
    for attempt, index in chunks:
        verdict = follow(state, Chunk(attempt, index))
        if verdict == "relay":
            state.relayed += 1
        out.append(verdict)
    return out


def test_chunks_in_order_are_relayed_and_a_duplicate_is_skipped() -> None:
    assert _verdicts([("a", 0), ("a", 1), ("a", 1), ("a", 2)]) == [
        "relay", "relay", "skip", "relay",
    ]  # fmt: skip


def test_a_chunk_past_a_missing_one_ends_the_stream_as_a_gap() -> None:
    """Chunks 0, 1, 5, 6 were once relayed as if whole."""
    assert _verdicts([("a", 0), ("a", 1), ("a", 5)]) == ["relay", "relay", "gap"]


def test_a_first_chunk_that_is_not_the_first_is_a_gap_too() -> None:
    assert _verdicts([("a", 3)]) == ["gap"]


def test_a_new_attempt_restarts_cleanly_before_any_text_and_fails_after() -> None:
    state = ChoiceState()
    assert follow(state, Chunk("a", 0)) == "relay"  # nothing relayed yet (state.relayed 0)
    assert follow(state, Chunk("b", 0)) == "relay"  # a peer's fresh attempt replaces it
    state.relayed = 1
    assert follow(state, Chunk("c", 0)) == "restarted"
