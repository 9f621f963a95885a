"""Consumers' standing demand: what an ``Acquire`` asked for and did not get.

Theory of operation
-------------------
A consumer's credit reaches the state as ``Acquire(queue, session, consumer,
count)``.  What the queue holds goes at once, lowest position first; what it
lacks stays in ``Queue.waiting[(session, consumer)]``.  Then every command
that makes a message available on that queue (a publish, a replicated
enqueue, a resync, a release) hands it out as part of its own application:
every member applies the same commands to the same state, so every member
assigns the same message to the same consumer at the same cseq, and the
broker that owns the session sends it on the ``Delivered`` effect.  A
message for a waiting consumer therefore crosses the bus once, where an
acquire sent after it arrived would cross it a second time (docs/state.md,
"Standing demand"; docs/performance.md, eighth round).

Messages go round the waiting consumers of a queue one at a time: the one
served moves to the end of ``waiting`` (insertion order, the same on every
member and after a snapshot).  A message a consumer refused as
undeliverable-here is passed over for it, as by an acquire.

Demand ends with ``Withdraw`` (the broker's consumer closed, drained, or
could not take what was assigned), with its session and with its queue.  A
queue that stops being consumable here (read-only at a DR site, quiesced by a
switchover, waiting for a failback) refuses its waiting consumers when a
message arrives, as it would refuse their next acquire.

``SiteState.demand`` names the queues whose ``waiting`` is not empty, so a
command on a site without waiting consumers costs one truth test.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.state.effects import Delivered, Effects, Enqueued, Reason, Released, refuse
from cluster.state.merge import read_only_origin, read_only_text
from cluster.state.model import Queue, Session, SiteState, session_owner
from cluster.state.switchover import failback_text, failing_back, guard_text, switching

__all__ = ["add", "assign", "drop_queue", "drop_session", "refusal", "serve", "withdraw"]


@dataclass(frozen=True, slots=True)
class _Owner:
    """The member that owns a session (a ``Sender``): a refusal of a
    waiting consumer goes to it, as the refusal of its acquire would."""

    node: int
    pid: int


def refusal(state: SiteState, q: Queue) -> tuple[Reason, str] | None:
    """Why this site's consumers may not take messages of ``q`` now, or None."""
    origin = read_only_origin(state, q)
    if origin is not None:
        return Reason.READ_ONLY, read_only_text(q.name, origin, "be consumed from")
    if failing_back(state, q.name):
        return Reason.SWITCHOVER, failback_text(state, q.name)
    if switching(state, q.name):
        return Reason.SWITCHOVER, guard_text(state, q.name, "be consumed from")
    return None


def assign(q: Queue, s: Session, consumer: int, positions: list[int], eff: Effects) -> None:
    """``positions`` (taken from ``q``'s available ones) go to ``s``'s ``consumer``."""
    held = s.acquired.setdefault(q.name, {})
    for pos in positions:
        q.acquired[pos] = (s.id, consumer)
        held[pos] = consumer
        eff.append(Delivered(q.name, s.id, consumer, q.messages[pos]))


def add(state: SiteState, q: Queue, session: int, consumer: int, count: int) -> None:
    """``count`` more messages for ``session``'s ``consumer`` as they come."""
    key = (session, consumer)
    q.waiting[key] = q.waiting.get(key, 0) + count
    state.demand[q.name] = None


def withdraw(state: SiteState, queue: str, session: int, consumer: int) -> None:
    q = state.queues.get(queue)
    if q is not None and q.waiting.pop((session, consumer), None) is not None and not q.waiting:
        del state.demand[queue]


def drop_session(state: SiteState, session: int) -> None:
    """A closing session's consumers want nothing more."""
    for name in list(state.demand):
        q = state.queues.get(name)
        if q is not None:
            for key in [k for k in q.waiting if k[0] == session]:
                del q.waiting[key]
        if q is None or not q.waiting:
            del state.demand[name]


def drop_queue(state: SiteState, q: Queue) -> None:
    q.waiting.clear()
    state.demand.pop(q.name, None)


def serve(state: SiteState, eff: Effects) -> None:
    """After a command: hand what it made available to the consumers waiting
    on those queues (only called while ``state.demand`` is not empty)."""
    demand = state.demand
    served: list[str] = []
    for effect in eff:
        if (
            isinstance(effect, Enqueued | Released)
            and effect.queue in demand
            and effect.queue not in served
        ):
            served.append(effect.queue)
    for name in served:
        q = state.queues.get(name)
        if q is not None and q.waiting:
            _serve_queue(state, q, eff)


def _serve_queue(state: SiteState, q: Queue, eff: Effects) -> None:
    why = refusal(state, q)
    if why is not None:
        reason, text = why
        for session, _consumer in list(q.waiting):
            owner = _Owner(*session_owner(session))
            refuse(state, eff, owner, reason, q.name, text, session=session)
        drop_queue(state, q)
        return
    waiting = q.waiting
    passed: set[tuple[int, int]] = set()  # nothing available for them
    while waiting and len(passed) < len(waiting) and q.available_count() > 0:
        key = next(k for k in waiting if k not in passed)
        s = state.sessions.get(key[0])
        if s is None:  # closed without its demand: cannot happen, costs nothing
            del waiting[key]
            continue
        positions = q.take(1, key)
        if not positions:
            passed.add(key)
            continue
        assign(q, s, key[1], positions, eff)
        left = waiting.pop(key) - 1
        if left:
            waiting[key] = left  # to the end: the next message goes to the next one
    if not waiting:
        del state.demand[q.name]
