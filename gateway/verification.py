"""Continuous verification: the two sites compare their copies while they
run (docs/operations.md, "Verifying the copies").

Theory of operation
-------------------
Every ``interval_s`` the active egress multicasts a ``VerifyPoint`` on P's
bus (:func:`post_verify_points`).  It takes a cseq like any command, so
every P sidecar's tap turns it into the same event: one ``Verify`` per queue
D copies whole, made from P's state at that cseq (gateway/tap.py).  The
event travels the link in order with the rest, so D applies it exactly when
its replicas hold everything up to that cseq: that is the common cut
point.  D's state machine compares each replica with it
(cluster/state/replica.py ``verify``) and returns a ``Verified`` effect,
which every D sidecar records here (:class:`Verifications`): the last
result per queue, shown in ``/status`` (``dr.verify``), as
``drgate_verify_mismatch{queue}`` and by ``drgate verify``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from cluster.member import SiteMember
from cluster.state import Effect, QueueDeleted, Verified
from protocol import cluster as pc

log = logging.getLogger("drgate.sidecar")

DEFAULT_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class VerifySection:
    """D's results: per replica queue, its last comparison (``ok``,
    ``mode``, ``origin``, ``origin_cseq``, ``detail``, ``time_us``); how many
    comparisons were made, and how many found a difference."""

    queues: Mapping[str, Mapping[str, object]]
    checks_total: int
    mismatches_total: int

    @property
    def mismatched(self) -> list[str]:
        return sorted(q for q, r in self.queues.items() if not r["ok"])


class Verifications:
    """D: the last verification of each replica queue (module docstring)."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, object]] = {}
        self.checks_total = 0
        self.mismatches_total = 0

    def record(self, effects: Sequence[Effect], time_us: int | None = None) -> None:
        """Take the ``Verified`` effects of one applied command; forget a
        deleted queue's."""
        for e in effects:
            if isinstance(e, QueueDeleted):
                self._last.pop(e.queue, None)
            if not isinstance(e, Verified):
                continue
            self.checks_total += 1
            was = self._last.get(e.queue)
            if not e.ok:
                self.mismatches_total += 1
                if was is None or was["ok"]:
                    log.warning(
                        "verify: replica %r differs from %r at its cseq %d: %s",
                        e.queue,
                        e.origin,
                        e.origin_cseq,
                        e.detail,
                    )
            elif was is not None and not was["ok"]:
                log.info(
                    "verify: replica %r equals %r again at its cseq %d",
                    e.queue,
                    e.origin,
                    e.origin_cseq,
                )
            self._last[e.queue] = {
                "ok": e.ok,
                "mode": e.mode.label,
                "origin": e.origin,
                "origin_cseq": e.origin_cseq,
                "detail": e.detail,
                "time_us": int(time.time() * 1e6) if time_us is None else time_us,
            }

    def section(self) -> VerifySection:
        return VerifySection(
            {q: dict(r) for q, r in sorted(self._last.items())},
            self.checks_total,
            self.mismatches_total,
        )


async def post_verify_points(
    member: SiteMember, interval_s: float, active: Callable[[], bool]
) -> None:
    """P: a ``VerifyPoint`` every ``interval_s`` while ``active()`` (this
    sidecar is the site's egress); never returns."""
    while True:
        await trio.sleep(interval_s)  # a period, not a wait for something
        if active():
            await member.submit(pc.VerifyPoint(int(time.time() * 1e6)))
