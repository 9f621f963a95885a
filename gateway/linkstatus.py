"""What the egress and the ingress tell about their link: plain, mutable records
that they update and that the sidecar's ``statistics()`` reads.

The link's counters (bytes, batches, events) come from the sans-IO link
machines of the open connections; :class:`EndedLinks` keeps the totals of the
connections that ended, so the exported counters never go back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class ResyncProgress:
    """The resync this sidecar sends (egress) or receives (ingress)."""

    active: bool = False
    total: int = 0  # resyncs started
    chunks: int = 0  # chunks of the running resync made so far (egress)
    chunks_done: int = 0  # egress: acked by D; ingress: staged on D's bus
    bytes_total: int = 0
    messages: int = 0  # messages in the last snapshot sent
    messages_done: int = 0  # of those, encoded and sent so far (egress)
    cut: int = 0  # the running resync's cut
    # A failback by delta (egress): messages of the last snapshot the peer
    # held and so were not sent, and what their Enqueues would have taken.
    messages_kept: int = 0
    bytes_kept: int = 0

    def begin(self, *, chunks: int, cut: int = 0) -> None:
        self.total += 1
        self.active = True
        self.chunks = chunks
        self.chunks_done = 0
        self.messages_done = 0
        self.messages_kept = self.bytes_kept = 0
        self.cut = cut

    @property
    def progress_ratio(self) -> float:
        """Messages sent of the snapshot's (egress; chunks are made as they
        go, so their total is known only at the end); 0 where unknown."""
        return self.messages_done / self.messages if self.messages else 0.0


@dataclass(slots=True)
class LinkStatus:
    """The link as an operator sees it: state, peer, the last error."""

    state: str = "down"  # up | down | connecting | refused | minority
    peer: str = ""
    last_error: str = ""
    reconnects: int = 0
    rtt: float | None = None
    ended: Counter[str] = field(default_factory=Counter)  # counters of ended connections
    # Connections refused for TLS reasons, by reason: "handshake" (the TLS
    # handshake failed) or "peer_name" (a certificate name not pinned).
    tls_refused: Counter[str] = field(default_factory=Counter)
    resync: ResyncProgress = field(default_factory=ResyncProgress)
