"""Why D refuses a primary's stream, and the split brain a refusal reveals.

Theory of operation
-------------------
D's active ingress checks every HELLO, and the open link at every step,
against the site state (R7, docs/architecture.md section 6): a stream from a
primary this site was promoted over, of an epoch it does not accept, or of
an incarnation it has not accepted is refused for good, with a text that
names the command resolving it (:func:`refusal`).

The first is a **split brain**: this site was promoted, so it takes writes
as a primary, and the site it was promoted over still runs an egress, so it
considers itself primary too, whatever either epoch is.  Nothing is merged
(nothing crosses the link) and both sides *park*: D refuses the stream
(``PARTITIONED`` to an egress of link minor 2 or later, ``STALE_EPOCH`` to
an older one; either turns the egress's zombie guard on) and reports
``partitioned`` while that primary keeps knocking (:class:`PartitionWatch`);
the egress reports it until a WELCOME.  Only an operator ends it, with the
commands the text names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.state import fenced
from cluster.state.model import SiteState
from cluster.state.switchover import awaiting_swap
from cluster.state.views import applied
from gateway import resync as rs
from protocol import link

# How long D reports a split brain after the other primary's last HELLO.  A
# refused egress tries every D sidecar in turn and sleeps at most 7.5 s
# between rounds (BACKOFF_MAX_S with jitter, gateway/egress.py), so the
# active ingress hears from it well within this while it runs; once it stops
# (retired, or failed back) the flag clears by itself.
PARTITION_HOLD_S = 30.0
# The first link minor version that knows the PARTITIONED code.
PARTITIONED_MINOR = 2


@dataclass(frozen=True, slots=True)
class Refusal:
    """A HELLO (or an open link) refused for good: the ERROR frame's code and
    text; ``partitioned`` when the peer is a second primary."""

    code: int
    text: str
    partitioned: bool = False


def refusal(state: SiteState, *, site: str, hello: link.Hello) -> Refusal | None:
    """Why this site (``site``, in ``state``) refuses ``hello``'s stream, or
    None to go on."""
    origin = state.origins.get(hello.origin_cluster)
    if origin is None or awaiting_swap(state, hello.origin_cluster):
        return None  # unknown, or the site this one handed over to: its SWAP comes
    peer = hello.origin_cluster
    if origin.promoted and peer in state.handovers:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(origin.promoted_time_us / 1e6))
        text = (
            f"{peer} handed over to {site} in a planned switchover at {when} (epoch "
            f"{origin.epoch}): {site} is the primary and takes no stream from {peer}. To make "
            f"{peer} the primary again: 'drgate switchover' at {site} (sidecar configs that "
            f"link both ways), or 'drgate failback --config <a {site} sidecar's config>' at "
            f"{site}, then the command it prints at {peer}"
        )
        return Refusal(int(link.LinkErrorCode.STALE_EPOCH), text)
    if origin.promoted:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(origin.promoted_time_us / 1e6))
        text = (
            f"split brain: {site} and {peer} are both primaries ({site} was promoted over {peer} "
            f"at {when}, epoch {origin.epoch}; {peer}'s egress connects at epoch {hello.epoch}). "
            "Replication is parked and nothing is merged. To keep "
            f"{site} as the primary: stop {peer}'s clients and rebuild {peer} as {site}'s DR "
            f"site, or (configs that link both ways) make {peer} its DR site keeping what it "
            f"holds: 'drgate failback --delta --config <a {site} sidecar's config>' at {site}, "
            f"then the command it prints at {peer}. To make {peer} the primary again: run "
            f"'drgate failback --config <a {site} "
            f"sidecar's config>' at {site}, then the command it prints at {peer} "
            "(docs/operations.md, 'Split brain'). What "
            f"{peer} accepted after the last of its events {site} applied (cseq "
            f"{origin.applied.get(hello.incarnation, 0)}): 'drgate divergence --after "
            f"{origin.applied.get(hello.incarnation, 0)} --out DIR --config <a {peer} sidecar's "
            f"config>' at {peer}"
        )
        code = link.LinkErrorCode.STALE_EPOCH
        if hello.minor >= PARTITIONED_MINOR:
            code = link.LinkErrorCode.PARTITIONED
        return Refusal(int(code), text, partitioned=True)
    if fenced(origin, hello.epoch):
        text = (
            f"{site} accepts {peer}'s stream at epoch {origin.epoch} only; this one is "
            f"epoch {hello.epoch}. After 'drgate failback' at {site}, run at {peer}: "
            f"drgate failback --epoch {origin.epoch} --config <a {peer} sidecar's config>"
        )
        return Refusal(int(link.LinkErrorCode.STALE_EPOCH), text)
    if origin.incarnation not in (0, hello.incarnation):
        text = (
            f"{peer} is incarnation {hello.incarnation}, but "
            f"{site} replicates its incarnation {origin.incarnation} "
            f"(applied up to cseq {origin.applied.get(origin.incarnation, 0)}). "
            f"{peer} restarted from nothing; {site}'s replicas "
            "are kept as they are. To replace them by the new incarnation's state, run at "
            f"{site}: drgate resync --accept-incarnation {hello.incarnation} "
            f"--origin {peer} --config <sidecar.yaml>"
        )
        return Refusal(rs.NEW_INCARNATION_CODE, text)
    return None


def resume_from(state: SiteState, hello: link.Hello) -> int:
    """Where an accepted ``hello``'s stream resumes: after what this site
    applied of it, or, from the site this one handed over to, wherever that
    site's spool starts (its first event is the ``SWAP`` that makes this site
    its DR site, whatever came before)."""
    if awaiting_swap(state, hello.origin_cluster):
        return hello.resume_point
    return applied(state, hello.origin_cluster, hello.incarnation)


class PartitionWatch:
    """D's split-brain flag: set by each refusal of a second primary, read
    as true for :data:`PARTITION_HOLD_S` after the last one, and only while
    this site's promotion over that peer stands."""

    def __init__(self) -> None:
        self.peer = ""
        self._last = -PARTITION_HOLD_S  # time.monotonic() of the last such refusal

    def refused(self, peer: str) -> None:
        self.peer = peer
        self._last = time.monotonic()

    def partitioned(self, state: SiteState) -> bool:
        origin = state.origins.get(self.peer)
        recent = time.monotonic() - self._last < PARTITION_HOLD_S
        return recent and origin is not None and origin.promoted
