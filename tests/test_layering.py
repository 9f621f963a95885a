"""The package arrows of docs/architecture.md section 3, checked on the source.

protocol <- filters/cluster <- gateway <- analysis (which reads only protocol);
lab (the local two-site lab) imports no project package, and gateway's demo
and lab commands import it.  Below the project packages, the "may import"
column: protocol/ and filters/ are pure (no trio, socket, clock, threads,
prometheus; protocol no YAML either), and each package names the third-party
libraries it may use.  A change that needs an arrow the other way, or a new
library below gateway/, is a design change: write it in docs/architecture.md
first, then change the tables here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = frozenset({"protocol", "filters", "cluster", "gateway", "analysis", "lab"})

# package -> the project packages it imports: exactly the arrows of the design.
ARROWS: dict[str, frozenset[str]] = {
    "protocol": frozenset(),
    "filters": frozenset({"protocol"}),
    "cluster": frozenset({"protocol"}),
    "gateway": frozenset({"protocol", "filters", "cluster", "lab"}),
    "analysis": frozenset({"protocol"}),
    "lab": frozenset(),
}
# Standard-library modules that make code impure: I/O, clocks, threads.
IMPURE = frozenset({"socket", "asyncio", "time", "threading", "selectors", "subprocess"})
# package -> (third-party libraries it may import, stdlib modules it must not)
LIBRARIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "protocol": (frozenset({"construct", "zstandard", "crc32c"}), IMPURE),
    "filters": (frozenset({"yaml"}), IMPURE),
    "cluster": (frozenset({"trio", "proton", "cproton", "cffi", "argon2"}), frozenset()),
    "gateway": (
        frozenset({"trio", "proton", "construct", "crc32c", "prometheus_client", "rich", "argon2"}),
        frozenset(),
    ),
    "analysis": (
        frozenset({"pyspark", "pyarrow", "pandas", "numpy", "matplotlib", "crc32c"}),
        frozenset(),
    ),
    "lab": (frozenset({"trio", "proton", "cryptography"}), frozenset()),
}


def imports_of(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in ``path``, a module of
    ``package``: absolute ones, relative ones (resolved: they stay inside the
    package) and ``importlib.import_module("...")`` with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, package))
            elif node.module:
                found.append((node.lineno, node.module.split(".")[0]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def wrong_imports(package: str, root: Path = ROOT) -> list[str]:
    """Every import of ``package`` (under ``root``) that breaks the tables."""
    libraries, impure = LIBRARIES[package]
    wrong = []
    for path in sorted((root / package).rglob("*.py")):
        for line, top in imports_of(path, package):
            here = f"{path.relative_to(root)}:{line}"
            if top in PROJECT:
                if top != package and top not in ARROWS[package]:
                    wrong.append(f"{here} imports {top}/, against the arrows")
            elif top in sys.stdlib_module_names:
                if top in impure:
                    wrong.append(f"{here} imports {top}, which {package}/ must not use")
            elif top not in libraries:
                wrong.append(f"{here} imports {top}, a library {package}/ may not use")
    return wrong


def package_graph(root: Path = ROOT) -> dict[str, frozenset[str]]:
    """package -> the other project packages its modules import."""
    return {
        package: frozenset(
            top
            for path in (root / package).rglob("*.py")
            for _, top in imports_of(path, package)
            if top in PROJECT and top != package
        )
        for package in ARROWS
    }


@pytest.mark.parametrize("package", sorted(ARROWS))
def test_package_imports_point_the_right_way(package: str) -> None:
    wrong = wrong_imports(package)
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_is_the_designs() -> None:
    # Every arrow of the design is there (an arrow gone is a table to update),
    # and no other: the walker sees the project's real imports.
    assert package_graph() == ARROWS


def test_the_walker_finds_every_way_of_importing(tmp_path: Path) -> None:
    pure = tmp_path / "protocol"
    pure.mkdir()
    (pure / "ok.py").write_text("import struct\nfrom . import sibling\nimport construct as c\n")
    (pure / "bad.py").write_text(
        "import trio.lowlevel\n"
        "from gateway.spool import Spool\n"
        "def later():\n"
        "    import time\n"
        "    import importlib\n"
        "    return importlib.import_module('yaml')\n"
    )
    assert wrong_imports("protocol", tmp_path) == [
        "protocol/bad.py:1 imports trio, a library protocol/ may not use",
        "protocol/bad.py:2 imports gateway/, against the arrows",
        "protocol/bad.py:4 imports time, which protocol/ must not use",
        "protocol/bad.py:6 imports yaml, a library protocol/ may not use",
    ]
