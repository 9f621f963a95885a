"""When another site takes this primary's role: by a promotion over it (a
failover: the zombie guard) or by a handover (a planned switchover).  What
P's egress posts when D refuses it, what it says once it handed over, and
which queues a guard closes (docs/operations.md, "When the primary comes
back" and "A planned switchover")."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster.member import SiteMember
from cluster.state import SiteState
from filters.matcher import RuleSet
from gateway.content import MESSAGE_MODES
from protocol import cluster as pc
from protocol.modes import Mode
from protocol.values import Value

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

log = logging.getLogger("gateway.egress")


def replicated_queues(rules: RuleSet, state: SiteState, modes: Sequence[Mode]) -> dict[str, None]:
    """The queues of ``state`` the ``rules`` replicate in one of ``modes``."""
    return {
        q.name: None
        for q in state.queues.values()
        if rules.decide_queue(q.name, q.args).mode in modes
    }


def post_superseded(member: SiteMember, config: SidecarConfig, rules: RuleSet, error: str) -> None:
    """D was promoted over this site (its egress was refused with ``error``):
    post ``Superseded``, so that every broker refuses publishes to the queues
    the zombie guard covers (none when it is off) until a failback.  After a
    handover it records that this site handed over (the switchover's queues
    stay closed the same way)."""
    state = member.state
    guard = config.zombie_guard
    modes: Sequence[Mode] = ()
    if guard != "off":
        modes = (Mode.FULL,) if guard == "full" else MESSAGE_MODES
    # Every queue replicated with messages waits for D after a failback; the
    # guard closes those of its modes to publishes (None).
    guarded: dict[str, Value] = dict.fromkeys(
        replicated_queues(rules, state, MESSAGE_MODES), pc.FAILBACK_ONLY
    )
    guarded.update(replicated_queues(rules, state, modes))
    if state.switchover_to == config.peer_cluster:
        guarded.update(state.guarded)  # closed for the handover: they stay closed
    closed = sum(1 for only in guarded.values() if only is None)
    member.post(pc.Superseded(config.peer_cluster, int(time.time() * 1e6), guarded))
    log.error(
        "egress: %s was promoted over %s: %s. Zombie guard (%s): publishes to %d "
        "queues are refused from now on",
        config.peer_cluster,
        config.site,
        error,
        guard,
        closed,
    )


def handed_over_text(site: str, state: SiteState) -> str:
    """The status of an egress whose site handed its role over."""
    to = state.superseded_by
    return (
        f"{site} handed over to {to} in a planned switchover: {to} is the primary and "
        f"{site} sends it nothing. To make {site} the primary again: 'drgate switchover' at "
        f"{to} (sidecar configs that link both ways), or 'drgate failback' at {to}, then the "
        "command it prints here (docs/operations.md, 'A planned switchover')"
    )
