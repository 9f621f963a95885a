"""``drgate recover [--force] --config FILE``: a site waiting for its brokers'
journals, and the operator's way to stop the wait.

A site whose every process stopped recovers from its brokers' journals once
``bus.expect_brokers`` of them reported what they hold (``Recovering``,
cluster/member.py).  A broker gone for good (a dead disk, a lost machine)
never reports, and the site would wait forever.  This command joins the
site's bus as a short-lived ADMIN member (like ``drgate promote``), with a
broker's or a sidecar's config of that site, and prints who reported and the
cseq each holds.  With ``--force`` it multicasts ``ForceRecovery``: every
member then continues from the most advanced of those that reported, and the
command waits until the site is live.  What the absent brokers held beyond
that is lost (docs/broker.md, "Durability").
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import trio

from cluster.bus import BusConfig, open_bus
from cluster.member import BusOpener, SiteMember, recovery_progress
from cluster.state.model import SiteState
from gateway.brokerconfig import load_broker_config
from gateway.config import load_sidecar_config
from gateway.netns import enter_bus_netns
from gateway.resync import open_admin_member
from protocol import cluster as pc
from protocol.errors import ConfigError, DrgateError

NAME = "recover"
HELP = "show a whole-site recovery's wait for its brokers, or force it from those that reported"

# A recovered state of a few GB crosses the bus in seconds; a minute says the
# chosen broker is stuck, which the command reports rather than hang.
LIVE_WITHIN_S = 60.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="a broker's or sidecar's config of the site",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="stop waiting for the brokers that did not report: continue from the most "
        "advanced journal of those that did",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def load_site_bus(path: str) -> tuple[str, BusConfig]:
    """The site and bus of ``path``, a broker's or a sidecar's config."""
    try:
        broker = load_broker_config(path)
    except ConfigError as as_broker:
        try:
            sidecar = load_sidecar_config(path)
        except ConfigError as as_sidecar:
            raise DrgateError(
                f"{path} is neither a broker's nor a sidecar's config.\n"
                f"As a broker's: {as_broker}\nAs a sidecar's: {as_sidecar}"
            ) from None
        return sidecar.site, sidecar.bus
    return broker.cluster, broker.bus


def run(args: argparse.Namespace) -> int:
    site, bus = load_site_bus(args.config)
    enter_bus_netns(bus)
    say: Callable[[str], None] = (lambda _line: None) if args.json else print
    result = trio.run(lambda: recover_site(site, bus, force=args.force, say=say))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def _reports(state: SiteState) -> list[dict[str, int]]:
    return [
        {"node": node, "pid": pid, "cseq": cseq, "incarnation": incarnation}
        for node, (pid, cseq, incarnation, _proposal) in sorted(state.candidates.items())
    ]


def _not_waiting(site: str, state: SiteState) -> str | None:
    """Why ``site`` is not waiting for its brokers' reports, or None if it is."""
    if state.incarnation != 0:
        return (
            f"site {site} is live (incarnation {state.incarnation:#x}, cseq {state.cseq}): it "
            "waits for no recovery, nothing to force"
        )
    if state.recovery_winner is not None:
        node, _pid = state.recovery_winner
        return (
            f"site {site} already chose node {node}'s journal and is taking its state: "
            "nothing to force; it is live once that is done"
        )
    return None


class _Refused(Exception):
    """Raised inside the admin member's nursery, said outside it (a DrgateError
    there would reach the caller wrapped in an exception group)."""


async def recover_site(
    site: str,
    bus: BusConfig,
    *,
    force: bool,
    say: Callable[[str], None] = print,
    open_member: BusOpener = open_bus,
    live_within_s: float = LIVE_WITHIN_S,
) -> dict[str, Any]:
    """Print ``site``'s recovery wait; with ``force``, end it (``ForceRecovery``)
    and wait until the site is live.  Raises :class:`DrgateError` when the
    site keeps no journals, is not waiting (``force`` only), nobody reported
    (``force``), or it does not become live within ``live_within_s``."""
    if bus.expect_brokers == 0:
        raise DrgateError(
            f"the config's bus has no expect_brokers: site {site} keeps no journals, so a "
            "restart of the whole site starts it afresh and there is nothing to recover"
        )
    try:
        async with open_admin_member(site, bus, open_member=open_member) as admin:
            return await _show_or_force(admin.member, site, bus, force, say, live_within_s)
    except* _Refused as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise DrgateError(str(leaf)) from None


