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
counter, no change to the state).  ``Replicated`` commands and resyncs
go through the merge rules R1-R7 (docs/state.md): their admission, R3 and R7
are decided in :mod:`cluster.state.merge`, their inner commands go through
``_REMOTE``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from cluster.selector import SelectorError
from cluster.state import demand
from cluster.state.effects import (
    Dequeued,
    Effects,
    Enqueued,
    GenesisApplied,
    IncarnationAccepted,
    Message,
    Promoted,
    QueueDeclared,
    Reason,
    Sender,
    Settled,
    refuse,
)
from cluster.state.merge import origin_record, read_only_origin, read_only_text
from cluster.state.model import (
    TEMPORARY_ARG,
    Exchange,
    Queue,
    Session,
    SiteState,
    session_owner,
)
from cluster.state.queues import (
    delete_queue,
    forget_reports,
    purge_available,
)
from cluster.state.replica import replicated
from cluster.state.resync import resync_apply, resync_commit, resync_stage
from cluster.state.selection import matcher
from cluster.state.sessions import close_session, release
from cluster.state.switchover import (
    closed_to_publishes,
    failback,
    failback_acknowledged,
    frozen,
    guard_text,
    stale_supersession,
    swapped_text,
    switching,
    switchover,
)
from cluster.state.switchover import end as end_switchover
from protocol.cluster import (
    FAILBACK_ONLY,
    Accept,
    AcceptIncarnation,
    AcceptPrimary,
    AckWatermark,
    Acquire,
    AcquireMatching,
    Bind,
    Command,
    Dequeue,
    Durable,
    Enqueue,
    ExchangeDeclare,
    ExchangeDelete,
    ForceRecovery,
    Genesis,
    JoinHave,
    MemberReady,
    Modify,
    Promote,
    Publish,
    Purge,
    QueueDeclare,
    QueueDelete,
    Recovering,
    RecoveryChunk,
    Release,
    Replicated,
    ResyncApply,
    ResyncCommit,
    ResyncStage,
    RulesSwitch,
    SessionClose,
    SessionOpen,
    SetEpoch,
    StateChunk,
    Superseded,
    Switchover,
    Unbind,
    Verify,
    VerifyPoint,
    Withdraw,
)
from protocol.modes import check_declare_args, declare_refused


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
    if state.demand:
        demand.serve(state, eff)
    return eff


def apply_all(
    state: SiteState, commands: Iterable[Command], *, sender: Sender | None = None
) -> Effects:
    """Apply the commands of one frame in order; the concatenated effects."""
    eff: Effects = []
    for command in commands:
        eff.extend(apply(state, command, sender=sender))
    return eff


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _temporary_problem(state: SiteState, cmd: QueueDeclare, sender: Sender | None) -> str | None:
    """Why ``cmd`` may not declare a temporary queue: it must be new, and
    owned by an open session of its sender (whose closing deletes it)."""
    if cmd.queue in state.queues:
        return f"queue {cmd.queue!r} exists; a temporary queue must be a new one"
    owner = cmd.args[TEMPORARY_ARG]
    try:
        session = int(str(owner), 16)
    except ValueError:
        return f"{TEMPORARY_ARG}={owner!r} is not a session id (0x...)"
    if session not in state.sessions:
        return f"its owner session {session:#x} is not open"
    node, pid = session_owner(session)
    if sender is not None and (node, pid) != (sender.node, sender.pid):
        return (
            f"its owner session {session:#x} belongs to member {node}.{pid}, "
            f"not to the sender {sender.node}.{sender.pid}"
        )
    return None


# --------------------------------------------------------------------------
# Local commands
# --------------------------------------------------------------------------


