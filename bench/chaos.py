"""A long chaos run (tests/chaos/engine.py): ``make chaos SEED=... FAULTS=... BUS=...``.

Prints the seed, the planned schedule, the timeline as it runs and the
report; exit status 0 when every claim held, 1 otherwise.  A run replays
from its seed (the same schedule; the timing is the machine's).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.chaos.engine import ChaosOptions, run_chaos  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--faults", type=int, default=200)
    parser.add_argument("--bus", choices=["embedded", "corosync"], default="embedded")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a restarted broker or sidecar may take to be ready (default 60; a "
        "200-fault corosync run on 2 cores needs about 180: its restarts wait for a core)",
    )
    parser.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="the publishers' rates times X (default 1; a 200-fault corosync run on 2 cores "
        "keeps them at full rate at load 16 to 20, where restarts take minutes)",
    )
    parser.add_argument(
        "--reversible",
        action="store_true",
        help="sidecar configs that link both ways: a switchover swaps the sites in place and "
        "the switch back is a second switchover (default: a failback)",
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    options = ChaosOptions(seed=seed, faults=args.faults, bus=args.bus, workdir=args.workdir)
    options = dataclasses.replace(options, rate_scale=args.rate_scale, reversible=args.reversible)
    if args.start_timeout is not None:
        options = dataclasses.replace(options, start_timeout_s=args.start_timeout)
    report = run_chaos(
        options,
        say=lambda line: print(line, flush=True),
    )
    print(report.text(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
