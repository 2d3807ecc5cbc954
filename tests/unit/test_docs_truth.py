"""The docs claim what the code is: every module has its line in docs/architecture.md's table.

A module added without a word in the map is how the map drifts: this fails first. A module
counts as named in a table row when the row's first cell names it (`worker/consumer.py`), or
names a file beside it and the module's file name (`worker/triage.py`, `reclaim.py`), or
names its package (`worker/generate/`) and the row names the module (`loop`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGES = ("common", "gateway", "worker")
TICKED = re.compile(r"`([^`]+)`")


def _rows() -> list[tuple[list[str], set[str]]]:
    """Each table row of the module map: the first cell's names, and every name in the row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## One module per concept", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        rows.append((TICKED.findall(first), set(TICKED.findall(line))))
    return rows


def _named(module: Path, rows: list[tuple[list[str], set[str]]]) -> bool:
    path = module.relative_to(ROOT).as_posix()
    folder = path.rsplit("/", 1)[0]
    for first, every in rows:
        for name in first:
            if name == path:
                return True
            if name.endswith(".py") and name.rsplit("/", 1)[0] == folder and module.name in first:
                return True
            if name.endswith("/") and path.startswith(name):
                inner = path[len(name) :].removesuffix(".py").split("/")
                if inner[-1] in every or module.name in every:
                    return True
    return False


def _modules() -> list[Path]:
    return sorted(
        p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )


def test_every_module_is_named_in_the_architecture_map() -> None:
    rows = _rows()
    missing = [m.relative_to(ROOT).as_posix() for m in _modules() if not _named(m, rows)]
    assert not missing, f"add these to docs/architecture.md's module table: {missing}"


def test_the_map_names_no_module_that_does_not_exist() -> None:
    """The other way round: a file path in the map that is gone is a stale claim."""
    stale = [
        name
        for first, _ in _rows()
        for name in first
        if name.endswith(".py") and "/" in name and not (ROOT / name).exists()
    ]
    assert not stale, f"docs/architecture.md names modules that are gone: {stale}"


def test_a_module_missing_from_the_map_is_caught() -> None:
    rows = [(first, every) for first, every in _rows() if "worker/consumer.py" not in first]
    assert not _named(ROOT / "worker" / "consumer.py", rows)


def test_docs_hold_prose_and_their_data_lives_in_docs_data() -> None:
    """Measured data (JSON, plots, captured output) sits in docs/data/, so docs/ reads as
    the manual it is."""
    data = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "docs").rglob("*")
        if p.is_file() and p.suffix != ".md" and "data" not in p.relative_to(ROOT / "docs").parts
    ]
    assert not data, f"move to docs/data/: {data}"


def test_the_readme_is_a_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 220, f"README.md has {lines} lines: move the reference into docs/"


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT).as_posix()} -> {target}")
    assert not broken, f"links to nothing: {broken}"


def test_the_readme_settings_table_names_real_settings_with_their_defaults() -> None:
    """The README's short table is written by hand: each row's settings exist and its
    defaults are the code's (as docs/settings.md renders them)."""
    from common.settings import Settings
    from common.settings_doc import render_default

    text = (ROOT / "README.md").read_text()
    table = text.split("## The dozen settings people change", 1)[1].split("\n## ", 1)[0]
    wrong = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        names, defaults = TICKED.findall(cells[0]), TICKED.findall(cells[1]) or [cells[1]]
        for i, name in enumerate(names):
            field = Settings.model_fields.get(name)
            if field is None:
                wrong.append(f"{name}: no such setting")
                continue
            shown = defaults[min(i, len(defaults) - 1)]
            if shown.split(" ")[0] != render_default(field).split(" ")[0].strip("`"):
                wrong.append(f"{name}: README says {shown!r}, code {render_default(field)!r}")
    assert not wrong, wrong
