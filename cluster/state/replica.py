"""Another site's stream applied here: ``Replicated`` commands, through the
merge rules R1-R7 (docs/state.md).  A resync's snapshot goes through the
same handlers from :mod:`cluster.state.resync`.

Their admission, R3 and R7 are decided in :mod:`cluster.state.merge`; the
inner commands a ``Replicated`` carries go through ``_REMOTE``, which maps
each kind to the handler that applies it to this site's replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.state.digests import content_digest
from cluster.state.effects import (
    Conflict,
    Dequeued,
    Effects,
    Enqueued,
    Message,
    Outcome,
    QueueDeclared,
    ReplicatedOutcome,
    Sender,
    Verified,
)
from cluster.state.merge import admit, record_applied
from cluster.state.model import (
    Exchange,
    Queue,
    Replica,
    SiteState,
    describe_args,
)
from cluster.state.queues import delete_queue, forget_hold, purge_available
from cluster.state.switchover import handover, swap_in, swapping, take_dr_role
from protocol.cluster import (
    Bind,
    Dequeue,
    Enqueue,
    ExchangeDeclare,
    ExchangeDelete,
    Purge,
    QueueDeclare,
    QueueDelete,
    Replicated,
    Switchover,
    SwitchoverPhase,
    Unbind,
    Verify,
)
from protocol.modes import Mode

# --------------------------------------------------------------------------
# Replicated commands: the merge rules
# --------------------------------------------------------------------------


def replicated(state: SiteState, cmd: Replicated, sender: Sender | None, eff: Effects) -> None:
    def outcome(o: Outcome) -> None:
        eff.append(
            ReplicatedOutcome(cmd.origin_cluster, cmd.incarnation, cmd.origin_cseq, cmd.epoch, o)
        )

    swap = swapping(state, cmd)
    if swap:
        take_dr_role(state, cmd.origin_cluster)  # the new primary's stream starts here
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
        if isinstance(inner, Verify):
            eff.append(verify(state, cmd.origin_cluster, cmd.origin_cseq, mode, inner))
            continue
        if isinstance(inner, Switchover):
            if inner.phase == SwitchoverPhase.SWAP:
                if swap:  # else not addressed to this site's handover: nothing
                    swap_in(state, cmd.origin_cluster, mode, inner, eff)
                continue
            handover(state, cmd.origin_cluster, cmd.epoch, inner, eff)
            continue
        handler = _REMOTE.get(type(inner))
        if handler is None:
            state.count("replicated_unsupported")
            continue
        handler(state, cmd.origin_cluster, mode, inner, eff)
    outcome(Outcome.APPLIED)


def replica_of(state: SiteState, origin: str, name: str) -> Queue | None:
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


def r_queue_declare(
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
    delete_queue(state, q, eff)


def r_exchange_declare(
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


def r_bind(state: SiteState, origin: str, mode: Mode, cmd: Bind, eff: Effects) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None or cmd.exchange == "" or replica_of(state, origin, cmd.queue) is None:
        state.count("replicated_missing_queue")
        return
    ex.bindings[(cmd.queue, cmd.binding_key)] = dict(cmd.args)


def _r_unbind(state: SiteState, origin: str, mode: Mode, cmd: Unbind, eff: Effects) -> None:
    ex = state.exchanges.get(cmd.exchange)
    if ex is None or replica_of(state, origin, cmd.queue) is None:
        state.count("replicated_missing_queue")
        return
    ex.bindings.pop((cmd.queue, cmd.binding_key), None)


def _r_enqueue(state: SiteState, origin: str, mode: Mode, cmd: Enqueue, eff: Effects) -> None:
    q = replica_of(state, origin, cmd.queue)
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
    q.append(Message(pos, bytes(cmd.body), cmd.message_id, props, int(cmd.redelivered), cmd.pos))
    eff.append(Enqueued(q.name, pos, cmd.pos))


def _r_dequeue(state: SiteState, origin: str, mode: Mode, cmd: Dequeue, eff: Effects) -> None:
    q = replica_of(state, origin, cmd.queue)
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
            forget_hold(state, holder[0], q.name, pos)
        q.remove(pos)
        done.append(pos)
    if done:
        eff.append(Dequeued(q.name, tuple(done), "dequeue"))


def _r_purge(state: SiteState, origin: str, mode: Mode, cmd: Purge, eff: Effects) -> None:
    q = replica_of(state, origin, cmd.queue)
    if q is None:
        state.count("replicated_missing_queue")
        return
    assert q.replica is not None
    if q.replica.mode != Mode.FULL:
        state.count("r4_dequeues_ignored")
        return
    gone = purge_available(q)
    if gone:
        eff.append(Dequeued(q.name, tuple(gone), "purge"))


def verify(state: SiteState, origin: str, origin_cseq: int, mode: Mode, cmd: Verify) -> Verified:
    """Compare the replica ``cmd.queue`` with what ``origin``'s queue was at
    ``origin_cseq`` (continuous verification): a ``full`` replica must hold
    the same messages (depth and content digest), an ``enqueue`` one must have
    received the origin's newest message and nothing it did not publish.
    Changes nothing."""

    def result(ok: bool, detail: str = "") -> Verified:
        return Verified(origin, cmd.queue, mode, origin_cseq, ok, detail)

    q = replica_of(state, origin, cmd.queue)
    if q is None or q.replica is None:
        return result(False, f"no replica of {origin!r} named {cmd.queue!r} here")
    if q.replica.mode != mode:
        return result(
            False, f"replicated as {q.replica.mode.label} here, {mode.label} at {origin!r}"
        )
    if mode == Mode.FULL:
        if q.depth != cmd.depth:
            return result(False, f"{q.depth} messages here, {cmd.depth} at {origin!r}")
        if content_digest(q) != cmd.digest:
            return result(False, f"same depth ({q.depth}), different messages (content digest)")
        return result(True)
    received = q.replica.high_pos
    if received < cmd.newest_pos:
        return result(
            False,
            f"received up to origin position {received} here; {origin!r} still holds "
            f"position {cmd.newest_pos}",
        )
    if received > cmd.last_pos:
        return result(
            False,
            f"received up to origin position {received} here; {origin!r} published only "
            f"up to {cmd.last_pos}",
        )
    return result(True)


_REMOTE: dict[type, Callable[[SiteState, str, Mode, Any, Effects], None]] = {
    QueueDeclare: r_queue_declare,
    QueueDelete: _r_queue_delete,
    ExchangeDeclare: r_exchange_declare,
    ExchangeDelete: _r_exchange_delete,
    Bind: r_bind,
    Unbind: _r_unbind,
    Enqueue: _r_enqueue,
    Dequeue: _r_dequeue,
    Purge: _r_purge,
}
"""The inner commands a ``Replicated`` command may carry; any other kind is
skipped and counted as ``replicated_unsupported``."""
