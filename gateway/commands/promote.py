"""``drgate promote --config sidecar.yaml``: make the DR site the primary.

Joins D's bus as a short-lived ADMIN member (state transfer, like a broker),
prints what D holds of the primary (the last applied P ``cseq``, the time of
that event at P and so the RPO of a failover now), and unless ``--dry-run``
multicasts ``Promote`` with the next epoch and waits until it is applied.
From that point of D's stream every D member makes the ``full`` replicas
writable, and D's ingress refuses P's HELLO (``STALE_EPOCH``, saying when D
was promoted).  See docs/operations.md, "Failing over".
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import trio

from gateway.commands._dr_site import check_dr_now, configure_dr_site, load_dr_site
from gateway.resync import open_admin_member, origin_summary
from protocol import cluster as pc
from protocol.errors import DrgateError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

NAME = "promote"
HELP = "promote the DR site: raise the epoch, make full replicas writable, print the RPO"


def configure(parser: argparse.ArgumentParser) -> None:
    configure_dr_site(parser, origin_help="the primary to promote over")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the figures without promoting"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _when(time_us: int) -> str:
    if not time_us:
        return "never"
    seconds = time_us / 1e6
    return (
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{time_us % 1_000_000:06d} UTC"
    )


def run(args: argparse.Namespace) -> int:
    config, origin = load_dr_site(args, command=NAME)
    result: dict[str, object] = trio.run(_promote, config, origin, args.dry_run)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    rpo = result["rpo_seconds"]
    lines = [
        f"site {config.site}, primary {origin}:",
        f"  last applied {origin} cseq: {result['applied_cseq']}"
        f" (incarnation {result.get('incarnation', 0):#x})",
        f"  time of that event at {origin}: {_when(int(str(result['origin_time_us'])))}",
        "  RPO of this failover: "
        + ("unknown (nothing applied)" if rpo is None else f"{float(str(rpo)):.3f} s"),
    ]
    if args.dry_run:
        lines.append("dry run: nothing changed")
    elif result.get("already"):
        lines.append(f"{config.site} was already promoted (epoch {result['epoch']})")
    else:
        lines.append(
            f"promoted: epoch {result['epoch']}; full replicas of {origin} are writable, "
            f"and {origin}'s stream is refused from now on"
        )
    print("\n".join(lines))
    return 0


async def _promote(config: SidecarConfig, origin: str, dry_run: bool) -> dict[str, object]:
    async with open_admin_member(config.site, config.bus) as member:
        check_dr_now(config, member.state, command=NAME)
        o = member.state.origins.get(origin)
        now_us = int(time.time() * 1e6)
        result = origin_summary(o, now_us)
        result.update({"site": config.site, "origin": origin, "dry_run": dry_run})
        if dry_run:
            return result
        if o is not None and o.promoted:
            result["already"] = True
            return result
        epoch = (o.epoch if o is not None else 0) + 1
        await member.submit_and_wait(pc.Promote(origin, epoch, now_us))
        after = member.state.origins.get(origin)
        if after is None or not after.promoted or after.epoch != epoch:
            raise DrgateError(f"Promote of {config.site} over {origin} was not applied")
        result.update({"epoch": epoch, "promoted": True, "promoted_time_us": now_us})
        return result
