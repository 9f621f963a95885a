"""Read-only views of a site's state for the node, the admin tool and the tap.

Views return fresh immutable values (tuples, frozen dataclasses, copies of
argument maps): callers cannot change the state through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.state.effects import Message
from cluster.state.machine import route as _route
from cluster.state.merge import read_only_origin
from cluster.state.model import SiteState
from protocol.cluster import ExchangeType
from protocol.modes import Mode, Role
from protocol.values import Value


@dataclass(frozen=True, slots=True)
class QueueInfo:
    name: str
    depth: int  # messages on the queue, acquired ones included
    acquired: int
    bytes: int  # total body bytes
    args: dict[str, Value]
    replica_origin: str | None  # the site it replicates, None for a local queue
    replica_mode: Mode | None
    high_pos: int  # highest origin pos received (replicas), 0 otherwise
    writable: bool  # False for a full replica while replication is active (R3)


@dataclass(frozen=True, slots=True)
class ExchangeInfo:
    name: str
    type: ExchangeType
    args: dict[str, Value]
    predeclared: bool
    replica_origin: str | None
    bindings: tuple[tuple[str, str], ...]  # (queue, binding key), binding order


@dataclass(frozen=True, slots=True)
class OriginInfo:
    """What this site knows of a site replicating into it (R1, R7, RPO)."""

    name: str
    incarnation: int
    applied: dict[int, int]  # incarnation -> highest origin cseq applied
    epoch: int
    promoted: bool
    last_time_us: int  # origin time of the last applied command
    last_cseq: int  # this site's cseq when it was applied
    refused_incarnation: int


def _queue_info(state: SiteState, name: str) -> QueueInfo:
    q = state.queues[name]
    r = q.replica
    return QueueInfo(
        name,
        q.depth,
        len(q.acquired),
        q.bytes,
        dict(q.args),
        r.origin if r else None,
        r.mode if r else None,
        r.high_pos if r else 0,
        read_only_origin(state, q) is None,
    )


def list_queues(state: SiteState) -> list[QueueInfo]:
    """Every queue, in declaration order."""
    return [_queue_info(state, name) for name in state.queues]


def queue_info(state: SiteState, queue: str) -> QueueInfo | None:
    return _queue_info(state, queue) if queue in state.queues else None


def queue_args(state: SiteState, queue: str) -> dict[str, Value] | None:
    """The queue's arguments as declared (``qpid.replicate``,
    ``qpid.queue_event_generation``... stored as given); None if no queue."""
    q = state.queues.get(queue)
    return None if q is None else dict(q.args)


def replica_mode(state: SiteState, queue: str) -> Mode | None:
    """The mode a queue is replicated *into this site* with; None for a local
    queue or no queue."""
    q = state.queues.get(queue)
    return None if q is None or q.replica is None else q.replica.mode


def messages(state: SiteState, queue: str) -> tuple[Message, ...]:
    """The messages of a queue in FIFO order (empty if no queue)."""
    q = state.queues.get(queue)
    return () if q is None else tuple(q.messages.values())


def list_exchanges(state: SiteState) -> list[ExchangeInfo]:
    return [
        ExchangeInfo(
            ex.name,
            ex.type,
            dict(ex.args),
            ex.predeclared,
            ex.replica_origin or None,
            tuple(ex.bindings),
        )
        for ex in state.exchanges.values()
    ]


def route(state: SiteState, exchange: str, routing_key: str) -> list[str]:
    """Queue names a publish would reach (binding order, no duplicates);
    empty for an unknown exchange."""
    return _route(state, exchange, routing_key) or []


def origin_info(state: SiteState, origin: str) -> OriginInfo | None:
    o = state.origins.get(origin)
    if o is None:
        return None
    return OriginInfo(
        o.name,
        o.incarnation,
        dict(o.applied),
        o.epoch,
        o.promoted,
        o.last_time_us,
        o.last_cseq,
        o.refused_incarnation,
    )


def applied(state: SiteState, origin: str, incarnation: int) -> int:
    """Highest origin cseq of ``origin``'s ``incarnation`` applied here (R1):
    the resume point the ingress tells the egress.  0 if none."""
    o = state.origins.get(origin)
    return 0 if o is None else o.applied.get(incarnation, 0)


def ready_members(state: SiteState) -> list[tuple[int, int, Role]]:
    """``(node, pid, role)`` of the members that announced MemberReady and are
    still in the view, sorted by (node, pid): the donor is the first broker."""
    return sorted((node, pid, role) for (node, pid), role in state.ready.items())


def session_holdings(state: SiteState, session: int) -> dict[str, tuple[int, ...]]:
    """queue -> positions a session holds (acquired, not settled)."""
    s = state.sessions.get(session)
    if s is None:
        return {}
    return {q: tuple(held) for q, held in s.acquired.items()}


def statistics(state: SiteState) -> dict[str, Any]:
    """A snapshot of the counters (merge rules by rule, refusals) and sizes."""
    return {
        "cseq": state.cseq,
        "incarnation": state.incarnation,
        "queues": len(state.queues),
        "exchanges": len(state.exchanges),
        "sessions": len(state.sessions),
        "messages": sum(q.depth for q in state.queues.values()),
        "acquired": sum(len(q.acquired) for q in state.queues.values()),
        "bytes": sum(q.bytes for q in state.queues.values()),
        **state.counters,
    }
