"""``drgate admin user add``: the broker's users file (cluster/amqpauth.py).

The password is read from standard input (one line) or, on a terminal,
prompted twice; it never appears on the command line, where ``ps`` and the
shell history would show it.  The file is rewritten atomically with mode 0600.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import TextIO

from cluster.amqpauth import User, load_users, save_users
from protocol.errors import ConfigError, DrgateError


class UsersFileError(DrgateError):
    """The users file or the password given is not usable."""


def configure_user(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``user add NAME ...`` to the ``drgate admin`` operations."""
    user = sub.add_parser("user", help="manage the broker's users file (amqp.users)")
    ops = user.add_subparsers(dest="user_op", required=True, metavar="USER_OP")
    add = ops.add_parser(
        "add",
        help="add a user, or replace its password and rights (password from stdin or a prompt)",
    )
    add.add_argument("user_name", metavar="NAME")
    add.add_argument("--admin", action="store_true", help="may use $drgate.admin (any queue)")
    add.add_argument(
        "--publish",
        action="append",
        default=[],
        metavar="PATTERN",
        help="may send to queues or exchanges matching this glob (repeat for several)",
    )
    add.add_argument(
        "--consume",
        action="append",
        default=[],
        metavar="PATTERN",
        help="may receive from queues matching this glob (repeat for several)",
    )
    add.add_argument("--file", required=True, metavar="PATH", help="the users file (JSON)")


def read_password(stdin: TextIO | None = None) -> str:
    """One line of ``stdin``; on a terminal, a prompt, twice."""
    stdin = stdin or sys.stdin
    if stdin.isatty():
        first = getpass.getpass("password: ")
        if getpass.getpass("again: ") != first:
            raise UsersFileError("the two passwords differ; nothing was written")
        password = first
    else:
        password = stdin.readline().rstrip("\r\n")
    if not password:
        raise UsersFileError(
            "empty password; give it on standard input (echo ... | drgate admin user add ...) "
            "or type it at the prompt"
        )
    return password


def add_user(path: str, user: User) -> None:
    """Add ``user`` to the users file at ``path`` (created if absent), or
    replace the entry of that name.  Raises :class:`ConfigError` when the
    file exists and is not a users file."""
    users = load_users(path) if Path(path).exists() else {}
    users[user.name] = user
    save_users(path, users)


def run_user(args: argparse.Namespace, stdin: TextIO | None = None) -> int:
    from argon2 import PasswordHasher

    password = read_password(stdin)
    user = User(
        args.user_name,
        PasswordHasher().hash(password),
        admin=args.admin,
        publish=tuple(args.publish),
        consume=tuple(args.consume),
    )
    try:
        add_user(args.file, user)
    except ConfigError as exc:
        raise UsersFileError("; ".join(str(p) for p in exc.problems)) from exc
    except OSError as exc:
        raise UsersFileError(f"cannot write {args.file}: {exc.strerror}") from exc
    rights = "admin" if user.admin else "publish " + (", ".join(user.publish) or "nothing")
    if not user.admin:
        rights += "; consume " + (", ".join(user.consume) or "nothing")
    print(f"user {user.name} in {args.file}: {rights}; restart the brokers to apply")
    return 0
