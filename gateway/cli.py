"""The ``drgate`` command line: one entry point, one sub-command per module.

Each module in :mod:`gateway.commands` is one sub-command.  It defines
``NAME`` (the word after ``drgate``), ``HELP`` (one line), ``configure(parser)``
(adds its options) and ``run(args) -> int`` (the exit code).  Adding a command
is adding a module; nothing here changes.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

import gateway.commands
from protocol.errors import DrgateError


def _command_modules() -> list[ModuleType]:
    modules = []
    for info in sorted(pkgutil.iter_modules(gateway.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        modules.append(importlib.import_module(f"gateway.commands.{info.name}"))
    return modules


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drgate",
        description="Disaster-recovery replication of queue state between broker clusters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _command_modules():
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.configure(command)
        command.set_defaults(run=module.run)
    return parser


def _leaves(group: BaseExceptionGroup[DrgateError]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except DrgateError as exc:
        # A user's mistake or an operational failure: the message says what and
        # how to fix it; a traceback would only hide that.
        print(f"drgate {args.command}: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # A service's nursery wraps what its task raised (a member refused
        # by the bus, say): when that is only DrgateErrors, say them as above.
        errors, rest = group.split(DrgateError)
        if errors is None or rest is not None:
            raise
        for error in _leaves(errors):
            print(f"drgate {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
