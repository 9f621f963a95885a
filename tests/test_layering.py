"""The package arrows of docs/architecture.md section 3, checked on the source.

protocol <- filters/cluster <- gateway <- analysis (which reads only protocol).
A change that needs an arrow the other way is a design change: write it in
docs/architecture.md first, then change the table here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"protocol", "filters", "cluster", "gateway", "analysis", "deploy"}

# package -> (project packages it may import, third-party modules it must not import)
RULES: dict[str, tuple[set[str], set[str]]] = {
    "protocol": (
        set(),
        {"trio", "socket", "asyncio", "time", "threading", "yaml", "prometheus_client"},
    ),
    "filters": (
        {"protocol"},
        {"trio", "socket", "asyncio", "time", "threading", "prometheus_client"},
    ),
    "cluster": ({"protocol"}, {"yaml", "prometheus_client"}),
    "gateway": ({"protocol", "filters", "cluster", "deploy"}, set()),
    "analysis": ({"protocol"}, {"trio"}),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_point_the_right_way(package: str) -> None:
    allowed, forbidden = RULES[package]
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, top in _imports(path):
            here = f"{path.relative_to(ROOT)}:{line}"
            if top in PROJECT and top != package and top not in allowed:
                wrong.append(f"{here} imports {top}")
            if top in forbidden:
                wrong.append(f"{here} imports {top}, which {package}/ must not use")
    assert not wrong, "\n".join(wrong)


def test_stdlib_names_are_known() -> None:
    # The forbidden lists name stdlib modules; make sure the names are real.
    assert {"socket", "asyncio", "time", "threading"} <= sys.stdlib_module_names
