"""The merge rules that more than one place asks about, decided once.

Theory of operation
-------------------
A site replicating another (docs/state.md, "Merge rules") decides three
things outside the inner commands' handlers, and each has exactly one
function here:

* **R3, writability** (:func:`read_only_origin`): a ``full`` replica mirrors
  its origin and is read-only to this site's clients, unless this site was
  promoted over the origin.  The state machine refuses commands with it, the
  views report ``writable`` with it, and a broker refuses an attach with it.
* **R7, fencing** (:func:`fenced`): a stream of an epoch other than the one
  this site accepted from the origin, or any stream of an origin this site
  was promoted over, is fenced.  The state machine fences ``Replicated`` and ``ResyncApply``
  commands with it; the sidecar's ingress refuses a HELLO with it.
* **Admission and bookkeeping** (:func:`admit`, :func:`record_applied`): a
  ``Replicated`` command and a ``ResyncApply`` pass the same checks, in the
  same order (own origin, R7, the accepted incarnation, R1 dedup), each
  refusal counted; once one is applied, the origin's record moves the same
  way (accepted incarnation, epoch, R1 watermark, RPO times).

Pure functions of the state, like the rest of :mod:`cluster.state`.
"""

from __future__ import annotations

from cluster.state.effects import Outcome
from cluster.state.model import Origin, Queue, SiteState
from protocol.modes import Mode


def read_only_origin(state: SiteState, queue: Queue) -> str | None:
    """R3: the origin ``queue`` mirrors read-only here, or None if this
    site's clients may change it (a local queue, a replica of a mode other
    than ``full``, or a ``full`` replica of an origin this site was promoted
    over)."""
    r = queue.replica
    if r is None or r.mode != Mode.FULL:
        return None
    origin = state.origins.get(r.origin)
    if origin is not None and origin.promoted:
        return None
    return r.origin


# How an operator promotes a site: the command, as the CLI parses it.
PROMOTE_HINT = "drgate promote --config SIDECAR.yaml, on a node of this site"


def read_only_text(queue: str, origin: str, what: str) -> str:
    """The R3 refusal: ``queue`` mirrors ``origin`` read-only, so it cannot
    ``what``; how to make it writable."""
    return (
        f"queue {queue!r} is a read-only replica of site {origin!r} (mode full) while "
        f"replication is active, so it cannot {what}; to use it here, promote this site "
        f"over {origin!r} ({PROMOTE_HINT})"
    )


def fenced(origin: Origin | None, epoch: int) -> bool:
    """R7: is a command or HELLO of ``epoch`` from ``origin`` fenced?  After a
    promotion here, every epoch is: only the operator's ``AcceptPrimary``
    lets the origin in again, at the epoch it names.  Otherwise any epoch but
    the accepted one is: below it a stale primary, above it one that was not
    told to move (a link peer cannot raise it).  An origin this site knows
    nothing of (None), or has no epoch from yet, fences nothing."""
    if origin is None:
        return False
    return origin.promoted or origin.epoch not in (0, epoch)


def origin_record(state: SiteState, name: str) -> Origin:
    """The record of origin ``name``, created empty on first use."""
    o = state.origins.get(name)
    if o is None:
        o = state.origins[name] = Origin(name)
    return o


def admit(state: SiteState, origin: str, incarnation: int, cseq: int, epoch: int) -> Outcome | None:
    """Check a replicated command (``cseq`` is its origin cseq, or a resync's
    cut) before it changes anything: the refusing :class:`Outcome`, counted
    (and for a new incarnation remembered in ``refused_incarnation``), or
    None to go on.  The checks, in order: this site's own stream coming back,
    R7 fencing, an incarnation other than the accepted one, R1 dedup.
    Creates the origin's record unless the command is this site's own."""
    if state.cluster and origin == state.cluster:
        state.count("own_origin_refused")
        return Outcome.OWN_ORIGIN
    o = origin_record(state, origin)
    if fenced(o, epoch):
        state.count("r7_fenced")
        return Outcome.FENCED
    if o.incarnation not in (0, incarnation):
        state.count("incarnation_refused")
        o.refused_incarnation = incarnation
        return Outcome.INCARNATION
    if cseq <= o.applied.get(incarnation, 0):
        state.count("r1_duplicates")
        return Outcome.DUPLICATE
    return None


def record_applied(
    state: SiteState, origin: str, incarnation: int, cseq: int, epoch: int, time_us: int
) -> None:
    """Book a replicated command :func:`admit` let through as applied: its
    incarnation is the accepted one, the epoch of a first command is the
    accepted one, the R1 watermark and the RPO times move, and
    ``replicated_applied`` counts it."""
    o = origin_record(state, origin)
    o.incarnation = incarnation
    if o.refused_incarnation == incarnation:
        o.refused_incarnation = 0
    if o.epoch == 0:
        o.epoch = epoch
    o.applied[incarnation] = cseq
    o.last_time_us = time_us
    o.last_cseq = state.cseq
    state.count("replicated_applied")
