"""``drgate switchover --config sidecar.yaml``: hand the primary's role over to
its DR site with nothing lost (RPO 0); see docs/operations.md, "A planned
switchover".

Run at P with a P sidecar's config.  It joins P's bus as a short-lived ADMIN
member (like ``drgate verify``) and, printing each step with its time:

1. *quiesce*: multicasts ``Switchover(QUIESCE)`` naming the queues the rules
   replicate with messages (``full`` and ``enqueue``): from that point of
   P's stream their publishes are refused with a condition that names the
   switchover, and nothing more is acquired from them; what consumers hold
   may still be settled, and goes to D like any settlement;
2. *drain*: waits until P's egress announces that D acknowledged the
   quiesce's own event (``AckWatermark``), so D holds everything P
   forwarded before it;
3. *settle* (when consumers hold messages of the closed queues): waits
   until they settled them, since from the handover on a settlement there
   is not applied; *handover*: multicasts ``Switchover(HANDOVER)``.  D applies it in P's
   stream, after everything before it, and is promoted over P there (its
   ``full`` replicas writable).  D then refuses P's stream, and P's egress
   records the handover (``Superseded``; the queues stay closed and the
   egress stops dialling D).  The command waits for that and prints it;
4. *swap* (sidecar configs that link both ways, ``peers`` and ``listen``):
   D's sidecars, the primary's now, send their first event, a ``SWAP``,
   which makes P D's DR site at that point of D's stream without a resync
   (cluster/state/switchover.py).  The command waits for it and prints D's
   cseq there.  A second switchover, run at D, swaps the sites back.

A timeout (``--timeout``) or an interrupt during the quiesce or the drain
aborts: ``Switchover(ABORT)`` opens the queues again and P stays the
primary.  Once the handover is multicast it cannot be taken back (D may
already hold it): a timeout then says so, and how to see which site is the
primary.  ``--abort`` ends a switchover that a killed command left half
way, or the wait of a failback's queues for a DR site that never comes
back (cluster/state/switchover.py).  Exit 0 switched over, 1 aborted or not confirmed.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from cluster.state import SiteState
from cluster.state.switchover import handed_over, handover_confirmed
from gateway.config import load_sidecar_config
from gateway.content import MESSAGE_MODES
from gateway.netns import enter_bus_netns
from gateway.resync import AdminMember, open_admin_member
from gateway.roles import runs_as_primary
from gateway.supersession import replicated_queues
from gateway.tap import Tap
from protocol import cluster as pc
from protocol.errors import DrgateError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

NAME = "switchover"
HELP = "planned switchover: quiesce P, drain the link to D (RPO 0), promote D in P's stream"
TIMEOUT_S = 60.0
POLL_S = 0.05  # the state has no event to wait on


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="a P sidecar's config (bus, site, rules)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT_S,
        help=f"seconds for the drain, and then for the handover's confirmation ({TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--abort", action="store_true", help="end a switchover left half way; P stays primary"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")


def run(args: argparse.Namespace) -> int:
    config = load_sidecar_config(args.config)
    if not config.primary and not config.reversible:
        raise DrgateError(
            f"{args.config} is a DR sidecar's config ({config.site}): run drgate switchover "
            "at the primary, with one of its sidecars' configs"
        )
    if args.timeout <= 0:
        raise DrgateError(f"--timeout must be above 0 seconds, not {args.timeout}")
    enter_bus_netns(config.bus)
    steps = Steps(quiet=args.json)
    if args.abort:
        result = trio.run(_abort_left, config, steps)
    else:
        result = trio.run(_switchover, config, args.timeout, steps)
    if args.json:
        print(json.dumps({**result, "steps": steps.done}, sort_keys=True))
    return 0 if result.get("switched") or result.get("aborted_left") else 1


class Steps:
    """Each step printed with the time it took since the command started."""

    def __init__(self, *, quiet: bool) -> None:
        self.started = time.monotonic()
        self.quiet = quiet
        self.done: list[dict[str, object]] = []

    def say(self, step: str, text: str) -> None:
        at = time.monotonic() - self.started
        self.done.append({"step": step, "at_s": round(at, 3), "text": text})
        if not self.quiet:
            print(f"[{at:7.3f} s] {step}: {text}", flush=True)


async def _switchover(config: SidecarConfig, limit_s: float, steps: Steps) -> dict[str, object]:
    to = config.peer_cluster
    async with open_admin_member(config.site, config.bus) as member:
        state = member.state
        _check_can_start(config, state)
        was_swapped = state.swapped
        guarded = guarded_queues(config, state)
        quiesce = pc.Switchover(to, pc.SwitchoverPhase.QUIESCE, _now_us(), guarded)
        acked_before = _acked(member, config.site)
        quiesced_at = await member.submit_and_wait(quiesce)
        if member.state.switchover_to != to:
            raise DrgateError(f"the quiesce was not applied at {config.site} (cseq {quiesced_at})")
        window_start = time.monotonic()
        steps.say(
            "quiesce",
            f"{len(guarded)} replicated queues of {config.site} refuse publishes and new "
            f"acquisitions from cseq {quiesced_at}",
        )
        behind = max(0, quiesced_at - acked_before)
        steps.say("drain", f"waiting for {to} to acknowledge up to cseq {quiesced_at}")
        try:
            drained = await _wait(lambda: _acked(member, config.site) >= quiesced_at, limit_s)
        except BaseException:
            await _abort(member, to, steps, "interrupted")
            raise
        if not drained:
            await _abort(member, to, steps, f"{to} did not acknowledge within {limit_s:.0f} s")
            return {"switched": False, "aborted": True, "quiesced_cseq": quiesced_at}
        steps.say("drain", f"{to} holds all of {config.site} up to cseq {quiesced_at}")
        await _settle(member, guarded, limit_s, steps)
        # Naming the closed queues: they stay frozen until the new primary's
        # SWAP makes this site its DR site (configs that link both ways).
        frozen = guarded if config.reversible else {}
        handover = pc.Switchover(to, pc.SwitchoverPhase.HANDOVER, _now_us(), frozen)
        handover_at = await member.submit_and_wait(handover)
        steps.say("handover", f"at cseq {handover_at}: {to} is promoted when it applies it")
        confirmed = await _wait(lambda: handover_confirmed(member.state, to, was_swapped), limit_s)
        window_s = time.monotonic() - window_start
        result: dict[str, object] = {
            "site": config.site,
            "to": to,
            "quiesced_cseq": quiesced_at,
            "handover_cseq": handover_at,
            "drained_cseqs": behind,
            "window_seconds": round(window_s, 3),
            "guarded_queues": sorted(guarded),
        }
        if not confirmed:
            steps.say(
                "handover",
                f"not confirmed within {limit_s:.0f} s: {to} may or may not be the primary "
                f"now. The queues of {config.site} stay closed; check {to} (drgate status: "
                f"dr.origins.{config.site}.promoted) before anything else",
            )
            return {**result, "switched": False}
        if not config.reversible:
            steps.say(
                "done",
                f"{to} is the primary; {config.site} handed over and sends it nothing. "
                f"Publishes were refused for {window_s:.3f} s; move the clients to {to}",
            )
            return {**result, "switched": True}
        steps.say("swap", f"waiting for {to}'s first event as the primary")
        swapped = await _wait(lambda: member.state.swapped != was_swapped, limit_s)
        if not swapped:
            steps.say(
                "swap",
                f"{to} is the primary, but its stream has not reached {config.site} within "
                f"{limit_s:.0f} s; {config.site} takes it from {to}'s first event as soon as "
                f"{to}'s egress connects (drgate status at {to}: link)",
            )
            return {**result, "switched": True, "swapped": False}
        origin = member.state.origins[to]
        swap_cseq = origin.applied.get(origin.incarnation, 0)
        steps.say(
            "done",
            f"{to} is the primary and {config.site} its DR site from {to}'s cseq {swap_cseq} "
            f"(nothing shipped, no resync). Publishes were refused for {window_s:.3f} s; move "
            f"the clients to {to}. To swap back: drgate switchover at {to}",
        )
        return {**result, "switched": True, "swapped": True, "swap_cseq": swap_cseq}


def _held(state: SiteState, queues: dict[str, None]) -> int:
    """Messages of ``queues`` consumers hold (acquired, not settled)."""
    return sum(len(q.acquired) for name in queues if (q := state.queues.get(name)) is not None)


async def _settle(
    member: AdminMember, guarded: dict[str, None], limit_s: float, steps: Steps
) -> None:
    """Before the handover: until consumers settled what they hold of the
    closed queues (they acquire nothing new).  From the handover on a
    settlement there is not applied (the site's copy must stay what D holds),
    so a message still held then goes to D's consumers again."""
    held = _held(member.state, guarded)
    if not held:
        return
    steps.say("settle", f"waiting for consumers to settle the {held} messages they hold")
    if await _wait(lambda: _held(member.state, guarded) == 0, limit_s):
        steps.say("settle", "nothing held")
        return
    steps.say(
        "settle",
        f"{_held(member.state, guarded)} messages still held after {limit_s:.0f} s: handing "
        f"over all the same; their consumers' settlements are not applied from here, and "
        f"{member.state.cluster}'s DR site delivers them again",
    )


def _check_can_start(config: SidecarConfig, state: SiteState) -> None:
    if not runs_as_primary(state, configured=config.primary, reversible=config.reversible):
        raise DrgateError(
            f"{config.site} is {config.peer_cluster}'s DR site now (a switchover swapped "
            f"the sites): run drgate switchover at {config.peer_cluster}"
        )
    if state.superseded_by:
        raise DrgateError(
            f"{config.site} is not the primary: {state.superseded_by} took over "
            "(docs/operations.md, 'When the primary comes back')"
        )
    if state.switchover_to:
        raise DrgateError(
            f"a switchover of {config.site} to {state.switchover_to} is under way; if its "
            "command is gone, end it with drgate switchover --abort --config <this config>"
        )
    if config.site not in state.watermarks:
        raise DrgateError(
            f"{config.site}'s egress has announced no acknowledgement from "
            f"{config.peer_cluster} yet: is the link up? (drgate status)"
        )


def guarded_queues(config: SidecarConfig, state: SiteState) -> dict[str, None]:
    """The queues P's rules replicate with messages (the rules file, or the
    rules the site switched to since)."""
    tap = Tap(config.rules, origin_cluster=config.site)
    tap.resync_rules(state)
    return replicated_queues(tap.rules, state, MESSAGE_MODES)


def _acked(member: AdminMember, site: str) -> int:
    mark = member.state.watermarks.get(site)
    if mark is None or mark[0] != member.state.incarnation:
        return 0
    return mark[1]


async def _wait(check: Callable[[], bool], limit_s: float) -> bool:
    with trio.move_on_after(limit_s):
        while not check():  # noqa: ASYNC110 - the state has no event to wait on
            await trio.sleep(POLL_S)
        return True
    return False


async def _abort(member: AdminMember, to: str, steps: Steps, why: str) -> None:
    with trio.CancelScope(shield=True):
        await member.submit_and_wait(pc.Switchover(to, pc.SwitchoverPhase.ABORT, _now_us()))
    steps.say("abort", f"{why}: the queues take publishes again; {member.state.cluster} is primary")


async def _abort_left(config: SidecarConfig, steps: Steps) -> dict[str, object]:
    async with open_admin_member(config.site, config.bus) as member:
        to = member.state.switchover_to
        waiting = member.state.failback_cseq
        if waiting and not to:
            # A failback waiting for D, no switchover under way: open its queues now.
            to = config.peer_cluster
            with trio.CancelScope(shield=True):
                await member.submit_and_wait(pc.Switchover(to, pc.SwitchoverPhase.ABORT, _now_us()))
            steps.say(
                "abort",
                f"the failback at cseq {waiting} no longer waits for "
                f"{to}: the queues give consumers messages again",
            )
            return {"aborted_left": True, "to": to, "failback_wait_ended": True}
        if not to or member.state.superseded_by:
            raise DrgateError(
                f"no switchover of {config.site} to abort"
                + (f" (it handed over to {to})" if handed_over(member.state) else "")
            )
        await _abort(member, to, steps, "aborted by the operator")
        return {"aborted_left": True, "to": to}


def _now_us() -> int:
    return int(time.time() * 1e6)
