"""What D's ingress lets onto D's bus from an accepted link (docs/security.md).

Theory of operation
-------------------
A link peer that completed the handshake is trusted with one thing only: the
stream of the origin its HELLO named.  Every event it sends must hold
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

Admission reads the frame's index and the ``Replicated``'s key and meta
(:func:`protocol.cluster.decode_head_untrusted`) and checks that its tail is
a frame of as many commands as it has modes, none of them ``Replicated``
(the index only): it builds no inner command, and the event's bytes go to
D's bus as they came (:meth:`cluster.member.SiteMember.submit_frames_and_wait`).
An inner command whose fields do not decode is refused by every member of
D alike when it applies the bus frame, so D's watermark does not reach the
event and the ingress acks nothing past it (the link restarts).

Pure: the ingress calls :func:`admit_event` per event and sends the error
back as for any other refusal.
"""

from __future__ import annotations

from protocol import cluster as pc
from protocol import link
from protocol.errors import RemoteProtocolError


def admit_event(hello: link.Hello, event: link.LinkEvent) -> bytes:
    """The bus frame ``event`` carries (its payload), if D admits it; else
    :class:`RemoteProtocolError` (code ``FORBIDDEN``, or ``MALFORMED`` for
    bytes that are not a bus frame)."""
    payload = event.payload
    try:
        refs = pc.scan_frame_untrusted(payload)
    except RemoteProtocolError as exc:
        raise _malformed(event, exc) from exc
    if len(refs) != 1 or refs[0][0] != pc.Kind.REPLICATED:
        kinds = ", ".join(pc.Kind(ref[0]).name for ref in refs) or "nothing"
        raise _forbidden(
            f"event {event.seq} holds {kinds}; a link peer may send only one REPLICATED "
            "command per event, and never a command for D's own bus"
        )
    origin = refs[0][1]
    try:
        meta, inner = pc.decode_head_untrusted(payload, refs[0])
        inner_refs = pc.scan_frame_untrusted(inner)
    except RemoteProtocolError as exc:
        raise _malformed(event, exc) from exc
    claimed = (origin, meta["incarnation"], meta["epoch"])
    accepted = (hello.origin_cluster, hello.incarnation, hello.epoch)
    if claimed != accepted:
        raise _forbidden(
            f"event {event.seq} is a command of origin {origin} incarnation "
            f"{meta['incarnation']} epoch {meta['epoch']}; this link was accepted for "
            f"{hello.origin_cluster} incarnation {hello.incarnation} epoch {hello.epoch}"
        )
    if meta["origin_cseq"] != event.seq:
        raise _forbidden(
            f"event {event.seq} claims origin position {meta['origin_cseq']}; "
            "a replicated command's position is its event's"
        )
    if len(inner_refs) != len(meta["modes"]) or any(
        ref[0] == pc.Kind.REPLICATED for ref in inner_refs
    ):
        raise _malformed(
            event,
            f"{len(inner_refs)} inner commands for {len(meta['modes'])} modes, "
            "or a nested REPLICATED",
        )
    return payload


def _malformed(event: link.LinkEvent, why: object) -> RemoteProtocolError:
    return link.remote_error(
        link.LinkErrorCode.MALFORMED, f"event {event.seq} is not a bus frame: {why}"
    )


def _forbidden(text: str) -> RemoteProtocolError:
    return link.remote_error(link.LinkErrorCode.FORBIDDEN, text)