def _queue_declare(
    state: SiteState, cmd: QueueDeclare, sender: Sender | None, eff: Effects
) -> None:
    problem = check_declare_args(cmd.args)
    if problem is None and TEMPORARY_ARG in cmd.args:
        problem = _temporary_problem(state, cmd, sender)
    if problem is not None:
        refuse(
            state,
            eff,
            sender,
            Reason.INVALID_ARGUMENT,
            cmd.queue,
            declare_refused(cmd.queue, problem),
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
        refuse(
            state, eff, sender, Reason.UNKNOWN_QUEUE, name,
            f"cannot {verb} queue {name!r}: no such queue",
        )  # fmt: skip
        return None
    origin = read_only_origin(state, q)
    if origin is not None:
        refuse(
            state, eff, sender, Reason.READ_ONLY, name, read_only_text(q.name, origin, passive)
        )  # fmt: skip
        return None
    return q


def _queue_delete(state: SiteState, cmd: QueueDelete, sender: Sender | None, eff: Effects) -> None:
    q = _writable_queue(state, cmd.queue, sender, eff, "delete", "be deleted")
    if q is None:
        return
    delete_queue(state, q, eff)


def _exchange_declare(
    state: SiteState, cmd: ExchangeDeclare, sender: Sender | None, eff: Effects
) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None:
        state.exchanges[cmd.exchange] = Exchange(cmd.exchange, cmd.type, cmd.args)
        return
    if ex.type != cmd.type:
        refuse(
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
        refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_EXCHANGE,
            cmd.exchange,
            f"cannot delete exchange {cmd.exchange!r}: no such exchange",
        )
        return
    if ex.predeclared:
        refuse(
            state,
            eff,
            sender,
            Reason.PREDECLARED,
            cmd.exchange,
            f"exchange {cmd.exchange!r} is predeclared and cannot be deleted",
        )
        return
    del state.exchanges[cmd.exchange]
    forget_reports(state, cmd.exchange)


def _bind_target(
    state: SiteState, exchange: str, queue: str, sender: Sender | None, eff: Effects, what: str
) -> Exchange | None:
    ex = state.exchanges.get(exchange)
    if ex is None:
        refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_EXCHANGE,
            exchange,
            f"cannot {what} queue {queue!r} on exchange {exchange!r}: no such exchange",
        )
        return None
    if exchange == "":
        refuse(
            state,
            eff,
            sender,
            Reason.PREDECLARED,
            exchange,
            f"cannot {what} queue {queue!r} on the default exchange: it routes by queue name",
        )
        return None
    if queue not in state.queues:
        refuse(
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
        refuse(
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
        refuse(
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
        refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_QUEUE,
            cmd.routing_key,
            f"cannot publish to queue {cmd.routing_key!r}: no such queue",
            ref=cmd.ref,
        )
        return
    for name in targets:
        if closed_to_publishes(state, name):
            if switching(state, name):
                reason, text = Reason.SWITCHOVER, guard_text(state, name, "take publishes")
            elif state.handed_to and not state.superseded_by:
                reason, text = Reason.SWITCHOVER, swapped_text(state, name)
            else:
                reason, text = Reason.SUPERSEDED, _superseded_text(state, name)
            refuse(state, eff, sender, reason, name, text, ref=cmd.ref)
            return
    size = len(cmd.body)
    queues = [state.queues[name] for name in targets]
    # All or nothing: check every target before changing any.
    for q in queues:
        origin = read_only_origin(state, q)
        if origin is not None:
            refuse(
                state,
                eff,
                sender,
                Reason.READ_ONLY,
                q.name,
                read_only_text(q.name, origin, "take messages from clients of this site"),
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
            refuse(
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


def _acquire(
    state: SiteState, cmd: Acquire | AcquireMatching, sender: Sender | None, eff: Effects
) -> None:
    q = state.queues.get(cmd.queue)
    if q is None:
        refuse(
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
        refuse(
            state,
            eff,
            sender,
            Reason.UNKNOWN_SESSION,
            cmd.queue,
            f"cannot consume from queue {cmd.queue!r}: session {cmd.session:#x} is not open",
            session=cmd.session,
        )
        return
    why = demand.refusal(state, q)
    if why is not None:
        reason, text = why
        refuse(state, eff, sender, reason, q.name, text, session=cmd.session)
        return
    match = None
    if isinstance(cmd, AcquireMatching):
        try:
            match = matcher(cmd.selector)
        except SelectorError as exc:
            # The broker checked it at attach: only a faulty member sends this.
            refuse(
                state,
                eff,
                sender,
                Reason.INVALID_ARGUMENT,
                q.name,
                f"cannot consume from queue {q.name!r}: {exc}",
                session=cmd.session,
            )
            return
    positions = q.take(cmd.count, (s.id, cmd.consumer), match)
    if positions:
        demand.assign(q, s, cmd.consumer, positions, eff)
    if match is None and len(positions) < cmd.count:
        # The rest goes to it as it comes (a selector's acquire asks again).
        demand.add(state, q, s.id, cmd.consumer, cmd.count - len(positions))


def _withdraw(state: SiteState, cmd: Withdraw, sender: Sender | None, eff: Effects) -> None:
    demand.withdraw(state, cmd.queue, cmd.session, cmd.consumer)


def _settling(state: SiteState, cmd: Accept | Release | Modify) -> tuple[Queue, Session] | None:
    """The queue and session a settlement names, or None (counted) when the
    queue was deleted or the session closed meanwhile: nothing to settle."""
    q = state.queues.get(cmd.queue)
    s = state.sessions.get(cmd.session)
    if q is None or s is None:
        state.count("stale_settlements", len(cmd.positions))
        return None
    return q, s


def _accept(state: SiteState, cmd: Accept, sender: Sender | None, eff: Effects) -> None:
    target = _settling(state, cmd)
    if target is None:
        return
    q, s = target
    if frozen(state, q.name):
        # Handed over: D holds the message, which stays here as it is there.
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
    target = _settling(state, cmd)
    if target is not None:
        release(state, *target, cmd.positions, cmd.redelivered, "release", eff)


def _modify(state: SiteState, cmd: Modify, sender: Sender | None, eff: Effects) -> None:
    target = _settling(state, cmd)
    if target is not None:
        release(state, *target, cmd.positions, cmd.delivery_failed, "release", eff, cmd)


def _purge(state: SiteState, cmd: Purge, sender: Sender | None, eff: Effects) -> None:
    q = _writable_queue(state, cmd.queue, sender, eff, "purge", "be purged")
    if q is None:
        return
    gone = purge_available(q)
    if gone:
        eff.append(Dequeued(q.name, tuple(gone), "purge"))


def _session_open(state: SiteState, cmd: SessionOpen, sender: Sender | None, eff: Effects) -> None:
    if sender is not None and session_owner(cmd.session) != (sender.node, sender.pid):
        node, pid = session_owner(cmd.session)
        refuse(
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
    close_session(state, s, "session_close", eff)


def _state_chunk(state: SiteState, cmd: StateChunk, sender: Sender | None, eff: Effects) -> None:
    """State transfer is the node's business; the chunk only takes a cseq."""


def _join_have(state: SiteState, cmd: JoinHave, sender: Sender | None, eff: Effects) -> None:
    """What a joiner holds is the donor's business (cluster/membership.py)."""


def _rules_switch(state: SiteState, cmd: RulesSwitch, sender: Sender | None, eff: Effects) -> None:
    # Kept in the state so a member joining later gets the rules in force.
    state.rules = bytes(cmd.payload)
    state.rules_cseq = state.cseq


def _ack_watermark(
    state: SiteState, cmd: AckWatermark, sender: Sender | None, eff: Effects
) -> None:
    # At P the active egress's acked point; at D the heartbeat of P's stream
    # (gateway/recoverypoint.py), whose time moves on at the same cseq.
    old = state.watermarks.get(cmd.origin_cluster)
    new = (cmd.incarnation, cmd.cseq, cmd.time_us)
    if old is None or old[0] != cmd.incarnation or old[1:] < new[1:]:
        state.watermarks[cmd.origin_cluster] = new
    else:
        state.count("ignored")
    failback_acknowledged(state, cmd.origin_cluster, cmd.incarnation, cmd.cseq)


def _member_ready(state: SiteState, cmd: MemberReady, sender: Sender | None, eff: Effects) -> None:
    # A member that announces itself again goes to the back of the ready
    # order: a sidecar whose spool failed a write steps back that way, so the
    # link moves to one that holds the events (gateway/roles.py).
    key = (cmd.node, cmd.pid)
    state.ready.pop(key, None)
    state.ready[key] = cmd.role


def _genesis(state: SiteState, cmd: Genesis, sender: Sender | None, eff: Effects) -> None:
    if state.incarnation != 0 or cmd.incarnation == 0:
        state.count("ignored")
        eff.append(GenesisApplied(cmd.cluster, cmd.incarnation, False))
        return
    state.cluster = cmd.cluster
    state.incarnation = cmd.incarnation
    eff.append(GenesisApplied(cmd.cluster, cmd.incarnation, True))


def _durable(state: SiteState, cmd: Durable, sender: Sender | None, eff: Effects) -> None:
    state.durable_cseq = max(state.durable_cseq, cmd.cseq)


def _recovering(state: SiteState, cmd: Recovering, sender: Sender | None, eff: Effects) -> None:
    """A site that started with no member alive collects what its brokers
    recovered; once ``expect`` of them reported, the most advanced is chosen
    (:func:`_choose_recovery`)."""
    if state.incarnation != 0 or state.recovery_winner is not None:
        state.count("ignored")
        return
    state.candidates[cmd.node] = (cmd.pid, cmd.cseq, cmd.incarnation, cmd.proposal)
    state.recovery_expect = max(state.recovery_expect, cmd.expect)
    if len(state.candidates) < state.recovery_expect:
        return
    _choose_recovery(state, cmd.cluster, eff)


def _force_recovery(
    state: SiteState, cmd: ForceRecovery, sender: Sender | None, eff: Effects
) -> None:
    """The operator stops the wait for brokers that are gone for good: the
    choice is made among those that reported.  Ignored on a live site, once
    the choice is made, and when nobody reported (nothing to choose from)."""
    if state.incarnation != 0 or state.recovery_winner is not None or not state.candidates:
        state.count("ignored")
        return
    _choose_recovery(state, cmd.cluster, eff)


def _choose_recovery(state: SiteState, cluster: str, eff: Effects) -> None:
    """The most advanced report (highest cseq, then the lowest node) wins and
    every member takes its state (``RecoveryChunk``, cluster/member.py); when
    none recovered anything, the site starts from nothing with the lowest
    broker's proposal."""
    node, (pid, cseq, _inc, _proposal) = max(
        state.candidates.items(), key=lambda c: (c[1][1], -c[0])
    )
    if cseq > 0:
        state.recovery_winner = (node, pid)
        return
    lowest = min(state.candidates)
    state.cluster = cluster
    state.incarnation = state.candidates[lowest][3]
    state.candidates.clear()
    eff.append(GenesisApplied(cluster, state.incarnation, True))


def recovery_loses_history(state: SiteState) -> bool:
    """The recovery chose a journal that may lack commands another broker had
    on disk, which the site's DR site may hold (the egress forwards what any
    broker had on disk, ``Durable``): the choice was forced before every
    broker reported (``ForceRecovery``), or a broker reported an empty journal
    (a new or re-seeded disk) while others held one.  Reusing those cseqs in
    the same incarnation would make D skip the new commands as ones it has,
    so the site continues as a new incarnation (cluster/member.py): D refuses
    it until its operator accepts it, and a resync makes D exact."""
    if state.recovery_winner is None:
        return False
    reports = state.candidates.values()
    return len(state.candidates) < state.recovery_expect or any(r[1] == 0 for r in reports)


def _recovery_chunk(
    state: SiteState, cmd: RecoveryChunk, sender: Sender | None, eff: Effects
) -> None:
    # Collected by the members (cluster/member.py): the final one replaces
    # this state whole.
    return


def _bare_replica_command(
    state: SiteState, cmd: Enqueue | Dequeue, sender: Sender | None, eff: Effects
) -> None:
    # Enqueue, Dequeue and Verify only mean something inside Replicated (they carry
    # origin positions); on their own they are ignored and counted.
    state.count("ignored")


def _verify_point(state: SiteState, cmd: VerifyPoint, sender: Sender | None, eff: Effects) -> None:
    # For the taps of this site (gateway/tap.py): nothing changes here.
    return


def _promote(state: SiteState, cmd: Promote, sender: Sender | None, eff: Effects) -> None:
    o = origin_record(state, cmd.origin_cluster)
    if cmd.epoch <= o.epoch:
        state.count("ignored")
        return
    o.epoch = cmd.epoch
    o.promoted = True
    o.promoted_time_us = cmd.time_us
    if state.handed_to == cmd.origin_cluster:  # promoted over the primary it swapped with
        state.handed_to, state.guarded = "", {}
    eff.append(Promoted(cmd.origin_cluster, cmd.epoch))


def _accept_primary(
    state: SiteState, cmd: AcceptPrimary, sender: Sender | None, eff: Effects
) -> None:
    """The operator lets a primary this site was promoted over in again, from
    ``cmd.epoch`` on.  What was applied of it is forgotten (the incarnations
    stay known, so ``enqueue`` marks hold), so its next link resyncs this
    site: its ``full`` replicas become the primary's again."""
    o = state.origins.get(cmd.origin_cluster)
    if o is None or not o.promoted or cmd.epoch <= o.epoch:
        state.count("ignored")
        return
    o.promoted = False
    o.epoch = cmd.epoch
    o.applied = dict.fromkeys(o.applied, 0)
    if cmd.origin_cluster in state.handovers:
        state.swapped = False  # the primary's role it took by the handover ends
    state.handovers.pop(cmd.origin_cluster, None)
    state.staged.pop(cmd.origin_cluster, None)


def _set_epoch(state: SiteState, cmd: SetEpoch, sender: Sender | None, eff: Effects) -> None:
    """This site's stream goes on at ``cmd.epoch`` (the one the DR site
    accepts it at again); the zombie guard is lifted."""
    if cmd.epoch <= state.epoch:
        state.count("ignored")
        return
    state.epoch = cmd.epoch
    failback(state)  # before the supersession ends: it keeps what the guard closed
    state.superseded_by = ""
    state.superseded_time_us = 0
    end_switchover(state)


def _superseded(state: SiteState, cmd: Superseded, sender: Sender | None, eff: Effects) -> None:
    """``cmd.by_cluster`` was promoted over this site: publishes to the
    guarded queues are refused from now on (see ``_publish``), unless the
    claim is stale (:func:`stale_supersession`)."""
    if state.superseded_by or stale_supersession(state, cmd.by_cluster):
        state.count("ignored")  # the first report stands until SetEpoch
        return
    state.superseded_by = cmd.by_cluster
    state.superseded_time_us = cmd.time_us
    state.guarded = {q: None for q, only in cmd.guarded.items() if only != FAILBACK_ONLY}
    state.failback_queues = dict.fromkeys(cmd.guarded)
    state.failback_cseq = 0  # superseded again: the guard, not a failback, holds them
    if state.switchover_to != cmd.by_cluster:
        end_switchover(state)  # else it records the handover (switchover.handed_over)


def _superseded_text(state: SiteState, queue: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(state.superseded_time_us / 1e6))
    by = state.superseded_by
    return (
        f"{by} was promoted over {state.cluster} (refused its stream since {when}): a message "
        f"published to replicated queue {queue!r} here could never reach {by}, so it is "
        f"refused. Move this queue's clients to {by}, or make {state.cluster} the primary "
        "again (docs/operations.md, 'When the primary comes back')"
    )


def _accept_incarnation(
    state: SiteState, cmd: AcceptIncarnation, sender: Sender | None, eff: Effects
) -> None:
    o = origin_record(state, cmd.origin_cluster)
    o.incarnation = cmd.incarnation
    if o.refused_incarnation == cmd.incarnation:
        o.refused_incarnation = 0
    eff.append(IncarnationAccepted(cmd.origin_cluster, cmd.incarnation))


_LOCAL: dict[type, Callable[[SiteState, Any, Sender | None, Effects], None]] = {
    QueueDeclare: _queue_declare,
    QueueDelete: _queue_delete,
    ExchangeDeclare: _exchange_declare,
    ExchangeDelete: _exchange_delete,
    Bind: _bind,
    Unbind: _unbind,
    Publish: _publish,
    Acquire: _acquire,
    Withdraw: _withdraw,
    AcquireMatching: _acquire,
    Accept: _accept,
    Release: _release_cmd,
    Modify: _modify,
    Purge: _purge,
    SessionOpen: _session_open,
    SessionClose: _session_close,
    StateChunk: _state_chunk,
    JoinHave: _join_have,
    RulesSwitch: _rules_switch,
    Replicated: replicated,
    ResyncApply: resync_apply,
    ResyncStage: resync_stage,
    ResyncCommit: resync_commit,
    Enqueue: _bare_replica_command,
    Dequeue: _bare_replica_command,
    Verify: _bare_replica_command,
    VerifyPoint: _verify_point,
    Promote: _promote,
    AcceptIncarnation: _accept_incarnation,
    AcceptPrimary: _accept_primary,
    SetEpoch: _set_epoch,
    Superseded: _superseded,
    Switchover: switchover,
    Durable: _durable,
    Recovering: _recovering,
    RecoveryChunk: _recovery_chunk,
    ForceRecovery: _force_recovery,
    AckWatermark: _ack_watermark,
    MemberReady: _member_ready,
    Genesis: _genesis,
}
"""Every command kind, applied as a command of this site."""
