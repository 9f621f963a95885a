"""The deterministic queue state machine: ``apply(state, command) -> effects``.

Theory of operation
-------------------
Every member of a site applies the bus stream, command by command, in the
bus's agreed order, to its own :class:`~cluster.state.model.SiteState`.
:func:`apply` is pure and deterministic: no I/O, no clock, no randomness, no
iteration over unordered collections.  So every member reaches the same state
and returns the same effects for the same command; each member then acts on
the effects that concern its own clients.

``cseq`` is incremented by one for *every* command given to :func:`apply`,
before it is looked at: applied, refused, ignored, duplicate and fenced
commands alike, a ``Replicated`` command counting as one however many inner
commands it carries.  The first command of a site has cseq 1.  View changes
(:func:`members_left`) are not commands and do not take a cseq.

Local commands (from this site's clients and tools) are dispatched by type
through ``_LOCAL``; a command may be refused (a :class:`Refused` effect and a
counter, no change to the state).  ``Replicated`` and ``ResyncApply`` commands
go through the merge rules R1-R7 (docs/state.md): their admission, R3 and R7
are decided in :mod:`cluster.state.merge`, their inner commands go through
``_REMOTE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from cluster.state.effects import (
    CONDITIONS,
    Conflict,
    Delivered,
    Dequeued,
    Effect,
    Enqueued,
    GenesisApplied,
    IncarnationAccepted,
    Message,
    Outcome,
    Promoted,
    QueueDeclared,
    QueueDeleted,
    Reason,
    Refused,
    Released,
    ReplicatedOutcome,
    Sender,
    Settled,
)
from cluster.state.merge import admit, origin_record, read_only_origin, record_applied
from cluster.state.model import (
    Exchange,
    Queue,
    Replica,
    Session,
    SiteState,
    describe_args,
    session_owner,
)
from protocol.cluster import (
    Accept,
    AcceptIncarnation,
    AckWatermark,
    Acquire,
    Bind,
    Command,
    Dequeue,
    Enqueue,
    ExchangeDeclare,
    ExchangeDelete,
    Genesis,
    MemberReady,
    Promote,
    Publish,
    Purge,
    QueueDeclare,
    QueueDelete,
    Release,
    Replicated,
    ResyncApply,
    RulesSwitch,
    SessionClose,
    SessionOpen,
    StateChunk,
    Unbind,
    iter_snapshot_untrusted,
)
from protocol.errors import DrgateError
from protocol.modes import Mode, check_declare_args

Effects = list[Effect]


def apply(state: SiteState, command: Command, *, sender: Sender | None = None) -> Effects:
    """Apply one command delivered by the bus; return its effects.

    ``sender`` is the bus member that multicast the command (anything with
    ``node`` and ``pid``); it is copied into ``Settled`` and ``Refused`` so the
    publishing member can find its own.  Never raises for a command a client
    could send: refusals are effects.  Raises ``TypeError`` for an object that
    is not a bus command (a programming error).
    """
    state.cseq += 1
    eff: Effects = []
    handler = _LOCAL.get(type(command))
    if handler is None:
        raise TypeError(f"not a bus command: {command!r}")
    handler(state, command, sender, eff)
    return eff


def apply_all(
    state: SiteState, commands: Iterable[Command], *, sender: Sender | None = None
) -> Effects:
    """Apply the commands of one frame in order; the concatenated effects."""
    eff: Effects = []
    for command in commands:
        eff.extend(apply(state, command, sender=sender))
    return eff


def members_left(state: SiteState, members: Iterable[Sender]) -> Effects:
    """A view change removed ``members``: close every session they owned
    (releasing what those sessions had acquired, ``reason="member_left"``)
    and forget their readiness.  Call it at the point of the stream where the
    view change was delivered; it takes no cseq."""
    gone = {(m.node, m.pid) for m in members}
    eff: Effects = []
    for sid in [s for s in state.sessions if session_owner(s) in gone]:
        _close_session(state, state.sessions.pop(sid), "member_left", eff)
    for key in [k for k in state.ready if k in gone]:
        del state.ready[key]
    return eff


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _refuse(
    state: SiteState,
    eff: Effects,
    sender: Sender | None,
    reason: Reason,
    name: str,
    description: str,
    *,
    ref: int = 0,
    session: int = 0,
) -> None:
    state.count("refused")
    if reason is Reason.READ_ONLY:
        state.count("r3_refused")
    elif reason is Reason.MAX_DEPTH:
        state.count("max_depth_refused")
    eff.append(Refused(sender, ref, session, name, reason, CONDITIONS[reason], description))


def _read_only_text(queue: str, origin: str, what: str) -> str:
    return (
        f"queue {queue!r} is a read-only replica of site {origin!r} (mode full) while "
        f"replication is active, so it cannot {what}; to use it here, promote this site "
        f"(drgate promote {origin})"
    )


def _forget_reports(state: SiteState, name: str) -> None:
    for key in [k for k in state.reported if k[1] == name]:
        del state.reported[key]


def _drop_bindings_to(state: SiteState, queue: str) -> None:
    for ex in state.exchanges.values():
        for key in [k for k in ex.bindings if k[0] == queue]:
            del ex.bindings[key]


def _delete_queue(state: SiteState, q: Queue, eff: Effects) -> None:
    del state.queues[q.name]
    _drop_bindings_to(state, q.name)
    _forget_reports(state, q.name)
    # Sessions forget what they held on it.
    for pos, (sid, _consumer) in q.acquired.items():
        s = state.sessions.get(sid)
        if s is not None:
            held = s.acquired.get(q.name)
            if held is not None:
                held.pop(pos, None)
                if not held:
                    del s.acquired[q.name]
    eff.append(QueueDeleted(q.name, q.depth))


def _release(
    state: SiteState,
    q: Queue,
    s: Session,
    positions: Sequence[int],
    redelivered: bool,
    reason: str,
    eff: Effects,
) -> None:
    held = s.acquired.get(q.name)
    done: list[int] = []
    if held is not None:
        for pos in positions:
            if pos in held:
                del held[pos]
                del q.acquired[pos]
                if redelivered:
                    msg = q.messages[pos]
                    if not msg.redelivered:
                        q.messages[pos] = replace(msg, redelivered=True)
                q.make_available(pos)
                done.append(pos)
        if not held:
            del s.acquired[q.name]
    if len(done) != len(positions):
        state.count("stale_settlements", len(positions) - len(done))
    if done:
        eff.append(Released(q.name, s.id, tuple(done), reason))


def _close_session(state: SiteState, s: Session, reason: str, eff: Effects) -> None:
    for qname, held in list(s.acquired.items()):
        q = state.queues.get(qname)
        if q is not None:
            _release(state, q, s, list(held), True, reason, eff)
    s.acquired.clear()


# --------------------------------------------------------------------------
# Local commands
# --------------------------------------------------------------------------


def _queue_declare(
    state: SiteState, cmd: QueueDeclare, sender: Sender | None, eff: Effects
) -> None:
    problem = check_declare_args(cmd.args)
    if problem is not None:
        _refuse(
            state,
            eff,
            sender,
            Reason.INVALID_ARGUMENT,
            cmd.queue,
            f"cannot declare queue {cmd.queue!r}: {problem}",
        )
        return
    q = state.queues.get(cmd.queue)
    if q is None:
        q = state.queues[cmd.queue] = Queue(cmd.queue, cmd.args)
        eff.append(QueueDeclared(cmd.queue, True, dict(q.args), None))
        return
    # A re-declare merges the given arguments over the existing ones (so a
    # client that re-declares without arguments does not wipe them).
    merged = {**q.args, **cmd.args}
    if merged != q.args:
        q.args = merged
        q.set_limits()
        eff.append(
            QueueDeclared(cmd.queue, False, dict(merged), q.replica.mode if q.replica else None)
        )


def _writable_queue(
    state: SiteState, name: str, sender: Sender | None, eff: Effects, verb: str, passive: str
) -> Queue | None:
    """The local queue ``name`` for a command that changes it, or None after
    refusing: unknown queue, or a read-only replica (R3)."""
    q = state.queues.get(name)
    if q is None:
        _refuse(
            state, eff, sender, Reason.UNKNOWN_QUEUE, name,
            f"cannot {verb} queue {name!r}: no such queue",
        )  # fmt: skip
        return None
    origin = read_only_origin(state, q)
    if origin is not None:
        _refuse(
            state, eff, sender, Reason.READ_ONLY, name, _read_only_text(q.name, origin, passive)
        )  # fmt: skip
        return None
    return q


def _queue_delete(state: SiteState, cmd: QueueDelete, sender: Sender | None, eff: Effects) -> None:
    q = _writable_queue(state, cmd.queue, sender, eff, "delete", "be deleted")
    if q is None:
        return
    _delete_queue(state, q, eff)


def _exchange_declare(
    state: SiteState, cmd: ExchangeDeclare, sender: Sender | None, eff: Effects
) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None:
        state.exchanges[cmd.exchange] = Exchange(cmd.exchange, cmd.type, cmd.args)
        return
    if ex.type != cmd.type:
        _refuse(
            state,
            eff,
            sender,
            Reason.TYPE_MISMATCH,
            cmd.exchange,
            f"exchange {cmd.exchange!r} exists with type {ex.type.name.lower()}, "
            f"cannot re-declare it as {cmd.type.name.lower()}; delete it first",
        )
        return
    ex.args = {**ex.args, **cmd.args}


def _exchange_delete(
    state: SiteState, cmd: ExchangeDelete, sender: Sender | None, eff: Effects
) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_EXCHANGE,
            cmd.exchange,
            f"cannot delete exchange {cmd.exchange!r}: no such exchange",
        )
        return
    if ex.predeclared:
        _refuse(
            state,
            eff,
            sender,
            Reason.PREDECLARED,
            cmd.exchange,
            f"exchange {cmd.exchange!r} is predeclared and cannot be deleted",
        )
        return
    del state.exchanges[cmd.exchange]
    _forget_reports(state, cmd.exchange)


def _bind_target(
    state: SiteState, exchange: str, queue: str, sender: Sender | None, eff: Effects, what: str
) -> Exchange | None:
    ex = state.exchanges.get(exchange)
    if ex is None:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_EXCHANGE,
            exchange,
            f"cannot {what} queue {queue!r} on exchange {exchange!r}: no such exchange",
        )
        return None
    if exchange == "":
        _refuse(
            state,
            eff,
            sender,
            Reason.PREDECLARED,
            exchange,
            f"cannot {what} queue {queue!r} on the default exchange: it routes by queue name",
        )
        return None
    if queue not in state.queues:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_QUEUE,
            queue,
            f"cannot {what} queue {queue!r} on exchange {exchange!r}: no such queue",
        )
        return None
    return ex


def _bind(state: SiteState, cmd: Bind, sender: Sender | None, eff: Effects) -> None:
    ex = _bind_target(state, cmd.exchange, cmd.queue, sender, eff, "bind")
    if ex is not None:
        ex.bindings[(cmd.queue, cmd.binding_key)] = dict(cmd.args)


def _unbind(state: SiteState, cmd: Unbind, sender: Sender | None, eff: Effects) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_EXCHANGE,
            cmd.exchange,
            f"cannot unbind queue {cmd.queue!r} from exchange {cmd.exchange!r}: no such exchange",
        )
        return
    # Unbinding what is not bound is a no-op, as in Qpid.
    ex.bindings.pop((cmd.queue, cmd.binding_key), None)


def route(state: SiteState, exchange: str, routing_key: str) -> list[str] | None:
    """Names of the queues a publish to ``exchange`` with ``routing_key``
    reaches, without duplicates, in binding order; None if the exchange does
    not exist.  The default exchange ``""`` routes to the queue named by the
    routing key, if it exists."""
    if exchange == "":
        return [routing_key] if routing_key in state.queues else []
    ex = state.exchanges.get(exchange)
    if ex is None:
        return None
    out: dict[str, None] = {}
    for name in ex.route(routing_key):
        out[name] = None
    return list(out)


def _publish(state: SiteState, cmd: Publish, sender: Sender | None, eff: Effects) -> None:
    targets = route(state, cmd.exchange, cmd.routing_key)
    if targets is None:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_EXCHANGE,
            cmd.exchange,
            f"cannot publish to exchange {cmd.exchange!r}: no such exchange",
            ref=cmd.ref,
        )
        return
    if not targets and cmd.exchange == "":
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_QUEUE,
            cmd.routing_key,
            f"cannot publish to queue {cmd.routing_key!r}: no such queue",
            ref=cmd.ref,
        )
        return
    size = len(cmd.body)
    queues = [state.queues[name] for name in targets]
    # All or nothing: check every target before changing any.
    for q in queues:
        origin = read_only_origin(state, q)
        if origin is not None:
            _refuse(
                state,
                eff,
                sender,
                Reason.READ_ONLY,
                q.name,
                _read_only_text(q.name, origin, "take messages from clients of this site"),
                ref=cmd.ref,
            )
            return
        if (q.max_count is not None and q.depth + 1 > q.max_count) or (
            q.max_size is not None and q.bytes + size > q.max_size
        ):
            limit = (
                f"{q.max_count} messages"
                if q.max_count is not None and q.depth + 1 > q.max_count
                else f"{q.max_size} bytes"
            )
            _refuse(
                state,
                eff,
                sender,
                Reason.MAX_DEPTH,
                q.name,
                f"queue {q.name!r} is full (limit {limit}, policy reject); "
                "the message was not enqueued on any queue",
                ref=cmd.ref,
            )
            return
    body = bytes(cmd.body)
    props = dict(cmd.properties) if cmd.properties else None
    for q in queues:
        pos = q.next_pos
        q.append(Message(pos, body, cmd.message_id, props))
        eff.append(Enqueued(q.name, pos))
    eff.append(Settled(cmd.ref, sender, tuple(targets)))


def _acquire(state: SiteState, cmd: Acquire, sender: Sender | None, eff: Effects) -> None:
    q = state.queues.get(cmd.queue)
    if q is None:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_QUEUE,
            cmd.queue,
            f"cannot consume from queue {cmd.queue!r}: no such queue",
            session=cmd.session,
        )
        return
    s = state.sessions.get(cmd.session)
    if s is None:
        _refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_SESSION,
            cmd.queue,
            f"cannot consume from queue {cmd.queue!r}: session {cmd.session:#x} is not open",
            session=cmd.session,
        )
        return
    origin = read_only_origin(state, q)
    if origin is not None:
        _refuse(
            state,
            eff,
            sender,
            Reason.READ_ONLY,
            q.name,
            _read_only_text(q.name, origin, "be consumed from"),
            session=cmd.session,
        )
        return
    positions = q.take(cmd.count)
    if not positions:
        return
    held = s.acquired.setdefault(q.name, {})
    for pos in positions:
        q.acquired[pos] = (s.id, cmd.consumer)
        held[pos] = cmd.consumer
        eff.append(Delivered(q.name, s.id, cmd.consumer, q.messages[pos]))


def _accept(state: SiteState, cmd: Accept, sender: Sender | None, eff: Effects) -> None:
    q = state.queues.get(cmd.queue)
    s = state.sessions.get(cmd.session)
    if q is None or s is None:
        # The queue was deleted or the session closed meanwhile: nothing to settle.
        state.count("stale_settlements", len(cmd.positions))
        return
    held = s.acquired.get(q.name)
    done: list[int] = []
    if held is not None:
        for pos in cmd.positions:
            if pos in held:
                del held[pos]
                q.remove(pos)
                done.append(pos)
        if not held:
            del s.acquired[q.name]
    if len(done) != len(cmd.positions):
        state.count("stale_settlements", len(cmd.positions) - len(done))
    if done:
        eff.append(Dequeued(q.name, tuple(done), "accept"))


def _release_cmd(state: SiteState, cmd: Release, sender: Sender | None, eff: Effects) -> None:
    q = state.queues.get(cmd.queue)
    s = state.sessions.get(cmd.session)
    if q is None or s is None:
        state.count("stale_settlements", len(cmd.positions))
        return
    _release(state, q, s, cmd.positions, cmd.redelivered, "release", eff)


def _purge_available(q: Queue) -> list[int]:
    acquired = q.acquired
    gone = [pos for pos in q.messages if pos not in acquired]
    for pos in gone:
        msg = q.messages.pop(pos)
        q.bytes -= len(msg.body)
    q.rebuild_available()
    return gone


def _purge(state: SiteState, cmd: Purge, sender: Sender | None, eff: Effects) -> None:
    q = _writable_queue(state, cmd.queue, sender, eff, "purge", "be purged")
    if q is None:
        return
    gone = _purge_available(q)
    if gone:
        eff.append(Dequeued(q.name, tuple(gone), "purge"))


def _session_open(state: SiteState, cmd: SessionOpen, sender: Sender | None, eff: Effects) -> None:
    if sender is not None and session_owner(cmd.session) != (sender.node, sender.pid):
        node, pid = session_owner(cmd.session)
        _refuse(
            state,
            eff,
            sender,
            Reason.NOT_OWNER,
            "",
            f"session {cmd.session:#x} belongs to member {node}.{pid}, "
            f"not to the sender {sender.node}.{sender.pid}",
            session=cmd.session,
        )
        return
    if cmd.session in state.sessions:
        state.count("ignored")
        return
    state.sessions[cmd.session] = Session(cmd.session)


def _session_close(
    state: SiteState, cmd: SessionClose, sender: Sender | None, eff: Effects
) -> None:
    s = state.sessions.pop(cmd.session, None)
    if s is None:
        state.count("ignored")
        return
    _close_session(state, s, "session_close", eff)


def _state_chunk(state: SiteState, cmd: StateChunk, sender: Sender | None, eff: Effects) -> None:
    """State transfer is the node's business; the chunk only takes a cseq."""


