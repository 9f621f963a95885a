"""What survives a whole-site restart: durable queues, exchanges and bindings,
and persistent messages (docs/broker.md, "Durability").

Theory of operation
-------------------
As in Qpid, a message is *persistent* when its AMQP header says ``durable``
(the reserved property :data:`protocol.cluster.DURABLE_PROPERTY`) and it sits
on a *durable* queue (argument ``durable`` true).  ``qpid.persist_last_node``
makes every message of its queue persistent and the queue durable: Qpid
persists a queue's transient messages once its cluster is down to the last
node, a moment a site cannot foresee at publish time, so drgate keeps them
always, which keeps at least what Qpid keeps.  An exchange is durable when
declared so, or predeclared; a binding when its exchange and queue are.

Everything else is *transient*: a node's journal holds the commands that made
it but not their message bodies (:func:`for_journal`, and a checkpoint's
snapshot with ``transient_bodies=False``), so the replay reproduces every
position and cseq, and a whole-site recovery then drops it
(:func:`drop_transient`) at the same stream point on every member, and
records itself in the state (:func:`take_recovery`).

Message bodies are kept in the journal, transient or not, for a queue with a
byte limit (``qpid.max_size``): its refusals count bytes, and the replay must
refuse what the live node refused.

*At the DR site.*  A replica queue is the primary's: P still holds it, and
the transient messages a ``full`` replica mirrors, after D lost power, and
goes on sending to it.  So D's journal keeps every body of a ``full``
replica, and :func:`drop_transient` never drops a replica queue (any mode),
a message of a ``full`` replica, nor a replica exchange.  What D's own
consumers work on, the messages of an ``enqueue`` replica, is D's: its
transient ones go like any transient message (D is a broker that lost
power).

Pure functions of the state, like the rest of :mod:`cluster.state`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cluster.state.effects import Released
from cluster.state.merge import read_only_origin
from cluster.state.model import Exchange, Queue, Recovery, SiteState
from cluster.state.queues import forget_hold, forget_queue, forget_reports
from cluster.state.replica import replica_of
from cluster.state.sessions import site_restarted
from cluster.state.views import route
from protocol import cluster as pc
from protocol.modes import DURABLE_ARG, PERSIST_LAST_NODE_ARG, Mode, flag_value
from protocol.values import ValueMap

__all__ = [
    "TransientDropped",
    "drop_transient",
    "durable_header",
    "exchange_durable",
    "for_journal",
    "keeps_body",
    "mark_possibly_delivered",
    "persistent",
    "publish_persistent",
    "queue_durable",
    "take_recovery",
]


def durable_header(properties: ValueMap | None) -> bool:
    """The message's AMQP header said ``durable``."""
    return bool(properties) and properties.get(pc.DURABLE_PROPERTY) is True  # type: ignore[union-attr]


def _persists_all(q: Queue) -> bool:
    return flag_value(q.args.get(PERSIST_LAST_NODE_ARG)) is True


def queue_durable(q: Queue) -> bool:
    """The queue survives a whole-site restart."""
    return flag_value(q.args.get(DURABLE_ARG)) is True or _persists_all(q)


def exchange_durable(x: Exchange) -> bool:
    """The exchange survives a whole-site restart (predeclared ones always)."""
    return x.predeclared or flag_value(x.args.get(DURABLE_ARG)) is True


def persistent(q: Queue, properties: ValueMap | None) -> bool:
    """A message with ``properties`` on ``q`` survives a whole-site restart."""
    return queue_durable(q) and (_persists_all(q) or durable_header(properties))


def publish_persistent(
    state: SiteState, queues: tuple[str, ...], properties: ValueMap | None
) -> bool:
    """A publish routed to ``queues`` made a message that survives a
    whole-site restart (on one of them at least)."""
    return any(
        (q := state.queues.get(name)) is not None and persistent(q, properties) for name in queues
    )


def _full_replica(q: Queue) -> bool:
    return q.replica is not None and q.replica.mode == Mode.FULL


def keeps_body(q: Queue | None, properties: ValueMap | None) -> bool:
    """A node's journal (and checkpoint) holds the body of a message with
    ``properties`` on ``q``."""
    return q is not None and (
        q.max_size is not None or _full_replica(q) or persistent(q, properties)
    )


