"""P's active egress tells its site how far D acknowledged (``AckWatermark``
on P's bus): the standby taps trim their spools by it, and ``drgate
switchover`` drains by it."""

from __future__ import annotations

import time

import trio

from cluster.member import SiteMember
from protocol import cluster as pc

# The standbys trim by the announced watermark; once a second is plenty.
WATERMARK_INTERVAL_S = 1.0


class WatermarkAnnouncer:
    """Posts ``site``'s acked point at most once a second, and the last ack
    of a burst once that second has passed (:meth:`due`)."""

    def __init__(self, member: SiteMember, site: str) -> None:
        self.member = member
        self.site = site
        self._last = -WATERMARK_INTERVAL_S
        self._announced = 0  # the last watermark posted

    def announce(self, acked_seq: int) -> None:
        now = trio.current_time()
        if acked_seq == self._announced or now - self._last < WATERMARK_INTERVAL_S:
            return
        self._last = now
        self._announced = acked_seq
        incarnation = self.member.state.incarnation
        self.member.post(pc.AckWatermark(self.site, incarnation, acked_seq, int(time.time() * 1e6)))

    def due(self, acked_seq: int, deadline: float | None) -> float | None:
        """``deadline``, or sooner when an ack waits to be announced (which
        this announces once it is due)."""
        self.announce(acked_seq)
        if acked_seq == self._announced:
            return deadline
        due = self._last + WATERMARK_INTERVAL_S
        return due if deadline is None else min(deadline, due)