def _rules_switch(state: SiteState, cmd: RulesSwitch, sender: Sender | None, eff: Effects) -> None:
    # Kept in the state so a member joining later gets the rules in force.
    state.rules = bytes(cmd.payload)
    state.rules_cseq = state.cseq


def _ack_watermark(
    state: SiteState, cmd: AckWatermark, sender: Sender | None, eff: Effects
) -> None:
    old = state.watermarks.get(cmd.origin_cluster)
    new = (cmd.incarnation, cmd.cseq, cmd.time_us)
    if old is None or old[0] != cmd.incarnation or old[1] < cmd.cseq:
        state.watermarks[cmd.origin_cluster] = new
    else:
        state.count("ignored")


def _member_ready(state: SiteState, cmd: MemberReady, sender: Sender | None, eff: Effects) -> None:
    state.ready[(cmd.node, cmd.pid)] = cmd.role


def _genesis(state: SiteState, cmd: Genesis, sender: Sender | None, eff: Effects) -> None:
    if state.incarnation != 0 or cmd.incarnation == 0:
        state.count("ignored")
        eff.append(GenesisApplied(cmd.cluster, cmd.incarnation, False))
        return
    state.cluster = cmd.cluster
    state.incarnation = cmd.incarnation
    eff.append(GenesisApplied(cmd.cluster, cmd.incarnation, True))


