"""A planned switchover in the state machine (docs/operations.md, "A planned
switchover"; ``Switchover``, protocol/switchovercommands.py).

At P, ``QUIESCE`` closes the queues it names (``guarded``, the queues the
rules replicate with messages) to publishes and new acquisitions: from
that point of P's stream nothing changes them but the settlements of what
consumers already held, which reach D in the stream like any.  ``ABORT``
opens them again.  ``HANDOVER`` changes nothing at P: every tap forwards it,
and D applies it after everything P forwarded before it, so D is promoted
with all of P (RPO 0) at exactly that point; P's egress is then refused
with the promotion and P becomes superseded (its zombie guard); the
switchover's target stays recorded, so P knows it handed over
(:func:`handed_over`: its egress stops dialling D, which is a primary now,
not a second one) until ``drgate failback`` sets a new epoch.

At D, inside a ``Replicated`` from the origin: a ``HANDOVER`` naming this
site promotes it over the origin, as ``drgate promote`` would, at the next
epoch, and records that ``origin`` handed over (``state.handovers``: when
it knocks it is a former primary, not a second one); one naming another
site changes nothing.  ``QUIESCE`` and ``ABORT``
change nothing at D.

Back at P, ``drgate failback`` (``SetEpoch``) ends the supersession, and D,
which forgot what it applied of P, is resynced by P's next link.  A message
published after the failback and taken by a consumer before the resync's
cut would never reach an ``enqueue`` replica, so the queues replicated with
messages (``failback_queues``: those the guard closed and, with
``zombie_guard: full``, the ``enqueue`` ones it left open) take publishes
at once but give consumers nothing until the active
egress announces D's acknowledgment of the failback's point
(``AckWatermark``, :func:`failback_acknowledged`): ``failback_cseq``.
``ABORT`` opens them without waiting, for a DR site that never comes back
(a switchover started meanwhile is aborted first, by an ``ABORT`` of its
own).

**The roles swap in place** (sidecar configs that link both ways).  Their
``HANDOVER`` names P's closed queues, which are frozen from there
(``handover_cseq``: no acquisition, and a settlement, which could never
reach D, promoted at that point, is not applied), so D at the handover
holds exactly P's replicated state; a ``HANDOVER`` naming none freezes
nothing (the one-way switchover above).  Applying the handover, D becomes the primary:
``swapped`` flips, and its sidecars, if their configs can link the other
way, tap its stream from there on.  Their first event carries a ``SWAP``
naming each queue D replicates, with its mode and D's highest position in
it; at P (:func:`swap_in`) it turns those queues into replicas of D, ends
the supersession and the switchover, and flips ``swapped``: P is D's DR
site from that point of D's stream, without a resync.  A second switchover,
from D, swaps them back the same way.  An ``AcceptPrimary`` at D (``drgate
failback``) ends D's role as the primary it took by the handover.

Pure functions of the state, like the rest of :mod:`cluster.state`."""

from __future__ import annotations

import time

from cluster.state.effects import Effects, Promoted, Sender
from cluster.state.merge import origin_record
from cluster.state.model import Queue, Replica, SiteState
from cluster.state.queues import forget_hold
from protocol.cluster import Replicated, Switchover, SwitchoverPhase
from protocol.modes import Mode

__all__ = [
    "awaiting_swap",
    "closed_to_publishes",
    "end",
    "failback",
    "failback_acknowledged",
    "failback_text",
    "failing_back",
    "guard_text",
    "handover",
    "handover_confirmed",
    "rejoin_done",
    "stale_supersession",
    "swap_in",
    "swapped_text",
    "swapping",
    "switching",
    "switchover",
]


# How an operator ends a switchover that stopped half way.
ABORT_HINT = "drgate switchover --abort --config SIDECAR.yaml, on a node of this site"


