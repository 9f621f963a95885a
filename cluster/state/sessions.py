"""Sessions ending: a consumer's messages going back to their queue
(:func:`release`, also for a client's ``released`` and ``modified``
outcomes), every session of members that left the view
(:func:`members_left`) or of a whole site that restarted
(:func:`site_restarted`).  Pure functions of the state, like the rest of
:mod:`cluster.state`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import replace

from cluster.state.demand import drop_session, serve
from cluster.state.effects import Effects, Message, Released, Sender
from cluster.state.model import TEMPORARY_ARG, Queue, Session, SiteState, session_owner
from cluster.state.queues import delete_queue
from protocol.amqpsections import merge_annotations_untrusted
from protocol.cluster import Modify
from protocol.errors import RemoteProtocolError

__all__ = ["close_session", "members_left", "release", "site_restarted"]


def members_left(state: SiteState, members: Iterable[Sender]) -> Effects:
    """A view change removed ``members``: close every session they owned
    (releasing what those sessions had acquired, ``reason="member_left"``)
    and forget their readiness.  Call it at the point of the stream where the
    view change was delivered; it takes no cseq."""
    gone = {(m.node, m.pid) for m in members}
    eff: Effects = []
    for sid in [s for s in state.sessions if session_owner(s) in gone]:
        close_session(state, state.sessions.pop(sid), "member_left", eff)
    for key in [k for k in state.ready if k in gone]:
        del state.ready[key]
    if state.demand:
        serve(state, eff)  # what they held goes to the consumers waiting
    return eff


def site_restarted(state: SiteState) -> Effects:
    """The whole site restarted (a recovery from a journal): every session
    ended with its connection, so close them all (releasing what they had
    acquired, ``reason="site_restart"``) and forget every member's readiness.
    Takes no cseq."""
    eff: Effects = []
    for sid in list(state.sessions):
        close_session(state, state.sessions.pop(sid), "site_restart", eff)
    state.ready.clear()
    return eff


def release(
    state: SiteState,
    q: Queue,
    s: Session,
    positions: Sequence[int],
    redelivered: bool,
    reason: str,
    eff: Effects,
    modify: Modify | None = None,
) -> None:
    """``positions`` held by ``s`` go back to ``q`` in their place; with
    ``redelivered`` each counts a failed delivery (it went out and came back
    unsettled), with ``modify`` the consumer's ``modified`` outcome applies."""
    held = s.acquired.get(q.name)
    done: list[int] = []
    if held is not None:
        for pos in positions:
            if pos in held:
                consumer = held.pop(pos)
                del q.acquired[pos]
                if redelivered or modify is not None:
                    msg = q.messages[pos]
                    q.messages[pos] = _returned(msg, redelivered, modify, s.id, consumer)
                q.make_available(pos)
                done.append(pos)
        if not held:
            del s.acquired[q.name]
    if len(done) != len(positions):
        state.count("stale_settlements", len(positions) - len(done))
    if done:
        eff.append(Released(q.name, s.id, tuple(done), reason))


def _returned(
    msg: Message, failed: bool, modify: Modify | None, session: int, consumer: int
) -> Message:
    """``msg`` as a link hands it back: its delivery count raised when the
    delivery failed, the link added to those it is kept from when the link
    called it undeliverable-here, the outcome's annotations merged."""
    count = msg.delivery_count + (1 if failed else 0)
    refused = msg.refused
    annotations = msg.annotations
    if modify is not None:
        if modify.undeliverable_here and (session, consumer) not in refused:
            refused = (*refused, (session, consumer))
        if modify.annotations:
            # Encoded by the member that sent it; a damaged map changes
            # nothing, on every member alike.
            with contextlib.suppress(RemoteProtocolError):
                annotations = merge_annotations_untrusted(annotations, bytes(modify.annotations))
    return replace(msg, delivery_count=count, refused=refused, annotations=annotations)


def close_session(state: SiteState, s: Session, reason: str, eff: Effects) -> None:
    if state.demand:
        drop_session(state, s.id)  # first: what it releases goes to others
    for qname, held in list(s.acquired.items()):
        q = state.queues.get(qname)
        if q is not None:
            release(state, q, s, list(held), True, reason, eff)
    s.acquired.clear()
    # Its temporary queues (dynamic nodes) go with it.  A scan of the
    # queues: sessions close once per connection, not per message.
    owner = f"{s.id:#x}"
    for q in [q for q in state.queues.values() if q.args.get(TEMPORARY_ARG) == owner]:
        delete_queue(state, q, eff)