def _bare_replica_command(
    state: SiteState, cmd: Enqueue | Dequeue, sender: Sender | None, eff: Effects
) -> None:
    # Enqueue and Dequeue only mean something inside Replicated (they carry
    # origin positions); on their own they are ignored and counted.
    state.count("ignored")


def _promote(state: SiteState, cmd: Promote, sender: Sender | None, eff: Effects) -> None:
    o = origin_record(state, cmd.origin_cluster)
    if cmd.epoch <= o.epoch:
        state.count("ignored")
        return
    o.epoch = cmd.epoch
    o.promoted = True
    o.promoted_time_us = cmd.time_us
    eff.append(Promoted(cmd.origin_cluster, cmd.epoch))


def _accept_incarnation(
    state: SiteState, cmd: AcceptIncarnation, sender: Sender | None, eff: Effects
) -> None:
    o = origin_record(state, cmd.origin_cluster)
    o.incarnation = cmd.incarnation
    if o.refused_incarnation == cmd.incarnation:
        o.refused_incarnation = 0
    eff.append(IncarnationAccepted(cmd.origin_cluster, cmd.incarnation))


# --------------------------------------------------------------------------
# Replicated commands: the merge rules
# --------------------------------------------------------------------------


def _replicated(state: SiteState, cmd: Replicated, sender: Sender | None, eff: Effects) -> None:
    def outcome(o: Outcome) -> None:
        eff.append(
            ReplicatedOutcome(cmd.origin_cluster, cmd.incarnation, cmd.origin_cseq, cmd.epoch, o)
        )

    refusal = admit(state, cmd.origin_cluster, cmd.incarnation, cmd.origin_cseq, cmd.epoch)
    if refusal is not None:
        outcome(refusal)
        return
    record_applied(
        state,
        cmd.origin_cluster,
        cmd.incarnation,
        cmd.origin_cseq,
        cmd.epoch,
        cmd.origin_time_us,
    )
    for mode, inner in zip(cmd.modes, cmd.commands, strict=False):
        handler = _REMOTE.get(type(inner))
        if handler is None:
            state.count("replicated_unsupported")
            continue
        handler(state, cmd.origin_cluster, mode, inner, eff)
    outcome(Outcome.APPLIED)


