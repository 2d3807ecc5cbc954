"""FROZEN: common/wire_compat.py of wire version 6 (release 558b774), for protocol_v6.

Two wire versions at once: how a fleet rolls from one release to the next without an outage.

A release reads its own wire version and the one before it (`PREVIOUS`), and writes every
message in the older of the two whenever the older can say it, so in a rolling update old and
new processes read each other: an old gateway reads a new worker's replies and registration,
an old worker a new gateway's entries, whichever finished upgrading first. A field this
version added is written only when it is off its default (a message that needs it is written
as `VERSION`, which only new readers take); a field it dropped is written back with the value
the previous version's readers require. What neither version can read is answered where it
names its sender, never dropped silently (`protocol.VersionMismatch`).

Expand, then contract: a field goes in `ADDED` in the release that adds it and is written
once the previous release is gone; a field a release drops is written back for one release.
Pure tables and functions on plain maps; `protocol` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# 2: logprobs, n choices, structured output, fingerprints; 3: classifiers; 4: prompt tokens
# served from the prefix cache; 5: one encoder entry and reply per request part; 6: entries
# no longer carry `kind` (the stream and the model already say it)
VERSION = 6
PREVIOUS = VERSION - 1

# per message tag: the fields VERSION added, unknown to PREVIOUS readers
ADDED: dict[str, tuple[str, ...]] = {}
# per message tag: the fields VERSION dropped, with the value PREVIOUS readers require
DROPPED: dict[str, dict[str, Any]] = {"req": {"kind": "embed"}}


def upgraded(tag: str, body: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A PREVIOUS message's fields as VERSION has them: dropped ones removed, added ones at
    their defaults."""
    for name in DROPPED.get(tag, ()):
        body.pop(name, None)
    for name in ADDED.get(tag, ()):
        body.setdefault(name, defaults[name])
    body["v"] = VERSION
    return body


def downgraded(
    tag: str, body: dict[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The message as PREVIOUS writes it (`body` itself, changed), or None when it needs a
    field only VERSION has."""
    added, dropped = ADDED.get(tag), DROPPED.get(tag)
    if added:
        if any(body[name] != defaults[name] for name in added):
            return None
        for name in added:
            del body[name]
    if dropped:
        body.update(dropped)
    body["v"] = PREVIOUS
    return body
