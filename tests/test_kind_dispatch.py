"""No function branches on a batch-selection, noise or privacy-unit kind string outside its
strategy and the registries: the engine, the loaders, the accounting, the ledger, resume, the
loop and the command line ask the strategy object (dptrain/privacy/selection,
dptrain/privacy/noise, dptrain/privacy/unit) or the accounting's registry of selections
(dptrain/accounting/selections.py), so that a new scheme or unit is one module and one
registration line.

The walk parses every module of the package and reports each comparison (==, !=, in, not in)
with a kind name as a string constant, and each dict keyed by two or more kind names (a
switchboard table)."""

from __future__ import annotations

import ast
from pathlib import Path

import dptrain
from dptrain.privacy.noise import NOISE_KINDS
from dptrain.privacy.plan import SELECTIONS, UNITS

PACKAGE = Path(dptrain.__file__).parent
UNIT_KINDS = frozenset(UNITS)   # the registered privacy units (dptrain.privacy.unit)
KINDS = frozenset(SELECTIONS) | frozenset(NOISE_KINDS) | UNIT_KINDS
# the strategies and the registries: the only places a kind name may decide anything
ALLOWED = ("privacy/selection/", "privacy/noise/", "privacy/unit/", "accounting/selections.py")


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def kind_branches(source: str, kinds: frozenset[str] = KINDS) -> list[tuple[int, str]]:
    """(line, code) of each comparison with a constant of `kinds` and each dict keyed by two or
    more of them in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = set().union(*(_strings(p) for p in (node.left, *node.comparators)))
            if named & kinds:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Dict):
            keys = set().union(*(_strings(k) for k in node.keys if k is not None)) \
                if node.keys else set()
            if len(keys & kinds) >= 2:
                found.append((node.lineno, "a table keyed by kind names"))
    return found


def test_the_walk_finds_a_comparison_with_a_kind_name():
    """The detector itself: it must see the switchboard patterns it guards against."""
    code = ('if plan.selection.kind == "shuffle": pass\n'
            'x = kind in ("poisson", "cyclic_poisson")\n'
            'TABLE = {"independent": 1, "banded": 2}\n')
    assert [line for line, _ in kind_branches(code)] == [1, 2, 3]


def test_the_walk_finds_a_comparison_with_a_privacy_unit_kind():
    """The unit kinds are among the kinds the walk looks for: the engine's and the ledger's old
    branches on them are seen."""
    code = ('if unit.kind != "user" or user_ids is None: pass\n'
            'if privacy_unit_of(job.engine) == "user": pass\n'
            'x = plan.unit.kind != "example"\n'
            'WORDS = {"example": "one example", "user": "one user"}\n')
    assert sorted(line for line, _ in kind_branches(code)) == [1, 2, 3, 4]
    assert [line for line, _ in kind_branches(code, KINDS - UNIT_KINDS)] == []


def test_no_module_outside_the_strategies_and_registries_branches_on_a_kind_name():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(ALLOWED):
            continue
        offenders += [f"dptrain/{relative}:{line}: {code}"
                      for line, code in kind_branches(path.read_text(encoding="utf-8"), KINDS)]
    assert offenders == [], "\n".join(offenders)