def switchover(state: SiteState, cmd: Switchover, sender: Sender | None, eff: Effects) -> None:
    """A step of a planned switchover at this site, the primary."""
    if cmd.phase == SwitchoverPhase.QUIESCE:
        if state.superseded_by or state.switchover_to:
            state.count("ignored")  # superseded, or one under way already
            return
        state.switchover_to = cmd.to_cluster
        state.switchover_time_us = cmd.time_us
        state.guarded = dict.fromkeys(cmd.guarded)
    elif cmd.phase == SwitchoverPhase.ABORT:
        if state.switchover_to == cmd.to_cluster and not state.superseded_by:
            end(state)
            if not state.failback_cseq:  # else its consumers still wait for D
                state.guarded = {}
        elif state.failback_cseq:  # a failback waiting for its DR site: open now
            state.failback_cseq = 0
            state.guarded, state.failback_queues = {}, {}
        else:
            state.count("ignored")
    elif cmd.phase == SwitchoverPhase.REJOIN:
        rejoin(state, cmd)
    elif cmd.phase == SwitchoverPhase.ADOPT:
        adopt(state, cmd)
    elif cmd.phase == SwitchoverPhase.HANDOVER:
        # The taps forward it to D.  One naming queues expects the new
        # primary's SWAP: those are frozen from here until it comes.
        if state.switchover_to == cmd.to_cluster and not state.handover_cseq:
            if cmd.guarded:
                state.handover_cseq = state.cseq
        else:
            state.count("ignored")


def end(state: SiteState) -> None:
    """The switchover is over (aborted, or the site was superseded)."""
    state.switchover_to = ""
    state.switchover_time_us = 0
    state.handover_cseq = 0


def frozen(state: SiteState, queue: str) -> bool:
    """Is ``queue`` frozen by a handover this site sent, until the new
    primary's ``SWAP``, or by a failback by delta, until the primary's
    resync (no acquisition, no settlement)?"""
    return bool(state.handover_cseq or state.rejoining) and queue in state.guarded


def handed_over(state: SiteState) -> bool:
    """Did this site hand its role over to the site it is superseded by?"""
    return bool(state.superseded_by) and state.switchover_to == state.superseded_by


def handover_confirmed(state: SiteState, to: str, was_swapped: bool) -> bool:
    """``drgate switchover``'s wait after its ``HANDOVER``: ``to`` took over,
    as the supersession this site's refused egress records
    (:func:`handed_over`), or, when ``to``'s ``SWAP`` followed that and
    ended it before the command looked, as this site being ``to``'s DR site
    with its roles flipped since the command read ``was_swapped``."""
    if handed_over(state):
        return state.superseded_by == to
    return state.handed_to == to and state.swapped != was_swapped


def stale_supersession(state: SiteState, by: str) -> bool:
    """Does a ``Superseded`` by ``by`` no longer mean that ``by`` was
    promoted over this site?  When this site replaced ``by`` by a failover
    (after a failback by delta's ``ADOPT`` that old primary refuses this
    site's stream until it rejoins), or is ``by``'s DR site since its
    ``SWAP`` or this site's ``REJOIN`` (a refusal of this site's egress
    posted before its role changed and applied after)."""
    o = state.origins.get(by)
    replaced = o is not None and o.promoted and by not in state.handovers
    if replaced and state.switchover_to != by:
        return True
    return state.handed_to == by and not state.switchover_to


def switching(state: SiteState, queue: str) -> bool:
    """Is ``queue`` closed by a switchover under way (not by a supersession),
    or frozen until the new primary's ``SWAP``?"""
    if frozen(state, queue):
        return True
    return bool(state.switchover_to) and not state.superseded_by and queue in state.guarded


def closed_to_publishes(state: SiteState, queue: str) -> bool:
    """Is ``queue`` closed to publishes, by a switchover, a supersession or
    the swap that made this site the DR site of the one it handed over to?"""
    return queue in state.guarded and bool(
        state.superseded_by or state.switchover_to or state.handed_to
    )


def swapped_text(state: SiteState, queue: str) -> str:
    """Why ``queue`` takes no publishes at a site that swapped roles with
    ``handed_to``, the primary now."""
    to = state.handed_to
    return (
        f"{state.cluster} handed its role over to {to} in a planned switchover and is its DR "
        f"site: replicated queue {queue!r} takes publishes at {to}, the primary. Move this "
        f"queue's clients to {to} (docs/operations.md, 'A planned switchover')"
    )


def failing_back(state: SiteState, queue: str) -> bool:
    """Does ``queue`` give consumers nothing until the DR site holds this
    site's state again (after a failback)?"""
    return bool(state.failback_cseq) and queue in state.failback_queues


