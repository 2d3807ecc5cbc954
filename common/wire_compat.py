"""Wire versions side by side: how a fleet rolls from one release to the next without an outage.

A release writes every message in the oldest version that can say it, down to `PREVIOUS`
(the version the release before it was built on), so that release reads it; and it reads
everything from `OLDEST` on, which covers what the release before wrote (its own version
or, whenever that could say a message, the one before). So in a rolling update old and new
processes read each other: an old gateway reads a new worker's replies and registration, an
old worker a new gateway's entries, whichever finished upgrading first. A field a version
added is written only when it is off its default (a message that needs it is written as
that version, which only new readers take); a field it dropped is written back with the
value the older readers require. What a reader cannot read is answered where it names its
sender, never dropped silently (`protocol.VersionMismatch`).

Expand, then contract: a field goes in its version's `added` in the release that adds it
and is relied on once the previous release is gone. Pure tables and functions on plain
maps; `protocol` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Change:
    """What one version changed from the one before, per message tag."""

    added: dict[str, tuple[str, ...]] = field(default_factory=dict)  # new fields
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)  # old readers' values


# 2: logprobs, n choices, structured output, fingerprints; 3: classifiers; 4: prompt tokens
# served from the prefix cache; 5: one encoder entry and reply per request part
CHANGES: dict[int, Change] = {
    # entries no longer carry `kind` (the stream and the model already say it)
    6: Change(dropped={"req": {"kind": "embed"}}),
    # an entry carries its W3C trace context across the queue (OpenTelemetry)
    7: Change(
        added={
            "req": ("traceparent", "tracestate"),
            "genreq": ("traceparent", "tracestate"),
        }
    ),
}
TRACE_CONTEXT = 7  # entries carry their trace context from this version on
VERSION = max(CHANGES)
PREVIOUS = VERSION - 1
OLDEST = PREVIOUS - 1  # what the previous release wrote whenever it could


def readable(version: object) -> bool:
    return isinstance(version, int) and OLDEST <= version <= VERSION


def upgraded(tag: str, body: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """An older message's fields as VERSION has them: each later version's dropped fields
    removed and its added ones at their defaults."""
    for version in range(body["v"] + 1, VERSION + 1):
        change = CHANGES[version]
        for name in change.dropped.get(tag, ()):
            body.pop(name, None)
        for name in change.added.get(tag, ()):
            body.setdefault(name, defaults[name])
    body["v"] = VERSION
    return body


def downgraded(
    tag: str, body: dict[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The message as PREVIOUS writes it (`body` itself, changed), or None when it needs a
    field only VERSION has."""
    change = CHANGES[VERSION]
    added, dropped = change.added.get(tag), change.dropped.get(tag)
    if added:
        if any(body[name] != defaults[name] for name in added):
            return None
        for name in added:
            del body[name]
    if dropped:
        body.update(dropped)
    body["v"] = PREVIOUS
    return body
