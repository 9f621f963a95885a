"""``drgate failback --config sidecar.yaml``: make the old primary the primary
again after a promotion, in two explicit steps (docs/operations.md, "When the
primary comes back").

A promoted DR site refuses its old primary's stream at every epoch, and the
old primary's brokers refuse publishes to its guarded queues (the zombie
guard), so nothing happens until an operator decides:

1. At D, with a D sidecar's config: multicasts ``AcceptPrimary`` at the epoch
   above D's promotion.  D forgets what it applied of P, so P's next link
   resyncs it: D's ``full`` replicas become P's state again (what D's clients
   wrote to them since the promotion is replaced) and ``enqueue`` queues keep
   what D's consumers have not taken.  It prints the command for step 2.
2. At P, with a P sidecar's config and ``--epoch N`` as step 1 printed:
   multicasts ``SetEpoch(N)``.  P's stream goes on at epoch N, which D accepts,
   and the zombie guard is lifted.

``--delta`` (configs that link both ways) makes the old primary the DR site
of the promoted one instead, shipping only what it lacks
(gateway/commands/_faildelta.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from gateway.commands import _faildelta as delta
from gateway.commands.switchover import Steps
from gateway.config import load_sidecar_config
from gateway.netns import enter_bus_netns
from gateway.resync import open_admin_member
from protocol import cluster as pc
from protocol.errors import DrgateError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

NAME = "failback"
HELP = (
    "after a promotion: let the old primary in again (at D), then resume it at its new epoch (at P)"
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="a sidecar's config (D for step 1, P for 2)"
    )
    parser.add_argument(
        "--origin", metavar="CLUSTER", help="at D: the old primary (default: peer_cluster)"
    )
    parser.add_argument(
        "--epoch", type=int, metavar="N", help="at P: the epoch D accepts it at (step 1 prints it)"
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="make the old primary the DR site of the promoted one, shipping only what it "
        "lacks (configs that link both ways)",
    )
    parser.add_argument(
        "--after",
        type=int,
        metavar="CSEQ",
        help="--delta at P: the last P cseq D applied (step 1 prints it)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="--delta at P: where to record P's divergent tail"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="--delta at P: go on with a tail this sidecar's spool does not hold whole",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=delta.TIMEOUT_S,
        help=f"--delta at P: seconds to wait for D's resync ({delta.TIMEOUT_S:.0f})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    config = load_sidecar_config(args.config)
    enter_bus_netns(config.bus)
    if args.delta:
        return _run_delta(args, config)
    # Configs that link both ways serve either site's role: the step is the
    # one --epoch names (the sites may have swapped since they were written).
    at_old_primary = args.epoch is not None if config.reversible else config.primary
    if at_old_primary:
        if args.epoch is None or args.epoch < 1:
            raise DrgateError(
                f"{args.config} is a primary sidecar's config ({config.site}): give --epoch N, "
                f"the epoch that 'drgate failback' at {config.peer_cluster} printed"
            )
        result = trio.run(_resume, config, args.epoch)
        text = (
            f"{config.site} streams at epoch {args.epoch} from now on; its zombie guard is "
            f"lifted (was superseded by {result['superseded_by'] or 'nobody'})"
        )
    else:
        origin = args.origin or config.peer_cluster
        result = trio.run(_accept, config, origin)
        text = (
            f"{config.site} accepts {origin}'s stream again from epoch {result['epoch']}. "
            f"{origin}'s next link resyncs {config.site}: its full replicas become "
            f"{origin}'s state again. Now, at {origin}: drgate failback --epoch "
            f"{result['epoch']} --config <a {origin} sidecar's config>"
        )
    print(json.dumps(result, sort_keys=True) if args.json else text)
    return 0


async def _accept(config: SidecarConfig, origin: str) -> dict[str, object]:
    async with open_admin_member(config.site, config.bus) as member:
        o = member.state.origins.get(origin)
        if o is None or not o.promoted:
            raise DrgateError(
                f"{config.site} is not promoted over {origin}: nothing to fail back "
                f"(drgate status shows the origin's epoch and promotion)"
            )
        epoch = o.epoch + 1
        await member.submit_and_wait(pc.AcceptPrimary(origin, epoch))
        after = member.state.origins[origin]
        if after.promoted or after.epoch != epoch:
            raise DrgateError(f"AcceptPrimary of {origin} at epoch {epoch} was not applied")
        return {"site": config.site, "origin": origin, "epoch": epoch}


async def _resume(config: SidecarConfig, epoch: int) -> dict[str, object]:
    async with open_admin_member(config.site, config.bus) as member:
        state = member.state
        if epoch <= state.epoch:
            raise DrgateError(
                f"{config.site} is at epoch {state.epoch} already; --epoch must be above it "
                "(the one 'drgate failback' printed at the DR site)"
            )
        superseded_by = state.superseded_by
        await member.submit_and_wait(pc.SetEpoch(epoch))
        if member.state.epoch != epoch:
            raise DrgateError(f"SetEpoch({epoch}) was not applied at {config.site}")
        return {"site": config.site, "epoch": epoch, "superseded_by": superseded_by}


def _run_delta(args: argparse.Namespace, config: SidecarConfig) -> int:
    delta.check_config(config, args.config)
    if args.after is None:  # step 1, at the promoted site
        result = trio.run(delta.adopt, config, args.origin or config.peer_cluster)
        print(json.dumps(result, sort_keys=True) if args.json else delta.adopted_text(result))
        return 0
    if args.after < 0 or not args.out or args.timeout <= 0:
        raise DrgateError(
            "--delta at the old primary needs --after CSEQ (0 or more, as step 1 printed), "
            "--out DIR (where its divergent tail is recorded) and a --timeout above 0"
        )
    steps = Steps(quiet=args.json)
    tail = delta.export_tail(config, args.after, Path(args.out), force=args.force, steps=steps)
    to = args.origin or config.peer_cluster
    result = trio.run(delta.rejoin, config, to, args.timeout, steps)
    result["tail"] = tail
    if args.json:
        print(json.dumps({**result, "steps": steps.done}, sort_keys=True))
    else:
        steps.say("done", delta.rejoined_text(result))
    return 0