def failback(state: SiteState) -> None:
    """``SetEpoch`` at a superseded site, or one whose handover D applied
    before P heard of it: the queues replicated with messages (those the
    guard or the switchover closed, and those the guard left open) stay
    closed to consumers until the DR site acknowledges this point."""
    if (state.guarded or state.failback_queues) and (state.superseded_by or state.switchover_to):
        state.failback_cseq = state.cseq
        state.failback_queues.update(state.guarded)
    else:
        state.guarded, state.failback_queues = {}, {}


def failback_acknowledged(state: SiteState, origin: str, incarnation: int, cseq: int) -> None:
    """The active egress announced that the DR site acknowledged this site's
    stream up to ``cseq``: at or past the failback, its queues open."""
    if not state.failback_cseq or origin != state.cluster or incarnation != state.incarnation:
        return
    if cseq >= state.failback_cseq:
        state.failback_cseq = 0
        state.failback_queues = {}
        if not (state.superseded_by or state.switchover_to):  # else they stay closed
            state.guarded = {}


def failback_text(state: SiteState, queue: str) -> str:
    """Why ``queue`` gives consumers nothing yet after a failback."""
    acked = state.watermarks.get(state.cluster, (0, 0, 0))[1]
    return (
        f"{state.cluster} failed back at cseq {state.failback_cseq}: replicated queue {queue!r} "
        f"cannot be consumed from until the DR site holds {state.cluster}'s state again (the "
        f"link's resync after the failback; acknowledged so far: cseq {acked}). Publishes "
        f"are taken meanwhile. If the DR site is gone for good, open the queue now with "
        f"{ABORT_HINT}: what consumers take before the resync then never reaches the DR site"
    )


def guard_text(state: SiteState, queue: str, what: str) -> str:
    """Why ``queue`` cannot ``what`` while a switchover is under way."""
    to = state.switchover_to
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(state.switchover_time_us / 1e6))
    return (
        f"{state.cluster} is switching over to {to} (a planned switchover, since {when}): "
        f"replicated queue {queue!r} cannot {what} here until it ends. Connect this "
        f"queue's clients to {to} once it is the primary; if the switchover stopped half "
        f"way, end it with {ABORT_HINT}"
    )


def handover(state: SiteState, origin: str, epoch: int, cmd: Switchover, eff: Effects) -> None:
    """At D, inside a ``Replicated`` of ``origin`` at ``epoch``: promote this
    site over ``origin`` if the handover names it (at the next epoch, as
    ``drgate promote``), else nothing."""
    if cmd.phase != SwitchoverPhase.HANDOVER or cmd.to_cluster != state.cluster:
        return
    o = origin_record(state, origin)
    if o.promoted:
        state.count("ignored")
        return
    o.epoch = max(o.epoch, epoch) + 1
    o.promoted = True
    o.promoted_time_us = cmd.time_us
    state.handovers[origin] = None
    state.swapped = not state.swapped  # the primary now, whatever it was configured as
    if state.handed_to == origin:  # it swapped with this site before: its queues reopen
        state.handed_to, state.guarded = "", {}
    eff.append(Promoted(origin, o.epoch))


def awaiting_swap(state: SiteState, peer: str) -> bool:
    """Did this site hand over to ``peer``, whose stream it takes from the
    ``SWAP`` that starts it (whatever it knew of ``peer`` before)?"""
    return bool(state.handover_cseq) and state.switchover_to == peer


def swapping(state: SiteState, cmd: Replicated) -> bool:
    """Is ``cmd`` the first event of the site this one handed over to, as
    the primary (a ``SWAP`` naming this site)?"""
    if not awaiting_swap(state, cmd.origin_cluster):
        return False
    return any(
        isinstance(c, Switchover)
        and c.phase == SwitchoverPhase.SWAP
        and c.to_cluster == state.cluster
        for c in cmd.commands
    )


