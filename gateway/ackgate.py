"""When D's ingress may ack: once what it applied is on a D broker's disk.

Theory of operation
-------------------
An ack lets P drop the events it covers from its spool for good
(gateway/spool.py), so D acks only what it cannot lose.  Without journals
(``bus.expect_brokers: 0``) that is what D's bus applied: a power loss of
the whole DR site loses D's state anyway, and D is resynced.  With journals,
D's brokers report ``Durable(node, cseq)`` after each group commit and the
site state keeps the highest (``state.durable_cseq``); a seq D's bus applied
waits in the connection's :class:`AckGate`, with the D cseq at which its
event was applied, until that watermark covers it.  Then D survives a whole-
site restart with every acked event in its journal, and P resends from its
spool whatever D had not acked: the link resumes without a resync.

The egress drops its spool up to a WELCOME's resume point as it does on an
ack, so the resume point obeys the same rule: the D cseq at which D last
applied the origin's stream (``Origin.last_cseq``) must be under the
watermark.  The ingress waits for it (:meth:`DurableWatermark.wait_resume`,
up to :data:`RESUME_WAIT_S`) and otherwise refuses the HELLO for now
(:meth:`DurableWatermark.resume_refusal`, ``NOT_DURABLE``).  A standby that
took the link over while D's brokers were stopped had applied what no
journal held; its WELCOME let P drop it, and the power cut that followed
lost it.

One ack covers every seq released at once (P's acks stay batched).  Nothing
polls: the sidecar's observer hook calls :meth:`DurableWatermark.advanced`
when a ``Durable`` is applied, which wakes every gate waiting on it.

The price is one group commit of D (an ``fdatasync`` on D's brokers) in the
ack path: P's spool holds events that much longer, and the link's window
fills that much sooner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NoReturn

import trio

from cluster.state.model import SiteState

# How long a HELLO waits for D's brokers to journal what D applied of the
# stream before it is refused for now (NOT_DURABLE); a group commit takes ms.
RESUME_WAIT_S = 5.0


class DurableWatermark:
    """D's durable watermark (``state.durable_cseq``, read by ``read``) as
    something to wait on; ``read`` None when D's brokers keep no journal,
    and every applied cseq counts as covered."""

    def __init__(self, read: Callable[[], int] | None) -> None:
        self._read = read
        self._changed = trio.Event()

    @property
    def journaled(self) -> bool:
        """D's brokers keep journals: acks wait for them."""
        return self._read is not None

    def covers(self, cseq: int) -> bool:
        """Whatever D applied up to ``cseq`` is on a D broker's disk."""
        return self._read is None or self._read() >= cseq

    def advanced(self) -> None:
        """The watermark may have moved (a ``Durable`` was applied, or a
        snapshot replaced the state): every waiter looks again."""
        self._changed.set()
        self._changed = trio.Event()

    def resume_covered(self, state: SiteState, origin: str) -> bool:
        """What the site applied of ``origin``'s stream is on a D broker's disk."""
        o = state.origins.get(origin)
        return o is None or self.covers(o.last_cseq)

    def resume_refusal(self, state: SiteState, site: str, origin: str) -> str | None:
        """Why a WELCOME may not name what ``site`` applied of ``origin``'s
        stream yet, or None."""
        if self.resume_covered(state, origin):
            return None
        return (
            f"{site} applied {origin}'s stream up to its cseq {state.origins[origin].last_cseq}, "
            f"but its brokers' journals hold only up to cseq {state.durable_cseq} "
            f"(a stopped broker or a slow disk?); the link waits for them, since "
            f"{origin} drops from its spool what it is told {site} has"
        )

    async def wait_resume(self, state: Callable[[], SiteState], origin: str) -> None:
        """Wait, up to :data:`RESUME_WAIT_S`, until what the site (``state()``,
        re-read: a snapshot replaces it) applied of ``origin``'s stream is on
        a D broker's disk."""
        with trio.move_on_after(RESUME_WAIT_S):
            while not self.resume_covered(state(), origin):
                await self.next_change.wait()

    @property
    def next_change(self) -> trio.Event:
        """The event the next :meth:`advanced` sets: take it before looking
        at the watermark, then wait on it, and no change in between is missed."""
        return self._changed


class AckGate:
    """One link connection's acks, held until D's durable watermark covers
    the events they ack.  ``ack(seq)`` acks every event up to ``seq``; it is
    called in seq order, at once from :meth:`applied` when nothing is held
    and the watermark already covers, else from :meth:`serve`."""

    def __init__(self, watermark: DurableWatermark, ack: Callable[[int], None]) -> None:
        self._watermark = watermark
        self._ack = ack
        # (link seq, the D cseq at which D's bus applied it), in seq order
        self._held: deque[tuple[int, int]] = deque()
        self._arrived = trio.Event()

    @property
    def held(self) -> int:
        """Applied seqs (each the last of a batch) waiting for D's disk."""
        return len(self._held)

    def applied(self, seq: int, cseq: int) -> None:
        """D's bus applied every event up to ``seq``, the last at D cseq
        ``cseq``: ack it once that is durable."""
        if not self._held and self._watermark.covers(cseq):
            self._ack(seq)
            return
        self._held.append((seq, cseq))
        self._arrived.set()

    async def serve(self) -> NoReturn:
        """Release held acks as the watermark covers them; never returns."""
        while True:
            if not self._held:
                self._arrived = trio.Event()
                await self._arrived.wait()
            advanced = self._watermark.next_change
            self._release()
            if self._held:
                await advanced.wait()

    def _release(self) -> None:
        """One ack for every held seq the watermark covers now."""
        last = None
        while self._held and self._watermark.covers(self._held[0][1]):
            last = self._held.popleft()[0]
        if last is not None:
            self._ack(last)
