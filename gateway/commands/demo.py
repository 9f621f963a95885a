"""``drgate demo`` (``make demo``): two sites, four modes, a killed egress, checked invariants.

See gateway/demo.py for what it does.  Runs on the embedded bus over
loopback; needs no root.  Exit status 0 when every invariant held, 1 when
one did not, 130 when interrupted (every process it started is stopped).

The lab (``deploy/``) lives in the source tree, not in the installed
package: it is imported when the command runs, never when the CLI starts, so
a missing lab cannot break the other commands.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from protocol.errors import DrgateError

NAME = "demo"
HELP = "run the two-site demo: replication, a killed egress, invariants checked"
# Kept equal to gateway.demo's defaults (that module imports the lab, see above).
DEFAULT_DURATION_S = 30.0
DEFAULT_RATE = 50.0


class LabMissingError(DrgateError):
    """The lab (deploy/lab) is not importable: drgate was installed without its source tree."""


def ensure_lab_importable() -> None:
    """Put the source tree on sys.path when deploy/ is beside the gateway package."""
    if importlib.util.find_spec("deploy") is not None:
        return
    root = Path(__file__).resolve().parents[2]
    if (root / "deploy" / "lab" / "site.py").is_file():
        sys.path.insert(0, str(root))
        return
    raise LabMissingError(
        f"the lab (deploy/lab) is not next to {root / 'gateway'}; run drgate demo and "
        "drgate lab from a source checkout (make demo)"
    )


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
    ensure_lab_importable()
    from gateway.demo import DemoOptions, run_demo

    options = DemoOptions(
        duration_s=args.duration, rate=args.rate, kill=not args.no_kill, workdir=args.workdir
    )
    return run_demo(options)
