"""``drgate failback --delta``: after a forced failover, make the old primary
the DR site of the promoted one, shipping only what it lacks
(docs/operations.md, "Failback by delta").  Sidecar configs that link both
ways only.  Two steps, like the failback:

1. At the promoted site (D), with one of its sidecars' configs:
   ``Switchover ADOPT`` on D's bus.  D runs as the primary from there: its
   sidecars tap its stream and dial the old primary (which refuses them as
   long as it is a primary itself).  Prints the cseq of the old primary's
   stream D applied last and the command for step 2.
2. At the old primary (P), with ``--after`` that cseq and ``--out DIR``:
   records P's divergent tail under DIR (as ``drgate divergence`` does: it
   is discarded with P's spools in the next step), then ``Switchover
   REJOIN`` on P's bus: P becomes D's DR site, its replicated queues closed
   to publishes and frozen, and its next link from D is a resync to which
   P's WELCOME announces what it holds, so D sends only the rest
   (gateway/resync.py).  It waits for that resync and prints the bytes it
   took against a whole resync of the same state.

To make P the primary again afterwards: ``drgate switchover`` at D (RPO 0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from gateway.commands.switchover import Steps, guarded_queues
from gateway.divergence import tail_of
from gateway.resync import AdminMember, open_admin_member
from gateway.roles import runs_as_primary
from protocol import cluster as pc
from protocol.errors import DrgateError

if TYPE_CHECKING:
    from cluster.state.model import SiteState
    from gateway.sidecarconfig import SidecarConfig

TIMEOUT_S = 600.0
POLL_S = 0.2  # the state has no event to wait on
PROGRESS_S = 10.0  # how often the wait for the resync says where it is
# The counters of P's state that measure the resync (cluster/state/resync.py).
FIGURES = ("resync_bytes_staged", "resync_kept_messages", "resync_kept_bytes")


def check_config(config: SidecarConfig, path: str) -> None:
    """A failback by delta needs sidecars that can run either role."""
    if not config.reversible:
        raise DrgateError(
            f"{path} links one way only (no peers, or no listen): a failback by delta makes "
            f"the old primary the DR site of the promoted one, which needs sidecar configs that "
            "link both ways (docs/operations.md, 'Links both ways'); without, use 'drgate "
            "failback' without --delta (the DR site is resynced from the old primary)"
        )


# --------------------------------------------------------------------------
# Step 1, at the promoted site
# --------------------------------------------------------------------------


async def adopt(config: SidecarConfig, origin: str) -> dict[str, object]:
    """D takes the primary's role for ``origin``, the site it was promoted over."""
    async with open_admin_member(config.site, config.bus) as member:
        o = member.state.origins.get(origin)
        if o is None or not o.promoted or origin in member.state.handovers:
            raise DrgateError(
                f"{config.site} was not promoted over {origin} by a failover (drgate promote): "
                "nothing to fail back by delta (after a planned switchover, switch back with "
                f"'drgate switchover' at {config.site})"
            )
        after = o.applied.get(o.incarnation, 0)
        if not _primary(config, member.state):
            # The role flag that makes this site the primary: its configured
            # role flipped, or not.
            want = {"swapped": int(not member.state.swapped)}
            adopt = pc.Switchover(origin, pc.SwitchoverPhase.ADOPT, _now_us(), want)
            await member.submit_and_wait(adopt)
            if not _primary(config, member.state):
                raise DrgateError(f"the ADOPT of {origin} was not applied at {config.site}")
        return {"site": config.site, "origin": origin, "after": after, "cseq": member.state.cseq}


def adopted_text(result: dict[str, object]) -> str:
    site, origin, after = result["site"], result["origin"], result["after"]
    return (
        f"{site} runs as the primary for {origin} from its cseq {result['cseq']}; its "
        f"sidecars resync {origin} by delta once it rejoins. The last {origin} cseq {site} "
        f"applied is {after}. Now, at {origin}: drgate failback --delta --after {after} "
        f"--out DIR --config <a {origin} sidecar's config>"
    )


# --------------------------------------------------------------------------
# Step 2, at the old primary
# --------------------------------------------------------------------------


