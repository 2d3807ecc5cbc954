"""The house rules, checked on every run: import contracts, strict types on the pure modules,
small units, and no background task started outside the supervising helper."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGES = ("common", "gateway", "worker")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
SUPERVISOR = ROOT / "common" / "tasks.py"


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _tool(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_the_import_contracts_in_pyproject_hold() -> None:
    """common below both roles, the roles independent, pure policies free of torch, Redis
    and HTTP, no circle among sibling modules (lazy imports included)."""
    done = _run(_tool("lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_the_pure_modules_type_check_strictly() -> None:
    done = _run(sys.executable, "-m", "mypy")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_module_stays_small() -> None:
    """One test listing every offender (a test per module was 100 items of noise)."""
    big = {
        str(path.relative_to(ROOT)): lines
        for path in _modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not big, f"over {MAX_MODULE_LINES} lines, split each by concept: {big}"


def test_no_function_is_longer_than_a_screen() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
    assert not long


def test_every_background_task_starts_through_the_supervising_helper() -> None:
    bare = []
    for path in _modules():
        if path == SUPERVISOR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("create_task", "ensure_future"):
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, "start tasks with common.tasks.spawn_supervised"
