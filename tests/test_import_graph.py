"""The import graph of dptrain's parts (subpackages and top-level modules) has no cycle.

Every import counts, at module level or inside a function: an import moved into a function
hides a cycle from Python's import machinery, not from this test.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import dptrain

ROOT = Path(dptrain.__file__).parent


def _part(module: str) -> str | None:
    """The part of dptrain a dotted module belongs to: `dptrain.privacy.engine` -> `privacy`;
    None for the package root (its public names are lazy aliases)."""
    parts = module.split(".")
    if parts[0] != "dptrain" or len(parts) < 2:
        return None
    return parts[1]


def _imported_modules(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]  # from pkg import mod
    return found


def import_graph() -> dict[str, set[str]]:
    """part -> the other parts it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        here = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for module in _imported_modules(ast.parse(path.read_text(encoding="utf-8"))):
            there = _part(module)
            if there is not None and there != here and (ROOT / there).exists() | (
                    ROOT / f"{there}.py").exists():
                graph[here].add(there)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_two_parts_of_dptrain_import_each_other_even_through_others():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_cycle_through_three_parts():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_only_the_cli_and_its_configs_import_hydra_or_omegaconf_anywhere():
    offenders = sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if path.relative_to(ROOT).parts[0] not in ("cli", "conf")
        for module in _imported_modules(ast.parse(path.read_text(encoding="utf-8")))
        if module.split(".")[0] in ("hydra", "omegaconf")
    )
    assert offenders == []


def test_no_part_of_dptrain_imports_the_integrations():
    offenders = sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if path.relative_to(ROOT).parts[0] != "integrations"
        for module in _imported_modules(ast.parse(path.read_text(encoding="utf-8")))
        if _part(module) == "integrations"
    )
    assert offenders == []


def parts_importing_the_opacus_layer(graph: dict[str, set[str]]) -> list[str]:
    """The parts of `graph` other than dptrain.opacus that import it."""
    return sorted(part for part, imported in graph.items() if "opacus" in imported and part != "opacus")


def test_no_core_part_of_dptrain_imports_the_opacus_compatibility_layer():
    """dptrain.opacus adapts Opacus's API onto the core; the core never depends on it."""
    assert parts_importing_the_opacus_layer(import_graph()) == []


def test_the_opacus_layer_rule_flags_a_core_part_that_imports_it():
    assert parts_importing_the_opacus_layer({"privacy": {"opacus"}, "opacus": {"privacy"}}) == [
        "privacy"]
