"""The house rules the code keeps, read off the sources themselves (`docs/design.md`):
imports point one way and reach only public names, and the solvers' and backends'
functions stay short enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "alpasim"
# Each package may import only those to its left.
LAYERS = ("graphs", "costmodels", "solvers", "simulator", "backends", "experiments", "cli")
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _package(path: Path) -> str | None:
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else None


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every alpasim import, at any depth (inside functions too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "alpasim":
            out += [(node.lineno, f"alpasim.{a.name}") for a in node.names]         # from alpasim import solvers
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("alpasim"):
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("alpasim")]
    return out


def test_imports_point_one_way_and_reach_only_public_names():
    wrong = []
    for path in _modules():
        own = _package(path)
        for line, module in _imported(ast.parse(path.read_text())):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else None
            if target not in LAYERS or target == own:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
            if own in LAYERS and LAYERS.index(target) > LAYERS.index(own):
                wrong.append(f"{where}: {target} is to the right of {own}")
            if any(p.startswith("_") for p in parts[2:]):
                wrong.append(f"{where}: a private name of {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", ["solvers", "backends"])
def test_no_function_in_the_solvers_or_backends_is_over_80_lines(package):
    long = []
    for path in sorted((ROOT / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} is {lines} lines")
    assert not long, "\n".join(long)


def test_the_checks_can_fail(tmp_path):
    """The import walk finds a private import made inside a function, and the length
    rule counts a function's lines from its def to its last line."""
    tree = ast.parse("def f():\n    from alpasim.solvers._stage_dp import stage_dp\n    from alpasim import simulator\n"
                     + "    x = 1\n" * 89)
    assert {(2, "alpasim.solvers._stage_dp"), (3, "alpasim.simulator")} <= set(_imported(tree))
    fn = tree.body[0]
    assert fn.end_lineno - fn.lineno + 1 == 92
