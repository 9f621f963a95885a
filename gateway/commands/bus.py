"""``drgate bus``: run the embedded site bus sequencer for one group.

It prints the address it listens on (``listening on HOST:PORT``) and serves
until SIGTERM or SIGINT.  It is the single-machine and test engine; a
production site runs corosync (see docs/bus.md).
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from cluster.bus.contract import parse_address
from cluster.bus.embedded import serve_sequencer

NAME = "bus"
HELP = "run the embedded site bus sequencer (tests and single machine; not production)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument("--group", required=True, metavar="NAME", help="the bus group served")


def run(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    trio.run(_serve, host, port, args.group)
    return 0


async def _serve(host: str, port: int, group: str) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            bound_host, bound_port = await nursery.start(serve_sequencer, host, port, group)
            print(f"listening on {bound_host}:{bound_port} group {group}", flush=True)
            async for _ in signals:
                print("stopping on signal", file=sys.stderr, flush=True)
                nursery.cancel_scope.cancel()
                break
