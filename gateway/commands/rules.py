"""``drgate rules``: check a rules file, or explain what it decides.

``drgate rules check FILE``
    Prints every error and warning as ``file:line:column: severity: message
    (hint: ...)``.  Exit 0 when the file is valid (warnings allowed), 1
    otherwise.

``drgate rules explain FILE --queue Q [--exchange E] [--key K]
[--header k=v ...] [--arg k=v ...] [--size N]``
    Prints the rule that decides, its line, the resulting mode and the
    queue's name at D.  With ``--exchange``, ``--key`` or ``--header`` the
    question is about a message published to Q; otherwise about the queue.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from filters.matcher import Drop
from filters.rules import load_rules
from protocol.errors import ConfigError, Location, Problem, RulesError

NAME = "rules"
HELP = "check a replication rules file, or explain which rule decides for a queue"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="rules_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a rules file (exit 0 valid, 1 invalid)")
    check.add_argument("file", metavar="FILE")
    explain = sub.add_parser("explain", help="show the rule and mode for a queue or message")
    explain.add_argument("file", metavar="FILE")
    explain.add_argument("--queue", required=True, help="queue name")
    explain.add_argument("--exchange", help="exchange the message was published to")
    explain.add_argument("--key", help="routing key of the message")
    explain.add_argument(
        "--header", action="append", default=[], metavar="K=V", help="message header (repeat)"
    )
    explain.add_argument(
        "--arg", action="append", default=[], metavar="K=V", help="queue declare argument (repeat)"
    )
    explain.add_argument("--size", type=int, default=0, help="message size in bytes")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(
            [Problem(Location(path, 1, 1), f"cannot read the rules file: {exc.strerror}")]
        ) from None
    except UnicodeDecodeError as exc:
        raise RulesError(
            [Problem(Location(path, 1, 1), f"the file is not UTF-8 text: {exc.reason}")]
        ) from None


def _pairs(items: list[str], option: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"drgate rules explain: {option} wants K=V, got {item!r}")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    if args.rules_command == "check":
        return _check(args.file)
    return _explain(args)


def _check(path: str) -> int:
    try:
        ruleset = load_rules(_read(path), path)
    except RulesError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        errors = len(exc.problems)
        print(f"{path}: invalid: {errors} error{'s' if errors != 1 else ''}", file=sys.stderr)
        return 1
    for warning in ruleset.warnings:
        print(warning, file=sys.stderr)
    n = len(ruleset.rules)
    print(
        f"{path}: ok: {n} rule{'s' if n != 1 else ''} and a default, "
        f"{len(ruleset.warnings)} warning{'s' if len(ruleset.warnings) != 1 else ''}, "
        f"sha256 {ruleset.digest[:16]}"
    )
    return 0


def _explain(args: argparse.Namespace) -> int:
    path = args.file
    try:
        ruleset = load_rules(_read(path), path)
    except RulesError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    queue_args = _pairs(args.arg, "--arg") or None
    headers = _pairs(args.header, "--header")
    message = args.exchange is not None or args.key is not None or bool(headers)
    rule, outcome, how = ruleset.explain(
        args.queue,
        queue_args,
        exchange=args.exchange if message else None,
        routing_key=args.key if message else None,
        headers=headers if message else None,
        size=args.size,
    )
    what = "message to queue" if message else "queue"
    print(f"{what} {args.queue!r}")
    where = f"{path}:{rule.location.line}"
    print(f"  rule:        {rule.name} ({where})")
    print(f"  how:         {how}")
    if isinstance(outcome, Drop):
        print(f"  mode:        {rule.action.mode_label}")
        print(f"  outcome:     dropped ({outcome.reason}: {outcome.detail})")
    else:
        print(f"  mode:        {outcome.mode.label}")
    print(f"  name at D:   {rule.action.prefix}{args.queue}{rule.action.suffix}")
    if rule.action.max_message_bytes is not None:
        print(f"  max message: {rule.action.max_message_bytes} bytes")
    return 0