def for_journal(state: SiteState, cmd: pc.Command) -> pc.Command:
    """``cmd`` as a node journals it, ``state`` being the state it made: the
    body of a message that is not persistent on any queue it reached is
    elided (see the module docstring)."""
    if isinstance(cmd, pc.Publish):
        if not cmd.body:
            return cmd
        targets = route(state, cmd.exchange, cmd.routing_key) or ()
        if any(keeps_body(state.queues.get(name), cmd.properties) for name in targets):
            return cmd
        return dataclasses.replace(cmd, body=b"")
    if isinstance(cmd, pc.Replicated):
        inner = tuple(_replicated_for_journal(state, cmd.origin_cluster, c) for c in cmd.commands)
        if all(a is b for a, b in zip(inner, cmd.commands, strict=True)):
            return cmd
        return dataclasses.replace(cmd, commands=inner)
    return cmd


def _replicated_for_journal(state: SiteState, origin: str, cmd: pc.Command) -> pc.Command:
    if not isinstance(cmd, pc.Enqueue) or not cmd.body:
        return cmd
    if keeps_body(replica_of(state, origin, cmd.queue), cmd.properties):
        return cmd
    return dataclasses.replace(cmd, body=b"")


@dataclass(frozen=True, slots=True)
class TransientDropped:
    """What :func:`drop_transient` removed: transient messages per queue that
    stayed, and the non-durable queues and exchanges (with everything on them);
    after :func:`take_recovery`, also the messages per queue that consumers
    of the old site held and that went back to their queues (``released``)."""

    messages: dict[str, int]
    queues: tuple[str, ...]
    exchanges: tuple[str, ...]
    released: dict[str, int] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.messages or self.queues or self.exchanges)

    def touched_queues(self) -> tuple[str, ...]:
        """Every queue that lost something (dropped, or lost messages)."""
        return (*self.queues, *self.messages)


def take_recovery(state: SiteState) -> TransientDropped:
    """The site continues from ``state``, a broker journal's, at a whole-site
    recovery: drop what does not survive the restart (:func:`drop_transient`),
    end what the restart ended (every session of the old bus, what it held
    back in its queue, and every member's readiness) and record the
    recovery in the state (:class:`Recovery`), at the same stream point on
    every member.  Every message that stays counts one delivery that may
    have happened (:func:`mark_possibly_delivered`).

    No member of the old bus is left to leave a view, so nothing else closes
    those sessions: their messages would stay acquired, in the depth and
    never delivered again."""
    dropped = drop_transient(state)
    mark_possibly_delivered(state)
    for effect in site_restarted(state):
        if isinstance(effect, Released):
            dropped.released[effect.queue] = dropped.released.get(effect.queue, 0) + len(
                effect.positions
            )
    state.recoveries.append(Recovery(len(state.recoveries) + 1, state.cseq, bool(dropped)))
    return dropped


def mark_possibly_delivered(state: SiteState) -> None:
    """Raise the delivery count of every available message a consumer could
    have taken (not in a read-only ``full`` replica): a journal holds what
    its node applied up to its last commit, and a site that lost power may
    have sent messages after it, acquired by commands no disk kept.  Their
    next delivery must say it may be a duplicate (AMQP's delivery count); a
    message never sent comes marked too, which only costs the consumer a
    check.  The acquired ones count theirs when :func:`site_restarted`
    releases them."""
    for q in state.queues.values():
        if read_only_origin(state, q) is not None:
            continue
        for pos, msg in q.messages.items():
            if pos not in q.acquired:
                q.messages[pos] = dataclasses.replace(msg, delivery_count=msg.delivery_count + 1)


def drop_transient(state: SiteState) -> TransientDropped:
    """Remove from ``state`` what does not survive a whole-site restart:
    non-durable queues (with their bindings), non-durable exchanges, and the
    transient messages of the queues that stay (acquired or not); never a
    replica queue or exchange, nor a message of a ``full`` replica (module
    docstring).  Deterministic: every member that applies it to the same
    state gets the same state."""
    gone_queues = [q for q in state.queues.values() if q.replica is None and not queue_durable(q)]
    for q in gone_queues:
        forget_queue(state, q)
    gone_exchanges = [
        x for x in state.exchanges.values() if not x.replica_origin and not exchange_durable(x)
    ]
    for x in gone_exchanges:
        del state.exchanges[x.name]
        forget_reports(state, x.name)
    messages: dict[str, int] = {}
    for q in state.queues.values():
        if _full_replica(q):
            continue
        transient = [m.pos for m in q.messages.values() if not persistent(q, m.properties)]
        for pos in transient:
            held = q.acquired.get(pos)
            q.remove(pos)
            if held is not None:
                forget_hold(state, held[0], q.name, pos)
        if transient:
            q.rebuild_available()
            messages[q.name] = len(transient)
    return TransientDropped(
        messages, tuple(q.name for q in gone_queues), tuple(x.name for x in gone_exchanges)
    )
