"""Events the link state machines take from and hand to the layer above.

Frozen, slotted dataclasses.  The handshake and resync frames (``Hello``,
``Welcome``, ``ResyncBegin``, ``ResyncChunk``, ``ResyncEnd``) are handed up as
the frame objects themselves (see ``protocol.link.frames``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LinkEvent:
    """One replication event, opaque to the link.

    ``seq`` is the origin cseq (>= 1, strictly increasing along the stream, not
    necessarily contiguous); ``time_us`` the origin commit time in microseconds
    since the epoch; ``payload`` the encoded command.  ``prev_seq`` is the
    origin cseq of the previous *forwarded* event of the same incarnation (0
    when there is none), below ``seq``: the proof of continuity the receiver
    checks, since the seqs themselves have holes where commands were filtered.
    It comes from whoever recorded the stream (the spool); 0, the default,
    claims that nothing was forwarded before, which always passes the check.
    """

    seq: int
    time_us: int
    payload: bytes
    prev_seq: int = field(default=0, kw_only=True)


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA = _NeedData.NEED_DATA
"""``next_event()`` returns this when it needs more bytes (or time) to say more."""
NeedData = _NeedData


@dataclass(frozen=True, slots=True)
class EventsReceived:
    """Receiver: new events, in order, every seq above all seqs handed up before,
    each continuous: its ``prev_seq`` at or below what the receiver held
    (resume point, last seq handed up, or resync cut) when it came."""

    events: tuple[LinkEvent, ...]
    duplicates: int = 0
    """Events of the same BATCH dropped because their seq was already handed up."""


@dataclass(frozen=True, slots=True)
class Acked:
    """Sender: the receiver applied every event up to ``seq`` (and ``resync_chunks``
    chunks of the resync in progress).  The caller may trim its spool up to ``seq``."""

    seq: int
    resync_chunks: int = 0


@dataclass(frozen=True, slots=True)
class PongReceived:
    """Sender: a PING came back; ``rtt`` in seconds."""

    rtt: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Receiver: a minor-2 PING's news of the origin: at ``time_us`` (its wall
    clock, µs since the Unix epoch) its last spooled event was ``last_seq``.
    D's recovery point moves with it while the origin is idle."""

    time_us: int
    last_seq: int


@dataclass(frozen=True, slots=True)
class PeerError:
    """The peer sent an ERROR frame and will close the connection."""

    code: int
    text: str
    retriable: bool


@dataclass(frozen=True, slots=True)
class Stalled:
    """No frame from the peer for ``silent_for`` seconds (heartbeat timeout).
    The caller should close the connection and reconnect."""

    silent_for: float


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The peer closed its side (``receive_data(b"")``).  ``clean`` is False when
    the stream stopped in the middle of a frame; those bytes are dropped."""

    clean: bool
    discarded_bytes: int = 0
