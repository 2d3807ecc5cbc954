"""A response's typed stream events, numbered, derived from its identity and its chunks alone.

Nothing here depends on which gateway derives them or when: the numbers, item ids and
objects come from the stored request and the chunks in their stored order, so a client that
resumes with `starting_after` on another gateway gets the very events it would have got.
Text streams as `response.output_text.delta`; an answer read for tool calls is held until
it ends (a call in free text is known only then) and then given item by item, arguments as
one delta. Pure: no Redis, no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.protocol import ErrorReply, GenerationChunk
from gateway.responses import items
from gateway.responses.fold import Fold
from gateway.tool_calls import ToolUse

_ENDING = {"completed": "completed", "incomplete": "incomplete"}  # else response.failed


@dataclass(frozen=True, slots=True)
class Identity:
    """What a response is before its answer: stored with it, the same on every gateway."""

    response_id: str
    created_at: int
    request: dict[str, Any]  # items.echo
    tools: ToolUse | None  # how the answer is read for calls; None: plain text
    background: bool = False

    def object(self, status: str, **answer: Any) -> dict[str, Any]:
        return items.response_object(
            self.response_id, self.created_at, self.request, status, **answer
        )


def conclude(who: Identity, fold: Fold, completed_at: int | None) -> dict[str, Any]:
    """The finished `Response`: completed, incomplete (max_output_tokens), or failed."""
    if fold.error is not None:  # a text answer's message was opened: closed, if empty
        partial = items.output_items(who.response_id, fold.said, [], "incomplete")
        shown = fold.said or who.tools is None
        return who.object("failed", output=partial if shown else [], error=fold.error)
    cut = fold.finish_reason == "length"
    found = None
    if who.tools is not None and (not cut or who.tools.forced):
        found = who.tools.calls(fold.said)
    content, calls = found if found is not None else (fold.said, [])
    status = "incomplete" if cut else "completed"
    return who.object(
        status,
        output=items.output_items(who.response_id, content, calls, status),
        usage=items.usage(fold.prompt_tokens, fold.completion_tokens, fold.cached_tokens),
        completed_at=completed_at,
    )


class Events:
    """Feed it a response's replies in order; it gives the events each one makes."""

    def __init__(self, who: Identity) -> None:
        self.who, self.fold, self.number = who, Fold(), 0
        self.final: dict[str, Any] | None = None
        stem = who.response_id.removeprefix("resp_")
        self._message_id = f"msg_{stem}"

    @property
    def streams_text(self) -> bool:
        return self.who.tools is None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.number}
        self.number += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        first = "queued" if self.who.background else "in_progress"
        out = [self._event("response.created", response=self.who.object(first))]
        out.append(self._event("response.in_progress", response=self.who.object("in_progress")))
        if self.streams_text:
            message = items.output_message(self._message_id, "", "in_progress")
            out.append(self._event("response.output_item.added", output_index=0, item=message))
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._message_id,
                    output_index=0,
                    content_index=0,
                    part=items.text_part(""),
                )
            )
        return out

    def feed(self, reply: GenerationChunk | ErrorReply, at: int) -> list[dict[str, Any]]:
        """The events of one reply; `at` (seconds) is when it was stored, the completion
        time should it end the response."""
        new = self.fold.feed(reply)
        out = []
        if new and self.streams_text:
            out.append(self._text_event("delta", delta=new))
        if self.fold.done and self.final is None:
            self.final = conclude(self.who, self.fold, at)
            out += self._closing(self.final)
        return out

    def failed(self, message: str) -> list[dict[str, Any]]:
        """The events that end a response failed from outside its chunks (its deadline, the
        queue refusing it)."""
        if self.final is not None:
            return []
        self.fold.error = {"code": "server_error", "message": message}
        self.final = conclude(self.who, self.fold, None)
        return self._closing(self.final)

    def end_with(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        """A response whose record ended it where its chunks do not say so (failed at its
        deadline, cancelled, or its chunks expired after it ended): its output closed as the
        record has it (every item the stream added is done), then its last event; none for
        a cancel (OpenAI has no such event)."""
        self.final = final
        out = self._output_done(final["output"])
        if final["status"] == "cancelled":
            return out
        ending = _ENDING.get(final["status"], "failed")
        return [*out, self._event(f"response.{ending}", response=final)]

    def _text_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self._event(
            f"response.output_text.{kind}",
            item_id=self._message_id,
            output_index=0,
            content_index=0,
            logprobs=[],
            **fields,
        )

    def _closing(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._output_done(final["output"])
        ending = _ENDING.get(final["status"], "failed")
        out.append(self._event(f"response.{ending}", response=final))
        return out

    def _output_done(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Streamed text: the message opened at the start, done. Held: each item, whole."""
        out = []
        if self.streams_text:
            if output:
                out += self._message_done(output[0])
        else:
            for index, item in enumerate(output):
                out += self._item(index, item)
        return out

    def _message_done(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        part = message["content"][0]
        return [
            self._text_event("done", text=part["text"]),
            self._event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=0,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=0, item=message),
        ]

    def _item(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A held item, given whole: added, its content or arguments, done."""
        if item["type"] == "message":
            opened = {**item, "status": "in_progress", "content": []}
            out = [self._event("response.output_item.added", output_index=index, item=opened)]
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=items.text_part(""),
                )
            )
            text = item["content"][0]["text"]
            fields = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self._event("response.output_text.delta", **fields, delta=text, logprobs=[]))
            out.append(self._event("response.output_text.done", **fields, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", **fields, part=item["content"][0]))
        else:
            opened = {**item, "arguments": "", "status": "in_progress"}
            out = [self._event("response.output_item.added", output_index=index, item=opened)]
            where = {"item_id": item["id"], "output_index": index}
            out.append(
                self._event(
                    "response.function_call_arguments.delta", **where, delta=item["arguments"]
                )
            )
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out
