"""What to do with an entry before it may cost compute: a pure decision per entry.

Every entry read from a stream (new, our own pending ones after a restart, or claimed from a
dead peer) passes `decide` first. Entries that cannot or need not be run are answered and
acked here, so nothing malformed or expired ever reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import GenerateEntry, ProtocolError, RequestEntry, VersionMismatch, decode

Entry = RequestEntry | GenerateEntry


@dataclass(frozen=True, slots=True)
class EntryLimits:
    model: str
    max_tokens: int  # an embedding input's limit, or a causal LM's context (prompt + new)
    vocab_size: int
    max_deliveries: int
    generates: bool = False  # a causal LM worker takes GenerateEntry, an encoder RequestEntry


@dataclass(frozen=True, slots=True)
class Process:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer the client with an error and ack; the entry is fine but will never run."""

    entry: Entry
    status: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Move the raw entry to the dead-letter stream and ack; tell the client if we can."""

    reason: str
    entry: Entry | None  # None when the bytes are not even a request


@dataclass(frozen=True, slots=True)
class Misversioned:
    """A gateway of a wire version this release does not read wrote it (a fleet mid-upgrade,
    past one version step): not poison, so not dead-lettered; answered 503
    `version_mismatch` to the reply stream it names, and acked."""

    id: str
    reply_to: str
    message: str


Decision = Process | Reject | DeadLetter | Misversioned


def parse(payload: bytes | None) -> Entry | Misversioned | str:
    """The entry, or a reason it cannot be one (payload lost to trimming, garbage bytes)."""
    if payload is None:
        return "payload lost: the entry was trimmed or deleted before it was processed"
    try:
        message = decode(payload)
    except VersionMismatch as exc:
        if exc.id is None or exc.reply_to is None:
            return f"malformed entry: {exc}"
        return Misversioned(exc.id, exc.reply_to, f"this worker cannot read the entry: {exc}")
    except ProtocolError as exc:
        return f"malformed entry: {exc}"
    if not isinstance(message, RequestEntry | GenerateEntry):
        return f"not a request entry: {type(message).__name__}"
    return message


def decide(payload: bytes | None, deliveries: int, now_ms: int, limits: EntryLimits) -> Decision:
    parsed = parse(payload)
    if isinstance(parsed, str):
        return DeadLetter(parsed, None)
    if isinstance(parsed, Misversioned):
        return parsed
    entry = parsed
    if deliveries > limits.max_deliveries:
        reason = f"delivered {deliveries} times (max_deliveries {limits.max_deliveries}); giving up"
        return DeadLetter(reason, entry)
    if entry.deadline_ms <= now_ms:
        late = now_ms - entry.deadline_ms
        return Reject(entry, 504, "deadline_exceeded", f"deadline passed {late} ms before compute")
    if entry.model != limits.model:
        return Reject(
            entry, 400, "wrong_model", f"entry for {entry.model!r} on a {limits.model!r} worker"
        )
    if isinstance(entry, GenerateEntry) != limits.generates:
        kind = "generation" if limits.generates else "embedding"
        return Reject(entry, 400, "wrong_kind", f"{limits.model!r} is served for {kind} only")
    if isinstance(entry, GenerateEntry) and entry.n_tokens + entry.max_tokens > limits.max_tokens:
        message = (
            f"prompt of {entry.n_tokens} tokens plus max_tokens {entry.max_tokens} exceeds "
            f"the model's context of {limits.max_tokens} tokens"
        )
        return Reject(entry, 400, "context_length_exceeded", message)
    if entry.longest > limits.max_tokens:
        message = f"input has {entry.longest} tokens; this model takes at most {limits.max_tokens}"
        return Reject(entry, 413, "input_too_long", message)
    if limits.vocab_size and int(entry.token_ids().max()) >= limits.vocab_size:
        return Reject(
            entry, 400, "invalid_token", f"token id out of range for vocab {limits.vocab_size}"
        )
    return Process(entry)
