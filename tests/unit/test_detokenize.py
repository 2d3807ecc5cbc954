"""Incremental detokenization and stop sequences, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from worker.generate.detokenize import IncrementalDetokenizer, StopMatcher


@pytest.fixture(scope="module")
def bytes_tokenizer() -> Tokenizer:
    """One token per byte: every multi-byte character is split across tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@pytest.mark.parametrize("text", ["plain ascii", "日本語 and 한국어", "emoji 🙂😀 end", "é"])
def test_deltas_join_to_the_text_and_never_hold_half_a_character(bytes_tokenizer, text) -> None:
    ids = bytes_tokenizer.encode(text).ids
    assert len(ids) == len(text.encode())  # really one token per byte
    detok = IncrementalDetokenizer(bytes_tokenizer, bytes_tokenizer.encode("prompt: ").ids)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    if "日" in text:
        assert "" in deltas  # the first bytes of a character released nothing


def test_invalid_bytes_left_at_the_end_come_out_as_replacement_characters(bytes_tokenizer) -> None:
    half = bytes_tokenizer.encode("日").ids[:2]
    detok = IncrementalDetokenizer(bytes_tokenizer, [])
    assert [detok.add(i) for i in half] == ["", ""]
    assert "\ufffd" in detok.flush()


def test_a_stop_sequence_is_cut_and_never_partly_released() -> None:
    stopper = StopMatcher(["END"])
    released = [stopper.add(d) for d in ["hello E", "N", "D and more"]]
    assert [r[0] for r in released] == ["hello", " ", ""]  # "E", then "EN", held back
    assert released[-1][1] is True
    assert stopper.text == "hello "
    assert "".join(r[0] for r in released) + stopper.finish() == "hello "


def test_the_earliest_of_several_stop_sequences_wins() -> None:
    stopper = StopMatcher(["zz", "b"])
    _, hit = stopper.add("a b c zz")
    assert hit and stopper.text == "a "


def test_text_held_back_for_a_stop_is_released_when_it_cannot_be_one() -> None:
    stopper = StopMatcher(["abc"])
    first, _ = stopper.add("xxab")
    second, hit = stopper.add("d")
    assert (first, second, hit) == ("xx", "a", False)  # the last len("abc") - 1 wait
    assert first + second + stopper.finish() == "xxabd"


def test_without_stop_sequences_everything_is_released_at_once() -> None:
    assert StopMatcher([]).add("anything") == ("anything", False)