def _replica_of(state: SiteState, origin: str, name: str) -> Queue | None:
    q = state.queues.get(name)
    if q is not None and q.replica is not None and q.replica.origin == origin:
        return q
    return None


def _report_conflict(
    state: SiteState, origin: str, name: str, local: str, remote: str, what: str, eff: Effects
) -> None:
    state.count("r6_conflicts")
    if (origin, name) in state.reported:
        return
    state.reported[(origin, name)] = None
    eff.append(
        Conflict(
            "R6",
            origin,
            name,
            local,
            remote,
            f"{what} from site {origin!r} not applied: {name!r} exists here and is not a "
            f"replica of {origin!r} (here: {local}; {origin!r}: {remote}); rename or delete "
            "one of them, then resync",
        )
    )


def _local_queue_text(q: Queue) -> str:
    kind = f"replica of {q.replica.origin!r}" if q.replica else "local queue"
    return f"{kind} {describe_args(q.args)} with {q.depth} messages"


def _r_queue_declare(
    state: SiteState, origin: str, mode: Mode, cmd: QueueDeclare, eff: Effects
) -> None:
    if mode == Mode.NONE:
        state.count("replicated_unsupported")
        return
    q = state.queues.get(cmd.queue)
    if q is None:
        q = state.queues[cmd.queue] = Queue(cmd.queue, cmd.args, Replica(origin, mode))
        eff.append(QueueDeclared(cmd.queue, True, dict(q.args), mode))
        return
    if q.replica is None or q.replica.origin != origin:
        _report_conflict(
            state,
            origin,
            cmd.queue,
            _local_queue_text(q),
            f"queue {describe_args(cmd.args)} replicated as {mode.label}",
            "queue declare",
            eff,
        )
        return
    changed = q.replica.mode != mode or dict(cmd.args) != q.args
    q.replica.mode = mode
    q.args = dict(cmd.args)
    q.set_limits()
    if changed:
        eff.append(QueueDeclared(cmd.queue, False, dict(q.args), mode))


