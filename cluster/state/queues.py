"""Removing a queue, its bindings or its available messages: what this
site's own commands and replicated ones share (pure, like the rest of
:mod:`cluster.state`)."""

from __future__ import annotations

from cluster.state.effects import Effect, QueueDeleted
from cluster.state.model import Queue, SiteState


def forget_reports(state: SiteState, name: str) -> None:
    for key in [k for k in state.reported if k[1] == name]:
        del state.reported[key]


def drop_bindings_to(state: SiteState, queue: str) -> None:
    for ex in state.exchanges.values():
        for key in [k for k in ex.bindings if k[0] == queue]:
            del ex.bindings[key]


def delete_queue(state: SiteState, q: Queue, eff: list[Effect]) -> None:
    forget_queue(state, q)
    eff.append(QueueDeleted(q.name, q.depth))


def forget_queue(state: SiteState, q: Queue) -> None:
    """Remove ``q`` and everything that names it: its waiting consumers'
    demand, its bindings, its reports, and what sessions held on it (every
    way a queue goes, a delete or a whole-site restart, comes here)."""
    del state.queues[q.name]
    state.demand.pop(q.name, None)  # its waiting consumers go with it
    drop_bindings_to(state, q.name)
    forget_reports(state, q.name)
    for pos, (sid, _consumer) in q.acquired.items():
        forget_hold(state, sid, q.name, pos)


def purge_available(q: Queue) -> list[int]:
    acquired = q.acquired
    gone = [pos for pos in q.messages if pos not in acquired]
    for pos in gone:
        msg = q.messages.pop(pos)
        q.bytes -= len(msg.body)
    q.rebuild_available()
    return gone


def forget_hold(state: SiteState, sid: int, queue: str, pos: int) -> None:
    """Session ``sid`` no longer holds message ``pos`` of ``queue`` (it is gone)."""
    s = state.sessions.get(sid)
    if s is None:
        return
    held = s.acquired.get(queue)
    if held is not None:
        held.pop(pos, None)
        if not held:
            del s.acquired[queue]
