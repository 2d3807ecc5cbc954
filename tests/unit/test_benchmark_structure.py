"""The house rules of test_structure.py, held for the benchmark scripts too.

`benchmarks/` is a plain folder of scripts (no __init__.py) that import each other as
`benchmarks.x`, so neither lint-imports nor the product's size check sees it; scripts grow by
accretion and lazy imports hide a circle until a refactor trips over it. The same two rules
apply: every module at most 400 lines, and no import circle among the scripts, lazy
(function-level) imports included. The sources are read with `ast`, never imported, so these
checks stay pure and fast (no torch, transformers or servers pulled in).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BENCHMARKS = ROOT / "benchmarks"
PACKAGE = "benchmarks"
MAX_MODULE_LINES = 400

# module -> {module it imports: line of the first such import}
Graph = dict[str, dict[str, int]]


def _oversized(folder: Path) -> list[str]:
    """Every Python file under `folder` longer than the limit, as "path (N lines)"."""
    long = []
    for path in sorted(folder.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(folder.parent)} ({lines} lines)")
    return long


def _imported(node: ast.AST) -> list[str]:
    """The `benchmarks.x` modules one statement imports, as ["x", ...] (none for others)."""
    if isinstance(node, ast.Import):  # import benchmarks.x
        dotted = [alias.name.split(".") for alias in node.names]
        return [parts[1] for parts in dotted if parts[0] == PACKAGE and len(parts) > 1]
    if not isinstance(node, ast.ImportFrom) or node.level > 1:
        return []
    parts = node.module.split(".") if node.module else []
    if node.level == 0:  # absolute: only what is under benchmarks
        if not parts or parts[0] != PACKAGE:
            return []
        parts = parts[1:]
    if parts:  # from benchmarks.x import y, from .x import y
        return [parts[0]]
    return [alias.name for alias in node.names]  # from benchmarks import x, from . import x


def _import_graph(folder: Path) -> Graph:
    """Which sibling modules each `folder/*.py` imports, at module level or in a function."""
    paths = sorted(folder.glob("*.py"))
    siblings = {path.stem for path in paths}
    graph: Graph = {}
    for path in paths:
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported(node):
                if target in siblings:
                    line = getattr(node, "lineno", 0)
                    edges[target] = min(edges.get(target, line), line)
        graph[path.stem] = edges
    return graph


def _find_cycle(graph: Graph) -> list[str]:
    """One import circle as [a, b, ..., a] (a depth-first search), or [] if there is none."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str]:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph.get(module, {})):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done and (cycle := visit(target)):
                return cycle
        on_path.discard(path.pop())
        done.add(module)
        return []

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return []


def _describe(cycle: list[str], graph: Graph) -> str:
    links = ", ".join(
        f"{PACKAGE}/{a}.py:{graph[a][b]} imports {PACKAGE}.{b}"
        for a, b in itertools.pairwise(cycle)
    )
    return f"import circle {' -> '.join(cycle)} ({links}): move what both need into a module"


def test_no_benchmark_module_is_over_400_lines() -> None:
    long = _oversized(BENCHMARKS)
    assert not long, f"over {MAX_MODULE_LINES} lines, split by concept: " + ", ".join(long)


def test_benchmarks_import_no_circle() -> None:
    graph = _import_graph(BENCHMARKS)
    cycle = _find_cycle(graph)
    assert not cycle, _describe(cycle, graph)
