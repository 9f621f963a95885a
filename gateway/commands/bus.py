"""``drgate bus``: run the embedded site bus sequencer for one group.

It prints the address it listens on (``listening on HOST:PORT``) and serves
until SIGTERM or SIGINT.  It admits only the members that prove they hold the
site's key (``--key-file``, made by ``drgate keygen --bus``; see
cluster/bus/auth.py) and logs every peer it refuses, with its address.  It is
the single-machine and test engine; a production site runs corosync (see
docs/bus.md).
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys

import trio

from cluster.addresses import Address, parse_address
from cluster.bus.auth import read_key_file
from cluster.bus.embedded import serve_sequencer
from gateway.logs import configure_logging
from protocol.errors import ConfigError

NAME = "bus"
HELP = "run the embedded site bus sequencer (tests and single machine; not production)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        type=_listen_address,
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument("--group", required=True, metavar="NAME", help="the bus group served")
    parser.add_argument(
        "--key-file",
        required=True,
        metavar="FILE",
        help="the site's bus key (drgate keygen --bus FILE); every member's bus.key_file "
        "names a copy of it",
    )


def _listen_address(text: str) -> Address:
    """``--listen`` parsed as a config address is, its mistake shown as argparse shows one."""
    try:
        return parse_address(text, key="--listen")
    except ConfigError as exc:
        problem = exc.problems[0]
        raise argparse.ArgumentTypeError(f"{problem.message} ({problem.hint})") from None


def run(args: argparse.Namespace) -> int:
    key = read_key_file(args.key_file)
    configure_logging(site=args.group, role_getter=lambda: "sequencer")
    trio.run(_serve, args.listen.host, args.listen.port, args.group, key)
    return 0


async def _serve(host: str, port: int, group: str, key: bytes) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            bound_host, bound_port = await nursery.start(
                functools.partial(serve_sequencer, host, port, group, key=key)
            )
            print(f"listening on {bound_host}:{bound_port} group {group}", flush=True)
            async for _ in signals:
                print("stopping on signal", file=sys.stderr, flush=True)
                nursery.cancel_scope.cancel()
                break