def export_tail(
    config: SidecarConfig, after: int, out: Path, *, force: bool, steps: Steps
) -> dict[str, object]:
    """Record this sidecar's divergent tail under ``out`` before the rejoin
    discards the spools; refuses a tail the spool does not hold whole
    unless ``force``."""
    tail = tail_of(config.spool_dir, after)
    if tail.missing and not force:
        spans = ", ".join(f"{a}..{b}" for a, b in tail.missing)
        raise DrgateError(
            f"{config.site}'s tail after cseq {after} is not whole in {config.spool_dir} "
            f"(missing cseqs {spans}); the rejoin discards every spool of the site. Record it "
            "at the site's other sidecars first (drgate divergence), then run this again "
            "with --force"
        )
    written = tail.record(out, site=config.site, node=config.node)
    events, missing, queues = tail.events, tail.missing, tail.queues
    published = {name: len(q.published) for name, q in queues.items() if q.published}
    where = ", ".join(str(p) for p in written) or "nothing to record"
    steps.say(
        "tail",
        f"{len(events)} events after cseq {after} the DR site never applied; messages "
        f"published per queue: {published or 'none'}; recorded: {where}",
    )
    return {
        "events": len(events),
        "missing": [list(r) for r in missing],
        "published": published,
        "capture": [str(p) for p in written],
    }


async def rejoin(config: SidecarConfig, to: str, limit_s: float, steps: Steps) -> dict[str, object]:
    """P becomes ``to``'s DR site; waits for ``to``'s resync by delta."""
    async with open_admin_member(config.site, config.bus) as member:
        state = member.state
        if not _primary(config, state):
            raise DrgateError(
                f"{config.site} is not a primary now: nothing to fail back by delta "
                f"({'it rejoins ' + state.rejoining if state.rejoining else 'it is a DR site'})"
            )
        guarded = guarded_queues(config, state)
        before = {name: state.counters[name] for name in FIGURES}
        await member.submit_and_wait(
            pc.Switchover(to, pc.SwitchoverPhase.REJOIN, _now_us(), guarded)
        )
        if member.state.handed_to != to:  # rejoining, or already resynced
            raise DrgateError(f"the REJOIN to {to} was not applied at {config.site}")
        steps.say(
            "rejoin",
            f"{config.site} is {to}'s DR site from cseq {member.state.cseq}; {len(guarded)} "
            f"replicated queues closed; waiting for {to}'s resync (run 'drgate failback "
            f"--delta' at {to} first if not done)",
        )
        if not await _resynced(member, to, limit_s, steps, before):
            raise DrgateError(
                f"{to}'s resync did not come within {limit_s:.0f} s: {config.site} stays its DR "
                f"site and waits for it (see drgate status at {to}'s sidecars: link_state, "
                "last_error, resync)"
            )
        return _figures(member.state, to, before)


async def _resynced(
    member: AdminMember, to: str, limit_s: float, steps: Steps, before: dict[str, int]
) -> bool:
    """Until ``to``'s resync is installed here (False: not within ``limit_s``),
    saying every :data:`PROGRESS_S` how much of it is staged."""
    deadline = time.monotonic() + limit_s
    next_say = time.monotonic() + PROGRESS_S
    while (state := member.state).rejoining == to:
        now = time.monotonic()
        if now > deadline:
            return False
        if now > next_say:
            staged = state.counters["resync_bytes_staged"] - before["resync_bytes_staged"]
            steps.say("resync", f"{staged} bytes of {to}'s snapshot staged so far")
            next_say = now + PROGRESS_S
        await trio.sleep(POLL_S)
    return True


def _figures(state: SiteState, to: str, before: dict[str, int]) -> dict[str, object]:
    shipped, kept, kept_bytes = (state.counters[n] - before[n] for n in FIGURES)
    o = state.origins.get(to)
    cut = 0 if o is None else o.applied.get(o.incarnation, 0)
    whole = shipped + kept_bytes
    return {
        "site": state.cluster,
        "primary": to,
        "cut": cut,
        "bytes_shipped": shipped,
        "messages_kept": kept,
        "bytes_kept": kept_bytes,
        "bytes_whole_resync": whole,
        "ratio": round(shipped / whole, 4) if whole else 0.0,
    }


def rejoined_text(result: dict[str, object]) -> str:
    site, to = result["site"], result["primary"]
    ratio = float(result["ratio"])  # type: ignore[arg-type]
    return (
        f"done: {site} holds {to}'s state as of {to}'s cseq {result['cut']} and is its DR "
        f"site. Shipped {result['bytes_shipped']} bytes of snapshot; {result['messages_kept']} "
        f"messages {site} held were kept, not shipped ({result['bytes_kept']} bytes): a whole "
        f"resync would have shipped about {result['bytes_whole_resync']} bytes ({ratio:.1%} "
        f"of it shipped). To make {site} the primary again: drgate switchover at {to}"
    )


def _primary(config: SidecarConfig, state: SiteState) -> bool:
    return runs_as_primary(state, configured=config.primary, reversible=True)


def _now_us() -> int:
    return int(time.time() * 1e6)