def _r_queue_delete(
    state: SiteState, origin: str, mode: Mode, cmd: QueueDelete, eff: Effects
) -> None:
    q = state.queues.get(cmd.queue)
    if q is None:
        state.count("replicated_missing_queue")
        return
    if q.replica is None or q.replica.origin != origin:
        _report_conflict(
            state, origin, cmd.queue, _local_queue_text(q), "queue deleted", "queue delete", eff
        )
        return
    _delete_queue(state, q, eff)


def _r_exchange_declare(
    state: SiteState, origin: str, mode: Mode, cmd: ExchangeDeclare, eff: Effects
) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None:
        state.exchanges[cmd.exchange] = Exchange(
            cmd.exchange, cmd.type, cmd.args, replica_origin=origin
        )
        return
    if ex.type == cmd.type and (ex.replica_origin == origin or ex.args == dict(cmd.args)):
        # Same origin, or an identical definition (the predeclared exchanges,
        # or the same exchange declared on both sites): nothing to merge.
        if ex.replica_origin == origin:
            ex.args = dict(cmd.args)
        return
    _report_conflict(
        state,
        origin,
        cmd.exchange,
        f"exchange type {ex.type.name.lower()} {describe_args(ex.args)}"
        + (f" replicated from {ex.replica_origin!r}" if ex.replica_origin else ""),
        f"exchange type {cmd.type.name.lower()} {describe_args(cmd.args)}",
        "exchange declare",
        eff,
    )


