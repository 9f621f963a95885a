"""``drgate hash-password``: print the argon2 hash of a password for a web config.

The password is read from the terminal without echo (twice), or as one line
from standard input when that is not a terminal; it is never an argument,
which would leave it in the shell history and the process list.  Paste the
printed line under ``basic_auth_users`` (docs/observability.md).
"""

from __future__ import annotations

import argparse
import getpass
import sys

NAME = "hash-password"
HELP = "print the argon2 hash of a password, for basic_auth_users in a metrics web config"


def configure(parser: argparse.ArgumentParser) -> None:
    del parser  # no options: the password never goes on the command line


def run(args: argparse.Namespace) -> int:
    del args
    import argon2

    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            print("drgate hash-password: the two passwords differ", file=sys.stderr)
            return 1
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("drgate hash-password: give a password that is not empty", file=sys.stderr)
        return 1
    print(argon2.PasswordHasher().hash(password))
    return 0
