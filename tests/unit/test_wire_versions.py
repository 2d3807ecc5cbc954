"""A fleet mid-upgrade reads itself: this release and the previous one, message by message.

tests/wire/v5/ holds what the previous release (wire version 6) writes: each message in the
oldest version that can say it, which for every message is version 5 (one of every kind,
every optional field off its default, written by the frozen v5 codec). tests/wire/v6/ holds
the previous release's codec itself, its reader. This release must read each message as the
previous release meant it, and write each so that the previous release's reader takes it:
an old gateway reads a new worker's replies and registration, an old worker reads a new
gateway's entries (issue 34, item 10), and a traced entry (version 7) is refused by an old
worker as a version it does not read, never dead-lettered as poison.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest

from common import protocol, wire_compat
from common.protocol import ProtocolError, VersionMismatch, decode, encode
from tests.wire.v5 import protocol_v5
from tests.wire.v6 import protocol_v6

FIXTURES = Path(__file__).resolve().parents[1] / "wire" / "v5"
TAGS = sorted(path.stem for path in FIXTURES.glob("*.msgpack"))


def fields(message: object) -> dict:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}  # type: ignore[arg-type]


def test_the_fixtures_are_the_previous_wire_version_and_cover_every_message() -> None:
    assert protocol_v6.VERSION == wire_compat.PREVIOUS
    assert protocol_v5.VERSION == wire_compat.OLDEST  # what protocol_v6 writes when it can
    for data in FIXTURES.glob("*.msgpack"):  # and these are what it writes: version 5
        written = protocol_v6.encode(protocol_v6.decode(data.read_bytes()))
        assert msgpack.unpackb(written)["v"] == wire_compat.OLDEST
    assert sorted(protocol._CLASSES) == TAGS  # one of every message this release speaks


@pytest.mark.parametrize("tag", TAGS)
def test_this_release_reads_what_the_previous_one_wrote(tag: str) -> None:
    data = (FIXTURES / f"{tag}.msgpack").read_bytes()
    old, new = protocol_v5.decode(data), decode(data)
    later = [wire_compat.CHANGES[v] for v in range(wire_compat.OLDEST + 1, wire_compat.VERSION + 1)]
    dropped = {name for change in later for name in change.dropped.get(tag, {})}
    added = {name for change in later for name in change.added.get(tag, ())}
    expected = {k: v for k, v in fields(old).items() if k not in dropped and k != "v"}
    got = {k: v for k, v in fields(new).items() if k not in added}
    assert {k: v for k, v in got.items() if k != "v"} == expected
    assert new.v == wire_compat.VERSION


@pytest.mark.parametrize("tag", TAGS)
def test_the_previous_release_reads_what_this_one_writes(tag: str) -> None:
    data = (FIXTURES / f"{tag}.msgpack").read_bytes()
    rewritten = encode(decode(data))  # read and written again by this release
    assert protocol_v6.decode(rewritten) == protocol_v6.decode(data)


@pytest.mark.parametrize("tag", ["req", "genreq"])
def test_a_traced_entry_is_a_version_the_previous_release_refuses_by_name(tag: str) -> None:
    entry = dataclasses.replace(
        decode((FIXTURES / f"{tag}.msgpack").read_bytes()),  # type: ignore[type-var]
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    data = encode(entry)
    assert decode(data) == entry
    with pytest.raises(protocol_v6.VersionMismatch) as refused:
        protocol_v6.decode(data)
    assert refused.value.id == entry.id  # so the old worker answers it 503, by name


def test_a_message_of_a_version_neither_reads_says_who_sent_it() -> None:
    body = msgpack.unpackb((FIXTURES / "req.msgpack").read_bytes())
    for version in (wire_compat.OLDEST - 1, wire_compat.VERSION + 1):
        with pytest.raises(VersionMismatch, match=f"wire version {version}") as refused:
            decode(msgpack.packb({**body, "v": version}))
        assert (refused.value.id, refused.value.reply_to) == ("g1.0", "mb:reply:old")


def test_a_malformed_message_still_names_its_request_where_it_can() -> None:
    body = msgpack.unpackb((FIXTURES / "emb.msgpack").read_bytes())
    with pytest.raises(ProtocolError) as broken:
        decode(msgpack.packb({**body, "v": wire_compat.VERSION, "rows": "two"}))
    assert not isinstance(broken.value, VersionMismatch)
    assert broken.value.id == "g1.0" and broken.value.reply_to is None


def test_a_field_this_version_adds_is_written_only_when_it_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The expand step of a future bump, on a made-up field: off its default the message is
    written as VERSION (which only new readers take), at its default as PREVIOUS."""
    defaults = {"urgent": False}
    change = wire_compat.Change(added={"err": ("urgent",)})
    monkeypatch.setitem(wire_compat.CHANGES, wire_compat.VERSION, change)
    set_ = {"id": "x", "urgent": True, "v": wire_compat.VERSION}
    assert wire_compat.downgraded("err", dict(set_), defaults) is None
    plain = wire_compat.downgraded("err", {**set_, "urgent": False}, defaults)
    assert plain == {"id": "x", "v": wire_compat.PREVIOUS}
    old = wire_compat.upgraded("err", {"id": "x", "v": wire_compat.PREVIOUS}, defaults)
    assert old == {"id": "x", "urgent": False, "v": wire_compat.VERSION}
