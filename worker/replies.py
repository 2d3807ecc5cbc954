"""What a worker answers, as pure functions: an error reply for one entry.

Each reply is `(reply stream, encoded message)`; the intake publishes them together with the
acks of the entries they answer, so building them needs no I/O and is tested on its own.
"""

from __future__ import annotations

from common.errors import openai_type
from common.protocol import ErrorReply, GenerateEntry, RequestEntry, encode

Reply = tuple[str, bytes]  # (reply stream, encoded message)
Done = tuple[str, str]  # (request stream, entry id) to ack
Entry = RequestEntry | GenerateEntry


def error_reply(entry: Entry, status: int, code: str, message: str, worker: str) -> Reply:
    """An error for one entry, typed as the gateway will answer it."""
    reply = ErrorReply(
        id=entry.id, status=status, type=openai_type(status), code=code, message=message,
        worker=worker,
    )  # fmt: skip
    return entry.reply_to, encode(reply)
