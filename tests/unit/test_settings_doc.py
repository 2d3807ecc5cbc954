"""docs/settings.md's Reference table is the one common/settings.py renders, row for row."""

from __future__ import annotations

import pytest
from pydantic import Field
from pydantic.fields import FieldInfo

from common.settings import Settings
from common.settings_doc import (
    DOC,
    SECTIONS,
    reference_table,
    render_default,
    table_in,
    update,
)

FIX = "run `.venv/bin/python -m common.settings_doc` to regenerate it"


@pytest.fixture(scope="module")
def markdown() -> str:
    return DOC.read_text(encoding="utf-8")


def test_the_docs_table_is_the_one_the_code_renders(markdown: str) -> None:
    assert table_in(markdown) == reference_table(), (
        f"docs/settings.md's Reference table differs from common/settings.py: {FIX}"
    )


def test_every_setting_has_a_description_and_exactly_one_section() -> None:
    placed = [name for names in SECTIONS.values() for name in names]
    for name, field in Settings.model_fields.items():
        assert (field.description or "").strip(), f"Settings.{name} has no description"
        assert placed.count(name) == 1, (
            f"Settings.{name} is in {placed.count(name)} sections of SECTIONS "
            "(common/settings_doc.py); it needs exactly one"
        )
    assert set(placed) <= set(Settings.model_fields), "SECTIONS names a field Settings lacks"


def test_a_drifted_table_is_noticed_and_update_repairs_it(markdown: str) -> None:
    good = update(markdown)
    row = next(line for line in good.splitlines(keepends=True) if line.startswith("| `port`"))
    missing_row = good.replace(row, "", 1)
    stale_default = good.replace("| `max_batch_size` | `16` |", "| `max_batch_size` | `8` |", 1)
    for broken in (missing_row, stale_default):
        assert broken != good
        assert table_in(broken) != reference_table()
        assert update(broken) == good


def test_update_replaces_the_table_and_keeps_the_rest(markdown: str) -> None:
    good = update(markdown)
    assert table_in(good) == reference_table()
    assert good.replace(reference_table(), "") == markdown.replace(table_in(markdown), "")


@pytest.mark.parametrize(
    ("field", "shown"),
    [
        (Field(default=None), "none"),
        (Field(default=True), "`true`"),
        (Field(default_factory=list), "empty"),
        (Field(default_factory=lambda: [128, 256, 512]), "`128,256,512`"),
        (Field(default=5.0), "`5`"),
        (Field(default=0.5), "`0.5`"),
        (Field(default=4 * 1024 * 1024), "`4194304`"),
        (Field(default="~/x"), "`~/x`"),
        (Field(default=None, json_schema_extra={"default_doc": "host + pid"}), "host + pid"),
    ],
)
def test_defaults_render_as_the_docs_write_them(field: FieldInfo, shown: str) -> None:
    assert render_default(field) == shown


def test_a_field_without_a_section_stops_the_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SECTIONS, "Logging", ("log_level",))
    with pytest.raises(ValueError, match="log_format: no section"):
        reference_table()
