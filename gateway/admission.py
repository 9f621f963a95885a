"""What D's ingress lets onto D's bus from an accepted link (docs/security.md).

Theory of operation
-------------------
A link peer that completed the handshake is trusted with one thing only: the
stream of the origin its HELLO named.  Every event it sends must decode to
exactly one ``Replicated`` command of that origin, incarnation and epoch,
whose ``origin_cseq`` is the event's own link position.  Anything else (a
raw ``QueueDelete``, ``Promote``, ``AcceptIncarnation``, ``RulesSwitch`` or
``AckWatermark``, a command of another origin, epoch or incarnation, one
claiming a position other than its event's) is never multicast: the link is
closed with ``FORBIDDEN``, naming the peer and the command, and counted.
Resync pieces need no such check: the ingress itself builds the
``ResyncStage`` and ``ResyncCommit`` commands from the HELLO and the
RESYNC_BEGIN the receiver checked (its epoch is the connection's), and the
state machine stages only declares, bindings and enqueues from them.

Pure: the ingress calls :func:`admit_event` per event and sends the error
back as for any other refusal.
"""

from __future__ import annotations

from protocol import cluster as pc
from protocol import link
from protocol.errors import RemoteProtocolError


def admit_event(hello: link.Hello, event: link.LinkEvent) -> pc.Replicated:
    """The ``Replicated`` command ``event`` carries, if D admits it; else
    :class:`RemoteProtocolError` (code ``FORBIDDEN``, or ``MALFORMED`` for
    bytes that are not a bus frame)."""
    try:
        commands = pc.decode_frame_untrusted(event.payload)
    except RemoteProtocolError as exc:
        raise link.remote_error(
            link.LinkErrorCode.MALFORMED, f"event {event.seq} is not a bus frame: {exc}"
        ) from exc
    if len(commands) != 1 or not isinstance(commands[0], pc.Replicated):
        kinds = ", ".join(type(c).__name__ for c in commands) or "nothing"
        raise _forbidden(
            f"event {event.seq} holds {kinds}; a link peer may send only one Replicated "
            "command per event, and never a command for D's own bus"
        )
    cmd = commands[0]
    claimed = (cmd.origin_cluster, cmd.incarnation, cmd.epoch)
    accepted = (hello.origin_cluster, hello.incarnation, hello.epoch)
    if claimed != accepted:
        raise _forbidden(
            f"event {event.seq} is a command of origin {cmd.origin_cluster} incarnation "
            f"{cmd.incarnation} epoch {cmd.epoch}; this link was accepted for "
            f"{hello.origin_cluster} incarnation {hello.incarnation} epoch {hello.epoch}"
        )
    if cmd.origin_cseq != event.seq:
        raise _forbidden(
            f"event {event.seq} claims origin position {cmd.origin_cseq}; "
            "a replicated command's position is its event's"
        )
    return cmd


def _forbidden(text: str) -> RemoteProtocolError:
    return link.remote_error(link.LinkErrorCode.FORBIDDEN, text)