def _r_exchange_delete(
    state: SiteState, origin: str, mode: Mode, cmd: ExchangeDelete, eff: Effects
) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None:
        state.count("replicated_missing_queue")
        return
    if ex.replica_origin != origin or ex.predeclared:
        _report_conflict(
            state,
            origin,
            cmd.exchange,
            f"exchange type {ex.type.name.lower()} {describe_args(ex.args)}",
            "exchange deleted",
            "exchange delete",
            eff,
        )
        return
    del state.exchanges[cmd.exchange]


def _r_bind(state: SiteState, origin: str, mode: Mode, cmd: Bind, eff: Effects) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None or cmd.exchange == "" or _replica_of(state, origin, cmd.queue) is None:
        state.count("replicated_missing_queue")
        return
    ex.bindings[(cmd.queue, cmd.binding_key)] = dict(cmd.args)


def _r_unbind(state: SiteState, origin: str, mode: Mode, cmd: Unbind, eff: Effects) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None or _replica_of(state, origin, cmd.queue) is None:
        state.count("replicated_missing_queue")
        return
    ex.bindings.pop((cmd.queue, cmd.binding_key), None)


def _r_enqueue(state: SiteState, origin: str, mode: Mode, cmd: Enqueue, eff: Effects) -> None:
    q = _replica_of(state, origin, cmd.queue)
    if q is None:
        state.count("replicated_missing_queue")
        return
    assert q.replica is not None
    r = q.replica
    if r.mode in (Mode.WIRING, Mode.NONE):
        state.count("replicated_unsupported")
        return
    if cmd.pos <= r.high_pos:
        # Already received (a resync overlapping the stream): keep order.
        state.count("replicated_stale_enqueues")
        return
    r.high_pos = cmd.pos
    if (q.max_count is not None and q.depth >= q.max_count) or (
        q.max_size is not None and q.bytes + len(cmd.body) > q.max_size
    ):
        # The origin accepted it: limits bind local publishers only.
        state.count("replicated_over_limit")
    props = dict(cmd.properties) if cmd.properties else None
    # R4 vs mirror: a full replica keeps the origin's positions, an enqueue
    # queue appends at its own tail with a local pos.
    pos = cmd.pos if r.mode == Mode.FULL else q.next_pos
    q.append(Message(pos, bytes(cmd.body), cmd.message_id, props, cmd.redelivered, cmd.pos))
    eff.append(Enqueued(q.name, pos, cmd.pos))