def take_dr_role(state: SiteState, origin: str) -> None:
    """Before ``origin``'s ``SWAP`` is admitted: this site becomes its DR
    site.  What it knew of ``origin``'s stream (a promotion over it, epochs,
    what it applied) is forgotten, so the new primary's stream is accepted
    from this event, at its incarnation and epoch; the handover and the
    supersession end, and the roles flip."""
    o = origin_record(state, origin)
    o.promoted = False
    o.promoted_time_us = 0
    o.epoch = 0
    o.incarnation = 0
    o.applied = {}
    state.handovers.pop(origin, None)
    state.staged.pop(origin, None)
    state.superseded_by = ""
    state.superseded_time_us = 0
    state.failback_queues, state.failback_cseq = {}, 0
    end(state)
    state.swapped = not state.swapped
    state.handed_to = origin  # ``guarded`` stays closed: its clients belong at the primary


def swap_in(state: SiteState, origin: str, mode: Mode, cmd: Switchover, eff: Effects) -> None:
    """In ``origin``'s ``SWAP`` (after :func:`take_dr_role`): each queue it
    names becomes a replica of ``origin`` in ``mode``, as received up to the
    position it gives.  What this site's consumers held of a ``full`` one
    is let go (its settlements must come from the primary now)."""
    for name, high in cmd.guarded.items():
        q = state.queues.get(name)
        if q is None or not isinstance(high, int):
            state.count("replicated_missing_queue")
            continue
        if q.replica is not None and q.replica.origin not in (origin, state.cluster):
            state.count("r6_conflicts")  # a replica of a third site: left as it is
            continue
        _become_replica(state, q, origin, mode, high)


# --------------------------------------------------------------------------
# A failback by delta (docs/operations.md, "Failback by delta")
# --------------------------------------------------------------------------


def adopt(state: SiteState, cmd: Switchover) -> None:
    """``ADOPT`` at a site promoted over ``cmd.to_cluster`` by a forced
    failover: it runs as the primary from here (its sidecars, if their
    configs link both ways, tap its stream and dial ``to_cluster``, which a
    ``REJOIN`` there makes its DR site).  ``guarded["swapped"]`` is the
    value of ``swapped`` that makes it the primary, which only its sidecars'
    configured role tells (the command reads it from a config), so the
    step is the same applied twice.  It stays promoted: ``to_cluster``'s
    own stream is still refused."""
    o = state.origins.get(cmd.to_cluster)
    swapped = cmd.guarded.get("swapped")
    if o is None or not o.promoted or cmd.to_cluster in state.handovers or swapped is None:
        state.count("ignored")  # not promoted over it by a failover
        return
    state.swapped = bool(swapped)


def rejoin(state: SiteState, cmd: Switchover) -> None:
    """``REJOIN`` at a site ``cmd.to_cluster`` was promoted over: it becomes
    that site's DR site.  What it knew of ``to_cluster``'s stream is
    forgotten, so the primary's next link resyncs it; the queues it names
    stay closed to publishes (their clients belong at the primary) and are
    frozen until that resync is installed (:func:`rejoin_done`), so that what
    this site announced it holds stays here until then."""
    if state.rejoining or state.handed_to == cmd.to_cluster:
        state.count("ignored")
        return
    take_dr_role(state, cmd.to_cluster)
    state.guarded = dict.fromkeys(cmd.guarded)
    state.rejoining = cmd.to_cluster


def rejoin_done(state: SiteState, origin: str, queues: dict[str, Mode]) -> None:
    """A resync from ``origin``, the primary this site is rejoining as its
    DR site, is being installed: each of this site's own queues it names
    (``queues``: name and mode) becomes a replica of ``origin``, to be
    replaced (``full``) or kept (``enqueue``, ``wiring``) as the resync
    does with replicas; what this site's consumers held of a ``full`` one
    is let go.  The rejoin is over."""
    if state.rejoining != origin:
        return
    for name, mode in queues.items():
        q = state.queues.get(name)
        if q is None or q.replica is not None:
            continue
        _become_replica(state, q, origin, mode, 0)
    state.rejoining = ""


def _become_replica(state: SiteState, q: Queue, origin: str, mode: Mode, high: int) -> None:
    """``q`` becomes a replica of ``origin`` in ``mode``, received up to
    ``high``; a ``full`` one lets go of what consumers held (their
    settlements must come from the primary now)."""
    q.replica = Replica(origin, mode, high)
    if mode == Mode.FULL:
        for pos, (sid, _consumer) in list(q.acquired.items()):
            forget_hold(state, sid, q.name, pos)
            del q.acquired[pos]
        q.rebuild_available()
