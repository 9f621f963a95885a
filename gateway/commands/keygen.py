"""``drgate keygen --bus FILE``: write a new key for a site's embedded bus.

The file holds random bytes with mode 0400; an existing file is never
replaced.  The sequencer (``drgate bus --key-file FILE``) and every member of
the site (``bus.key_file`` in the broker and sidecar configs, which the admin
tools read too) need a copy of the same file: joining the bus is proving you
hold it (cluster/bus/auth.py, docs/bus.md).  A corosync site authenticates
its nodes with corosync's own authkey instead (``corosync-keygen``).
"""

from __future__ import annotations

import argparse

from cluster.bus.auth import KEY_BYTES, write_key_file

NAME = "keygen"
HELP = "write a new key file for a site's embedded bus (drgate bus --key-file, bus.key_file)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bus",
        required=True,
        metavar="FILE",
        help="where to write the bus key (it must not exist yet)",
    )


def run(args: argparse.Namespace) -> int:
    write_key_file(args.bus)
    print(
        f"wrote {KEY_BYTES} random bytes to {args.bus} (mode 0400); copy it to every host "
        "of the site and name it in `drgate bus --key-file` and in bus.key_file"
    )
    return 0
