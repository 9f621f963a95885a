"""``drgate demo`` (``make demo``): two sites, four modes, a killed egress, checked invariants.

See gateway/demo.py for what it does.  Runs on the embedded bus over
loopback; needs no root.  Exit status 0 when every invariant held, 1 when
one did not, 130 when interrupted (every process it started is stopped).

The demo and the lab (the ``lab`` package) are imported when the command
runs, not when the CLI starts: the other commands need neither rich's live
view nor Proton's client.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "demo"
HELP = "run the two-site demo: replication, a killed egress, invariants checked"
# Kept equal to gateway.demo's defaults (imported only when the command runs, see above).
DEFAULT_DURATION_S = 30.0
DEFAULT_RATE = 50.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        help=f"seconds of publishing ({DEFAULT_DURATION_S:.0f})",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_RATE,
        help=f"messages a second published to each queue at P ({DEFAULT_RATE:.0f})",
    )
    parser.add_argument(
        "--no-kill", action="store_true", help="do not kill the active egress halfway"
    )
    parser.add_argument("--workdir", type=Path, help="keep configs, logs and spools here")


def run(args: argparse.Namespace) -> int:
    from gateway.demo import DemoOptions, run_demo

    options = DemoOptions(
        duration_s=args.duration, rate=args.rate, kill=not args.no_kill, workdir=args.workdir
    )
    return run_demo(options)
