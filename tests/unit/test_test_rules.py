"""The suite's own rules: every test has a tier it can be selected by, and every wait polls
with a deadline through one helper (`wait_until` / `eventually` in tests/conftest.py), so a
loaded machine waits longer and a quick one does not wait at all."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
CONFTEST = TESTS / "conftest.py"


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py"))


def _marks_module(tree: ast.Module, mark: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return f"mark.{mark}" in ast.unparse(node.value)
    return False


def test_a_module_whose_fixtures_start_processes_is_in_the_process_tier() -> None:
    """A module-scoped deployment (`Processes(...)` in a fixture) is invisible to the
    conftest's rule (the `processes` fixture), so its module says its tier itself."""
    unmarked = []
    for path in _test_modules():
        tree = ast.parse(path.read_text())
        builds = any(
            isinstance(node, ast.Call) and ast.unparse(node.func) == "Processes"
            for node in ast.walk(tree)
        )
        if builds and not _marks_module(tree, "process"):
            unmarked.append(path.relative_to(TESTS).as_posix())
    assert not unmarked, f"add `pytestmark = pytest.mark.process` to {unmarked}"


def _hand_written_deadlines(tree: ast.AST) -> list[int]:
    """Lines that start a deadline of their own: `x = time.monotonic() + ...` followed by
    a loop, the shape every helper-less poll takes."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp):
            left = ast.unparse(node.value.left)
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if left == "time.monotonic()" and any("deadline" in n for n in names):
                lines.append(node.lineno)
    return lines


def test_every_wait_polls_through_the_conftest_helpers() -> None:
    own = []
    for path in _test_modules():
        own += [
            f"{path.relative_to(TESTS).as_posix()}:{line}"
            for line in _hand_written_deadlines(ast.parse(path.read_text()))
        ]
    assert not own, f"wait with tests.conftest.wait_until / eventually instead: {own}"


def test_a_hand_written_deadline_is_caught() -> None:
    poll = "deadline = time.monotonic() + 5\nwhile time.monotonic() < deadline:\n    pass\n"
    assert _hand_written_deadlines(ast.parse(poll)) == [1]
