"""A sidecar's role, computed from the site stream (docs/architecture.md, section 8).

Theory of operation
-------------------
No election messages exist: every sidecar of a site sees the same stream, so
each computes the same answer to "which sidecar is active" — the sidecar
of the current view that has been ready longest (:func:`active_sidecar`).  A sidecar's own
role (:func:`role_of`) follows from that, from whether the view is quorate
and from the site it sits at (P: egress or standby; D: ingress or
ingress-standby).  Roles change only at view changes and ``MemberReady``
commands; :class:`RoleSignal` lets tasks wait for the next such point.
"""

from __future__ import annotations

from enum import StrEnum

import trio

from cluster.bus import MemberId
from cluster.membership import Membership
from cluster.state.model import SiteState
from cluster.state.switchover import handed_over
from protocol.modes import Role


class SidecarRole(StrEnum):
    """What a sidecar does now.  The values are the names metrics, ``/status``,
    logs and captures show."""

    STARTING = "starting"  # not yet holding the site state
    MINORITY = "minority"  # in a non-quorate view: neither forwards nor ingests
    EGRESS = "egress"  # P: the active sidecar, streams the spool to D
    STANDBY = "standby"  # P: taps and spools, ready to take over
    INGRESS = "ingress"  # D: the active sidecar, applies P's stream
    INGRESS_STANDBY = "ingress-standby"  # D: refuses links, names the active one


# The roles of a sidecar whose site is the primary now.
PRIMARY_ROLES = (SidecarRole.EGRESS, SidecarRole.STANDBY)


def active_sidecar(state: SiteState, membership: Membership | None) -> MemberId | None:
    """The active sidecar of the site: of the ready sidecars in the view, the
    one ready longest (``state.ready`` keeps the order of the ``MemberReady``
    commands, the same at every member and through snapshots).

    Longest, not lowest: a sidecar that restarts joins with an empty spool
    from its join point on, and the events before it that D has not applied
    are only in the spools of the sidecars that were there all along.  Were
    it to take over again as soon as it is ready, its link would find D
    behind its spool and resync, and a resync of an ``enqueue`` queue
    cannot bring back what P's consumers took meanwhile (found by
    tests/chaos)."""
    if membership is None:
        return None
    for (node, pid), role in state.ready.items():
        if role == Role.SIDECAR and MemberId(node, pid) in membership.members:
            return MemberId(node, pid)
    return None


def runs_as_primary(state: SiteState, *, configured: bool, reversible: bool) -> bool:
    """Does a site run as the primary now?  Its sidecars' ``configured``
    role, unless their configs are ``reversible`` (they link both ways) and
    a planned switchover swapped the sites' roles: then the opposite, and a
    site that handed over waits as the DR site for its new primary's
    ``SWAP`` (cluster/state/switchover.py)."""
    if not reversible:
        return configured
    return configured != state.swapped and not handed_over(state)


def role_of(
    me: MemberId | None,
    state: SiteState,
    membership: Membership | None,
    *,
    ready: bool,
    primary: bool,
) -> SidecarRole:
    """The role of sidecar ``me``; ``ready`` once it holds the site state.
    A state without an incarnation is a site still waiting for its brokers'
    recovery (a whole-site restart, or a start-over: cluster/membership.py):
    nothing to forward from or ingest into yet."""
    if membership is None or not ready or not membership.is_ready or state.incarnation == 0:
        return SidecarRole.STARTING
    if not membership.quorate:
        return SidecarRole.MINORITY
    active = me is not None and active_sidecar(state, membership) == me
    if primary:
        return SidecarRole.EGRESS if active else SidecarRole.STANDBY
    return SidecarRole.INGRESS if active else SidecarRole.INGRESS_STANDBY


class RoleSignal:
    """Wakes the tasks waiting for the roles to be computed again."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def changed(self) -> None:
        """The view or the ready set changed: every waiter wakes."""
        self._event.set()
        self._event = trio.Event()

    @property
    def next_change(self) -> trio.Event:
        """The event the next :meth:`changed` sets: take it before looking at
        the roles, then wait on it, and no change in between is missed."""
        return self._event

    async def wait(self) -> None:
        """Until the next :meth:`changed`."""
        await self._event.wait()
