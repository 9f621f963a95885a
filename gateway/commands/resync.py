"""``drgate resync --accept-incarnation N --config sidecar.yaml``: accept a
primary that restarted from nothing.

A primary site restarted from nothing is a new incarnation; D keeps its
replicas and its ingress refuses the new incarnation's link with an error
naming this command.  The command joins D's bus as an ADMIN member and
multicasts ``AcceptIncarnation``; the next connection of P's egress finds
that D applied nothing of the new incarnation and re-seeds D with a resync
snapshot, which replaces D's replicas (``enqueue`` queues keep what D's
consumers have not taken and receive the new incarnation's messages).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import trio

from gateway.commands._dr_site import check_dr_now, configure_dr_site, load_dr_site
from gateway.resync import open_admin_member, origin_summary
from protocol import cluster as pc
from protocol.errors import DrgateError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

NAME = "resync"
HELP = "accept a restarted primary's new incarnation, which re-seeds this DR site"


def configure(parser: argparse.ArgumentParser) -> None:
    configure_dr_site(parser, origin_help="the primary")
    parser.add_argument(
        "--accept-incarnation",
        required=True,
        metavar="N",
        type=lambda text: int(text, 0),
        help="the primary's new incarnation, as the link error names it",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    config, origin = load_dr_site(args, command=NAME)
    if args.accept_incarnation <= 0:
        raise DrgateError("--accept-incarnation must be the new incarnation (a positive number)")
    result = trio.run(_accept, config, origin, args.accept_incarnation)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(
            f"{config.site} now accepts incarnation {args.accept_incarnation} of {origin} "
            f"(was {result['previous_incarnation']}); {origin}'s egress re-seeds "
            f"{config.site} with a resync on its next connection"
        )
    return 0


async def _accept(config: SidecarConfig, origin: str, incarnation: int) -> dict[str, object]:
    async with open_admin_member(config.site, config.bus) as member:
        check_dr_now(config, member.state, command=NAME)
        o = member.state.origins.get(origin)
        result = origin_summary(o)
        result["previous_incarnation"] = 0 if o is None else o.incarnation
        await member.submit_and_wait(pc.AcceptIncarnation(origin, incarnation))
        after = member.state.origins.get(origin)
        if after is None or after.incarnation != incarnation:
            raise DrgateError(f"AcceptIncarnation of {incarnation} was not applied")
        result["incarnation"] = incarnation
        return result
