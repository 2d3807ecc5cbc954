"""What a worker answers, as pure functions: an error reply for one entry.

Each reply is `(reply stream, encoded message)`; the intake publishes them together with the
acks of the entries they answer, so building them needs no I/O and is tested on its own.
"""

from __future__ import annotations

from typing import Protocol

from common.errors import openai_type
from common.protocol import MAX_MESSAGE_BYTES, ErrorReply, GenerateEntry, RequestEntry, encode

Reply = tuple[str, bytes]  # (reply stream, encoded message)
Done = tuple[str, str]  # (request stream, entry id) to ack
Entry = RequestEntry | GenerateEntry


class Addressed(Protocol):
    """What an error reply needs of what it answers: an entry, or what an unreadable one
    still says of its sender."""

    @property
    def id(self) -> str: ...

    @property
    def reply_to(self) -> str: ...


def error_reply(entry: Addressed, status: int, code: str, message: str, worker: str) -> Reply:
    """An error for one entry, typed as the gateway will answer it."""
    reply = ErrorReply(
        id=entry.id, status=status, type=openai_type(status), code=code, message=message,
        worker=worker,
    )  # fmt: skip
    return entry.reply_to, encode(reply)


def within_limit(reply: Reply, entry: Entry, worker: str) -> Reply:
    """`reply`, or, when it is over the message limit every reader enforces (it would be
    dropped unread and its client left to its deadline), an error saying so at once."""
    size = len(reply[1])
    if size <= MAX_MESSAGE_BYTES:
        return reply
    message = (
        f"the answer is {size} bytes, over the {MAX_MESSAGE_BYTES} a reply may carry: ask for "
        "fewer inputs, fewer dimensions or fewer log probabilities per request"
    )
    return error_reply(entry, 413, "reply_too_large", message, worker)
