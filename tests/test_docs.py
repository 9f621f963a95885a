"""Docs that cannot drift: every ``drgate ...`` command line in README.md and
docs/*.md (code blocks and inline code) parses with the real command line
(gateway/cli.py), and every relative link in them resolves.

A command in the docs may leave out what it does not need to show (a
mention of ``drgate promote`` without its ``--config``), and its values may
be placeholders (``FILE``, ``HOST:PORT``, ``<config>``); what it names must
exist: an unknown sub-command, operation, flag or choice fails the test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"^(<[^>]*>|[A-Z][A-Z0-9_:./=,-]*|.*(\.\.\.|…).*)$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def is_placeholder(value: str) -> bool:
    return bool(PLACEHOLDER.match(value))


class _AnyPlaceholder(list[Any]):
    """``choices`` that also admit a placeholder."""

    def __contains__(self, value: object) -> bool:
        return (isinstance(value, str) and is_placeholder(value)) or super().__contains__(value)


def _lenient_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def converted(value: str) -> Any:
        return value if is_placeholder(value) else convert(value)

    return converted


def _relax(parser: argparse.ArgumentParser) -> None:
    """Nothing is required and placeholders pass as values; unknown names
    still fail."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.required = False
            for sub in action.choices.values():
                _relax(sub)
            continue
        action.required = False
        if action.nargs is None:
            action.nargs = "?"
        elif action.nargs == "+":
            action.nargs = "*"
        if action.type is not None and callable(action.type):
            action.type = _lenient_type(action.type)
        if action.choices is not None:
            action.choices = _AnyPlaceholder(action.choices)


def lenient_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    _relax(parser)
    return parser


def _segments(line: str) -> Iterator[str]:
    """The commands of a shell line: split at ``&&``, ``||``, ``;`` and ``|``."""
    yield from (s for s in re.split(r"&&|\|\||;|\|", line) if s.strip())


def drgate_argv(segment: str) -> list[str] | None:
    """The arguments after ``drgate`` when ``segment`` runs drgate, else None.
    Output lines (``drgate broker: node 1 ready``) are not commands."""
    segment = segment.strip().removeprefix("$ ")
    try:
        tokens = shlex.split(segment, comments=True)
    except ValueError:
        return None
    while tokens and (ENV_ASSIGNMENT.match(tokens[0]) or tokens[0] in ("sudo", "exec")):
        tokens.pop(0)
    if not tokens or Path(tokens[0]).name != "drgate":
        return None
    # A synopsis marks optional parts with brackets: [--out DIR].
    argv = [t.lstrip("[").rstrip("]") for t in tokens[1:] if t not in ("...", "…")]
    # Redirections end the command.
    for i, token in enumerate(argv):
        if token.startswith(("<", ">", "2>")) and not token.endswith(">"):
            argv = argv[:i]
            break
    if argv and argv[0].endswith(":"):
        return None
    return argv


def command_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every ``drgate`` command in a markdown file."""
    in_code = False
    pending = ""
    start = 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            if not pending:
                start = number
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            for segment in _segments(pending):
                if "drgate" in segment:
                    yield start, segment
            pending = ""
            continue
        for match in INLINE.finditer(line):
            code = match.group(1)
            if code.startswith("drgate ") or code == "drgate":
                yield from ((number, s) for s in _segments(code))


def all_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for number, text in command_lines(path):
            if drgate_argv(text) is not None:
                found.append((f"{path.relative_to(ROOT)}:{number}", text.strip()))
    return found


COMMANDS = all_commands()


def parse_error(argv: list[str]) -> str | None:
    """argparse's complaint about ``argv``, or None when it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            lenient_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1]
    return None


def test_the_docs_show_many_drgate_commands() -> None:
    # A guard on the extraction itself: the docs hold well over a hundred.
    assert len(COMMANDS) > 100
    places = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/operations.md", "docs/rules.md"} <= places


@pytest.mark.parametrize(("where", "text"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_drgate_command_in_the_docs_parses(where: str, text: str) -> None:
    argv = drgate_argv(text)
    assert argv is not None
    problem = parse_error(argv)
    assert problem is None, f"{where}: {text!r}: {problem}"


@pytest.mark.parametrize(
    "argv",
    [
        ["admin", "list-queues"],
        ["promote", "site-p"],
        ["frobnicate"],
        ["admin", "add-queue", "q", "--replicate", "bogus"],
        ["run", "--no-such-flag"],
    ],
)
def test_the_lenient_parser_still_refuses_what_does_not_exist(argv: list[str]) -> None:
    assert parse_error(argv) is not None


def test_placeholders_and_left_out_arguments_are_fine() -> None:
    assert parse_error(["admin", "add-queue", "QUEUE", "--replicate", "MODE"]) is None
    assert parse_error(["run", "--config", "<config>"]) is None
    assert parse_error(["promote"]) is None
    assert drgate_argv("$ drgate admin … list-queues") == ["admin", "list-queues"]
    assert drgate_argv("drgate broker: node 1 of site-p ready") is None
    assert drgate_argv("drgate analyze lag [--out DIR]") == ["analyze", "lag", "--out", "DIR"]


# -- links -------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        in_code = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FENCE.match(line):
                in_code = not in_code
                continue
            if in_code:
                continue
            for match in LINK.finditer(INLINE.sub("", line)):
                target = match.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                found.append((f"{path.relative_to(ROOT)}:{number}", target))
    return found


LINKS = relative_links()


def test_the_docs_have_relative_links() -> None:
    assert len(LINKS) > 10


@pytest.mark.parametrize(("where", "target"), LINKS, ids=[f"{w} {t}" for w, t in LINKS])
def test_every_relative_link_resolves(where: str, target: str) -> None:
    source = ROOT / where.split(":", 1)[0]
    file_part = target.split("#", 1)[0]
    assert (source.parent / file_part).exists(), f"{where}: {target} does not exist"


# -- hints in error texts ------------------------------------------------------------


def test_the_r3_refusal_names_a_promote_command_the_cli_takes() -> None:
    from cluster.state.merge import PROMOTE_HINT, read_only_text

    text = read_only_text("orders", "site-p", "be consumed from")
    assert f"promote this site over 'site-p' ({PROMOTE_HINT})" in text
    command = PROMOTE_HINT.split(",")[0]
    argv = drgate_argv(command)
    assert argv == ["promote", "--config", "SIDECAR.yaml"]
    assert parse_error(argv) is None
    assert build_parser().parse_args(argv).config == "SIDECAR.yaml"  # strict parser too


TOP_LEVEL = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def named_paths() -> list[tuple[str, str]]:
    """Repository paths the docs name in inline code (``gateway/config.py``)."""
    found = []
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in re.finditer(r"`([A-Za-z0-9_./-]+)`", line):
                named = match.group(1).rstrip("/")
                if "/" in named and named.split("/")[0] in TOP_LEVEL:
                    found.append((f"{path.relative_to(ROOT)}:{number}", named))
    return found


def test_every_repository_path_the_docs_name_exists() -> None:
    named = named_paths()
    assert len(named) > 20
    missing = [f"{where}: {p}" for where, p in named if not (ROOT / p).exists()]
    assert missing == []