async def _show_or_force(
    member: SiteMember,
    site: str,
    bus: BusConfig,
    force: bool,
    say: Callable[[str], None],
    live_within_s: float,
) -> dict[str, Any]:
    state = member.state
    result: dict[str, Any] = {
        "site": site,
        "expect": max(state.recovery_expect, bus.expect_brokers),
        "reported": _reports(state),
        "forced": False,
    }
    why = _not_waiting(site, state)
    if why is not None:
        if force:
            raise _Refused(why)
        say(why)
        result.update(live=state.incarnation != 0, cseq=state.cseq)
        return result
    say(f"site {site} waits for its brokers' journals: {recovery_progress(state)}")
    if not force:
        say(
            "start the brokers that did not report; if one is gone for good, run this "
            "again with --force to continue from those that reported"
        )
        result["live"] = False
        return result
    if not state.candidates:
        raise _Refused(
            f"no broker of site {site} reported what its journal holds: start at least "
            "one broker on its journal directory first (forcing now could only start "
            "the site from nothing)"
        )
    # The journals' incarnations, read now: by the time the ForceRecovery is
    # applied here the recovered state may already have replaced this one.
    reported = {incarnation for _pid, _cseq, incarnation, _p in state.candidates.values()}
    candidates = dict(state.candidates)
    await member.submit_and_wait(pc.ForceRecovery(site, int(time.time() * 1e6)))
    return await _wait_live(member, site, result, say, live_within_s, reported, candidates)


def _chosen(state: SiteState, candidates: dict[int, tuple[int, int, int, int]]) -> str | None:
    """Whose journal the forced recovery continues from, and its cseq: the
    winner while the state is being taken, or, once the recovered state has
    replaced this one (it may have by the time the command is back), the
    reporting node whose cseq the site's last recovery continued from."""
    if state.recovery_winner is not None:
        node = state.recovery_winner[0]
        return f"node {node}'s journal (cseq {state.candidates[node][1]})"
    if state.incarnation == 0 or not state.recoveries:
        return None
    cseq = state.recoveries[-1].cseq
    nodes = sorted(n for n, report in candidates.items() if report[1] == cseq)
    return f"node {nodes[0]}'s journal (cseq {cseq})" if nodes else f"cseq {cseq}"


async def _wait_live(
    member: SiteMember,
    site: str,
    result: dict[str, Any],
    say: Callable[[str], None],
    within_s: float,
    reported: set[int],
    candidates: dict[int, tuple[int, int, int, int]],
) -> dict[str, Any]:
    state = member.state
    winner = state.recovery_winner
    chosen = _chosen(state, candidates)
    if chosen is not None:
        say(f"forced: site {site} continues from {chosen}")
    result["forced"] = True
    with trio.move_on_after(within_s):
        await member.site_live.wait()
    state = member.state
    if state.incarnation == 0:
        raise _Refused(
            f"site {site} is not live {within_s:.0f} s after the forced recovery: see the log "
            f"of broker node {'?' if winner is None else winner[0]} (it sends its state to the "
            "others)"
        )
    say(
        f"site {site} is live: incarnation {state.incarnation:#x}, cseq {state.cseq}; brokers "
        "that did not report take the state from the others when they start"
    )
    # A recovery that lacked a journal goes on as a new incarnation
    # (cluster.state.recovery_loses_history): none of the journals had it.
    if state.incarnation not in reported:
        say(
            f"the absent brokers may have had more on disk, which {site}'s DR site may hold: "
            f"{site} goes on as a new incarnation, which the DR site refuses until you run "
            f"there: drgate resync --accept-incarnation {state.incarnation} --origin {site} "
            "--config <a DR sidecar's config> (a resync makes it exact)"
        )
    result.update(live=True, incarnation=state.incarnation, cseq=state.cseq)
    return result