def _r_dequeue(state: SiteState, origin: str, mode: Mode, cmd: Dequeue, eff: Effects) -> None:
    q = _replica_of(state, origin, cmd.queue)
    if q is None:
        state.count("replicated_missing_queue")
        return
    assert q.replica is not None
    if q.replica.mode != Mode.FULL:
        # R4: an enqueue queue's messages belong to this site's consumers.
        state.count("r4_dequeues_ignored", len(cmd.positions))
        return
    done: list[int] = []
    for pos in cmd.positions:
        if pos not in q.messages:
            state.count("r5_conflicts")  # R5: a message this site does not hold
            continue
        holder = q.acquired.get(pos)
        if holder is not None:
            s = state.sessions.get(holder[0])
            if s is not None:
                held = s.acquired.get(q.name)
                if held is not None:
                    held.pop(pos, None)
                    if not held:
                        del s.acquired[q.name]
        q.remove(pos)
        done.append(pos)
    if done:
        eff.append(Dequeued(q.name, tuple(done), "dequeue"))


def _r_purge(state: SiteState, origin: str, mode: Mode, cmd: Purge, eff: Effects) -> None:
    q = _replica_of(state, origin, cmd.queue)
    if q is None:
        state.count("replicated_missing_queue")
        return
    assert q.replica is not None
    if q.replica.mode != Mode.FULL:
        state.count("r4_dequeues_ignored")
        return
    gone = _purge_available(q)
    if gone:
        eff.append(Dequeued(q.name, tuple(gone), "purge"))


_LOCAL: dict[type, Callable[[SiteState, Any, Sender | None, Effects], None]] = {
    QueueDeclare: _queue_declare,
    QueueDelete: _queue_delete,
    ExchangeDeclare: _exchange_declare,
    ExchangeDelete: _exchange_delete,
    Bind: _bind,
    Unbind: _unbind,
    Publish: _publish,
    Acquire: _acquire,
    Accept: _accept,
    Release: _release_cmd,
    Purge: _purge,
    SessionOpen: _session_open,
    SessionClose: _session_close,
    StateChunk: _state_chunk,
    RulesSwitch: _rules_switch,
    Replicated: _replicated,
    Enqueue: _bare_replica_command,
    Dequeue: _bare_replica_command,
    Promote: _promote,
    AcceptIncarnation: _accept_incarnation,
    AckWatermark: _ack_watermark,
    MemberReady: _member_ready,
    Genesis: _genesis,
}
"""Every command kind, applied as a command of this site."""

