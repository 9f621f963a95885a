"""The WAN link between site P's egress and site D's ingress (docs/architecture.md, section 9).

Theory of operation
-------------------
A link connection carries one origin's replication stream over TCP (TLS
outside tests).  The egress side runs a :class:`LinkSender`, the ingress side
a :class:`LinkReceiver`; both are sans-IO state machines (bytes in, events
out, time passed in as float seconds) that the trio code in ``gateway/``
drives.  The sender opens with HELLO; the receiver answers WELCOME with the
highest seq its site already applied, and the sender streams only events
above it, in BATCH frames bounded by a window of unacked bytes.  The receiver
acks cumulatively once the site applied what it handed up; the sender's
caller trims its spool by those acks.  A connection that breaks is simply
dropped: the next one starts with a fresh pair and resumes from the new
WELCOME, and duplicates are dropped by seq.  Every event carries the seq of
the previous forwarded event (``prev_seq``), so the receiver refuses a stream
with a hole in it (``GAP``) instead of applying past it.

``frames`` holds the wire format (see docs/protocol.md), ``events`` the
dataclasses exchanged with the layer above, ``sender``/``receiver`` the two
machines, ``machine`` the transition-table helper they share.
"""

from protocol.link.events import (
    NEED_DATA,
    Acked,
    ConnectionClosed,
    EventsReceived,
    Heartbeat,
    LinkEvent,
    NeedData,
    PeerError,
    PongReceived,
    Stalled,
)
from protocol.link.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    LINK_MINOR,
    LINK_MINOR_OLDEST,
    LINK_VERSION,
    Codec,
    FrameType,
    Hello,
    LinkErrorCode,
    ResyncBegin,
    ResyncChunk,
    ResyncEnd,
    Welcome,
    remote_error,
)
from protocol.link.receiver import LinkReceiver, ReceiverConfig, ReceiverState, ReceiverStatistics
from protocol.link.sender import LinkSender, SenderConfig, SenderState, SenderStatistics

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "LINK_MINOR",
    "LINK_MINOR_OLDEST",
    "LINK_VERSION",
    "NEED_DATA",
    "Acked",
    "Codec",
    "ConnectionClosed",
    "EventsReceived",
    "FrameType",
    "Heartbeat",
    "Hello",
    "LinkErrorCode",
    "LinkEvent",
    "LinkReceiver",
    "LinkSender",
    "NeedData",
    "PeerError",
    "PongReceived",
    "ReceiverConfig",
    "ReceiverState",
    "ReceiverStatistics",
    "ResyncBegin",
    "ResyncChunk",
    "ResyncEnd",
    "SenderConfig",
    "SenderState",
    "SenderStatistics",
    "Stalled",
    "Welcome",
    "remote_error",
]
