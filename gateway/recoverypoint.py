"""D's recovery point: what a failover now would lose of P, seen from D.

Theory of operation
-------------------
Every D member applies P's ``Replicated`` commands and keeps, per origin,
the highest P cseq applied and P's commit time of it (``Origin.applied``,
``Origin.last_time_us``).  That time alone would make an idle P look like a
dead one, so P's egress announces its wall clock and its last spooled seq in
the link's PINGs (link minor 2, every 5 s), and D's active ingress puts that
*heartbeat* on D's bus as an ``AckWatermark`` of P's name (at most once a
second, :class:`HeartbeatPoster`), so every D member, standbys and brokers
too, holds the last one in ``SiteState.watermarks`` and reports the same
figures (:func:`recovery_point`):

* ``rpo_seconds``: now minus the latest P time up to which D holds all of
  P: P's commit time of the last event D applied, or the heartbeat's time
  when D applied everything the heartbeat announced.  With P idle it stays
  within a heartbeat of 0; with P gone it rises with wall time.
* ``rpo_events``: the heartbeat's last seq minus D's applied cseq (a cseq
  distance, so at most the events missing), when a heartbeat came.

Both are ``None`` while D holds nothing of P, and after D was promoted over
P (D is the primary then; the figure at the promotion is in the promote
command's output).  The seconds compare P's clock with D's: keep both sites
on NTP.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.state.model import SiteState
from protocol import cluster as pc
from protocol import link

# Heartbeats come every 5 s (the link's ping interval); a bound on how often
# a link peer can make D's bus carry one (the member's spill queue is sized
# for one AckWatermark a second).
HEARTBEAT_POST_INTERVAL_S = 1.0


def recovery_point(state: SiteState, origin: str, now_us: int) -> tuple[float | None, int | None]:
    """(rpo_seconds, rpo_events) of ``origin`` at ``now_us``, as described above."""
    o = state.origins.get(origin)
    if o is None or o.promoted or o.incarnation == 0:
        return None, None
    applied = o.applied.get(o.incarnation, 0)
    held_at = o.last_time_us
    events = None
    heartbeat = state.watermarks.get(origin)
    if heartbeat is not None and heartbeat[0] == o.incarnation:
        _incarnation, last_seq, time_us = heartbeat
        events = max(0, last_seq - applied)
        if events == 0:
            held_at = max(held_at, time_us)
    if not held_at:
        return None, events
    return max(0.0, (now_us - held_at) / 1e6), events


class HeartbeatPoster:
    """D's active ingress: each link heartbeat goes to D's bus (``post``), at
    most once per :data:`HEARTBEAT_POST_INTERVAL_S` (``now`` is a monotonic
    clock); a heartbeat skipped is made good by the next one."""

    def __init__(self, post: Callable[[pc.Command], None]) -> None:
        self._post = post
        self._last = -HEARTBEAT_POST_INTERVAL_S

    def heard(self, hello: link.Hello, heartbeat: link.Heartbeat, now: float) -> None:
        if now - self._last < HEARTBEAT_POST_INTERVAL_S:
            return
        self._last = now
        self._post(
            pc.AckWatermark(
                hello.origin_cluster, hello.incarnation, heartbeat.last_seq, heartbeat.time_us
            )
        )