_REMOTE: dict[type, Callable[[SiteState, str, Mode, Any, Effects], None]] = {
    QueueDeclare: _r_queue_declare,
    QueueDelete: _r_queue_delete,
    ExchangeDeclare: _r_exchange_declare,
    ExchangeDelete: _r_exchange_delete,
    Bind: _r_bind,
    Unbind: _r_unbind,
    Enqueue: _r_enqueue,
    Dequeue: _r_dequeue,
    Purge: _r_purge,
}
"""The inner commands a ``Replicated`` command may carry; any other kind is
skipped and counted as ``replicated_unsupported``."""


# --------------------------------------------------------------------------
# Resync: a snapshot of an origin's replicated queues, applied at one point
# --------------------------------------------------------------------------


def _resync_apply(state: SiteState, cmd: ResyncApply, sender: Sender | None, eff: Effects) -> None:
    """Replace what this site holds of ``cmd.origin_cluster`` by its snapshot.

    Checked like a ``Replicated`` command first (own origin, R7 fencing, the
    accepted incarnation, R1 by the cut), and the snapshot is decoded whole
    before anything changes, so a bad snapshot changes nothing.  Then:
    replicas of the origin absent from the snapshot are deleted; ``full``
    replicas (and a queue changing to ``full``) are deleted and re-created
    with the origin's messages and positions; ``enqueue`` and ``wiring``
    replicas are kept and their bindings replaced; ``enqueue`` queues take
    only messages above their ``high_pos`` mark (so nothing this site's
    consumers took comes back), the mark starting again from 0 when the
    incarnation is new to this site.  ``applied[incarnation]`` becomes the cut.
    """

    def outcome(o: Outcome) -> None:
        eff.append(ReplicatedOutcome(cmd.origin_cluster, cmd.incarnation, cmd.cut, cmd.epoch, o))

    origin = cmd.origin_cluster
    refusal = admit(state, origin, cmd.incarnation, cmd.cut, cmd.epoch)
    if refusal is not None:
        outcome(refusal)
        return
    o = state.origins[origin]
    try:
        records = list(iter_snapshot_untrusted(cmd.snapshot))
    except DrgateError:
        state.count("ignored")
        return
    new_incarnation = cmd.incarnation not in o.applied
    # The snapshot, in its order: exchanges, then per queue its declare,
    # bindings and messages.
    exchanges: dict[str, ExchangeDeclare] = {}
    declares: dict[str, tuple[Mode, QueueDeclare]] = {}
    rest: list[tuple[Mode, Command]] = []
    for record in records:
        for mode, inner in zip(record.modes, record.commands, strict=False):
            if isinstance(inner, ExchangeDeclare):
                exchanges[inner.exchange] = inner
            elif isinstance(inner, QueueDeclare):
                declares[inner.queue] = (mode, inner)
            elif isinstance(inner, Bind | Enqueue):
                rest.append((mode, inner))
            else:
                state.count("replicated_unsupported")
    for name in [
        n
        for n, x in state.exchanges.items()
        if x.replica_origin == origin and not x.predeclared and n not in exchanges
    ]:
        del state.exchanges[name]
    for x in exchanges.values():
        _r_exchange_declare(state, origin, Mode.WIRING, x, eff)
    for q in [q for q in state.queues.values() if q.replica is not None]:
        assert q.replica is not None
        if q.replica.origin != origin:
            continue
        wanted = declares.get(q.name)
        if wanted is None or wanted[0] == Mode.FULL or q.replica.mode == Mode.FULL:
            _delete_queue(state, q, eff)
        else:
            _drop_bindings_to(state, q.name)
            if new_incarnation:
                q.replica.high_pos = 0
    for mode, declare in declares.values():
        _r_queue_declare(state, origin, mode, declare, eff)
    for mode, inner in rest:
        if isinstance(inner, Bind):
            _r_bind(state, origin, mode, inner, eff)
        else:
            assert isinstance(inner, Enqueue)
            _r_enqueue(state, origin, mode, inner, eff)
    record_applied(state, origin, cmd.incarnation, cmd.cut, cmd.epoch, cmd.origin_time_us)
    outcome(Outcome.APPLIED)


_LOCAL[ResyncApply] = _resync_apply
