"""The tap: P's bus stream in, replication events out (docs/architecture.md, section 7).

Theory of operation
-------------------
Every sidecar applies P's stream to its shadow state (it is a bus member like
a broker).  After each command the state machine has applied, the tap looks
at the command and its effects and decides, by the rules in force, what D
must see: zero or one replication event per command.  An event is a bus
frame holding one ``Replicated`` command, whose inner commands name D's
queues (after the rules' name mapping) and carry P's positions, so D can
apply it without P's bindings.  The event's sequence number is the command's
``cseq``: every sidecar of P computes the same events for the same commands
(only ``origin_time_us``, the tap's clock, differs), so any of them can take
over the egress.

What crosses, by the mode of each queue touched:

===============  ============================================================
declare          ``full``/``enqueue``/``wiring``: a replica of that mode
delete           every mode but ``none``
bind / unbind    every mode but ``none`` (exchanges are always declared)
publish          ``full``/``enqueue``: one ``Enqueue`` per routed queue, with
                 P's ``pos``; per-message rules may drop it (size, header)
accept / purge   ``full`` only: a ``Dequeue`` of P's positions
switchover       always, as ``wiring``: D is promoted at a ``HANDOVER`` naming it
swap             the first event of a site that became the primary by a
                 handover (:meth:`Tap.swap_event`): a ``SWAP`` per mode, naming
                 the queues and this site's highest position in each
verify point     ``full``/``enqueue`` (every message forwarded): a ``Verify``
                 of what the queue holds (depth and content digest) or
                 received (its newest and last positions), for D to compare
rules switch     applied at this cseq; for each queue whose mode changed to
                 anything but ``none``: its declare in the new mode, and when
                 it did not forward messages before (or goes ``enqueue`` to
                 ``full``), its bindings and current messages: a per-queue
                 resync cut at the switch's cseq (``full`` from ``enqueue``
                 first deletes D's copy, which it replaces); a queue of
                 more than ``SWITCH_EVENT_MAX_*`` goes by a resync instead:
                 no event at this cseq, and ``resyncs_requested`` counts it
===============  ============================================================

Each event carries ``prev_seq``, the seq of the event this tap forwarded
before it in this incarnation, so the spool and D can tell that nothing lies
between the two.  After a join or a rejoin (:meth:`Tap.resync_rules`) the tap
does not know what was forwarded before the join point, so the first event's
``prev_seq`` is the join cseq (the spool's floor): conservative, a D that
applied less than the join point is refused by the link's continuity check
and resynced.

The tap is pure: time is passed in, counters are plain ints read by
``statistics()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster import state as st
from cluster.state.model import Queue, SiteState
from filters.matcher import PAUSED, Decision, Drop, RuleSet
from filters.switch import RulesPayload, apply_switch
from gateway.content import MESSAGE_MODES, queue_content
from gateway.statistics import TapStatistics
from protocol import cluster as pc
from protocol.errors import DrgateError
from protocol.eventframe import encode_event
from protocol.modes import Mode
from protocol.quickinit import quick_init
from protocol.values import Value


@quick_init  # one per forwarded command at every P sidecar
@dataclass(frozen=True, slots=True)
class ReplEvent:
    """One replication event: ``payload`` is a bus frame of one ``Replicated``;
    ``prev_seq`` the seq of the event forwarded before it (or the join point)."""

    seq: int
    time_us: int
    payload: bytes
    modes: tuple[Mode, ...]
    queues: tuple[str, ...]
    prev_seq: int


# Each command's kind is counted by name: a table, since Kind(x).name costs a
# microsecond, per command, at every sidecar.
_KIND_NAMES: dict[int, str] = {int(k): k.name for k in pc.Kind}

# A queue's content goes in the rules switch's event only up to these sizes;
# a bigger one is sent by a resync (see Tap.on_command), which has no cap.
SWITCH_EVENT_MAX_MESSAGES = 10_000
SWITCH_EVENT_MAX_BYTES = 4 * 1024 * 1024
# The switchover's steps D applies in the stream (a failback by delta's steps
# concern only the site that takes them).
FORWARDED_PHASES = (
    pc.SwitchoverPhase.ABORT,
    pc.SwitchoverPhase.QUIESCE,
    pc.SwitchoverPhase.HANDOVER,
)


class Tap:
    """Decides, command by command, what P forwards to D."""

    def __init__(self, rules: RuleSet, *, origin_cluster: str, epoch: int = 1) -> None:
        self.rules = rules
        self.origin_cluster = origin_cluster
        self.epoch = epoch
        self.commands: Counter[str] = Counter()
        self.forwarded: Counter[str] = Counter()
        self.filtered: Counter[tuple[str, str]] = Counter()
        self.dropped: Counter[str] = Counter()
        self.rules_failures = 0
        self.last_error = ""
        self.last_seq = 0  # the seq of the last event forwarded (or the join point)
        self.resyncs_requested = 0  # commands whose content goes by a resync
        self._resync_instead = False

    # ------------------------------------------------------------------

    def resync_rules(self, state: SiteState) -> None:
        """After a state transfer (a join or a rejoin): take the rules the site
        switched to, if any, and decide every queue the state holds.  The next
        event's ``prev_seq`` is the join point, ``state.cseq``."""
        self.last_seq = state.cseq
        self.epoch = state.epoch
        if state.rules:
            self._take_rules(state.rules, state.rules_cseq, "cannot apply the site's rules")
        self._decide_all(state)

    def _take_rules(self, payload: bytes, cseq: int, failure: str) -> bool:
        """Switch to the rules of a switch ``payload`` delivered at ``cseq``.
        False, counted and kept in ``last_error`` (after ``failure``), when
        they cannot be read: every tap refuses the same payload the same way,
        so the old rules stay in force everywhere."""
        try:
            rules = RulesPayload.from_bytes_untrusted(payload)
            self.rules = apply_switch(self.rules, rules, cseq)
        except DrgateError as exc:
            self.rules_failures += 1
            self.last_error = f"{failure}: {exc}"
            return False
        return True

    def _decide_all(self, state: SiteState) -> None:
        for q in state.queues.values():
            self.rules.decide_queue(q.name, q.args)

    def on_command(
        self, state: SiteState, cmd: pc.Command, effects: Sequence[Any], time_us: int
    ) -> ReplEvent | None:
        """The event for ``cmd`` (just applied to ``state``, at ``state.cseq``)."""
        self.commands[_KIND_NAMES[cmd.KIND]] += 1
        items: list[tuple[Mode, pc.Command]] = []
        if isinstance(cmd, pc.Publish):
            self._publish(state, cmd, effects, items)
        elif isinstance(cmd, pc.Accept | pc.Purge):
            self._dequeues(effects, items)
        elif isinstance(cmd, pc.QueueDeclare):
            self._declare(state, effects, items)
        elif isinstance(cmd, pc.QueueDelete):
            self._delete(effects, items)
        elif isinstance(cmd, pc.Bind | pc.Unbind):
            decision = self.rules.decisions.get(cmd.queue)
            if decision is not None and decision.mode != Mode.NONE:
                target = decision.target_name
                bound: pc.Command
                if isinstance(cmd, pc.Bind):
                    bound = pc.Bind(cmd.exchange, target, cmd.binding_key, cmd.args)
                else:
                    bound = pc.Unbind(cmd.exchange, target, cmd.binding_key)
                items.append((decision.mode, bound))
        elif isinstance(cmd, pc.ExchangeDeclare | pc.ExchangeDelete):
            if not any(isinstance(e, st.Refused) for e in effects):
                items.append((Mode.WIRING, cmd))
        elif isinstance(cmd, pc.SetEpoch):
            self.epoch = state.epoch  # the events from here on carry it
        elif isinstance(cmd, pc.VerifyPoint):
            self._verify(state, items)
        elif isinstance(cmd, pc.Switchover) and cmd.phase in FORWARDED_PHASES:
            # In the stream, so D applies a handover after all P forwarded
            # before it, and the drain can wait for the quiesce's own cseq.
            items.append((Mode.WIRING, cmd))
        elif isinstance(cmd, pc.RulesSwitch):
            before = self._modes(state)
            self._switch(state, cmd)
            self._mode_changes(state, before, items)
        if self._resync_instead:
            # Too much for one event: none at this cseq, so the stream has a
            # gap here that a resync cut at or after it closes.
            self._resync_instead = False
            self.resyncs_requested += 1
            self.last_seq = state.cseq
            return None
        if not items:
            return None
        return self._event(state, items, time_us)

    def swap_event(self, state: SiteState, to_cluster: str, time_us: int) -> ReplEvent:
        """This site's first event as the primary, after a planned switchover
        swapped the roles at ``state.cseq`` (the handover from ``to_cluster``
        applied here, cluster/state/switchover.py): a ``SWAP`` per mode,
        naming each queue the rules replicate in it (by its name at the
        other site) with its highest position here.  ``to_cluster`` becomes
        this site's DR site at this event, without a resync; the tap forwards
        every command after it."""
        self.epoch = state.epoch
        self._decide_all(state)
        queues: dict[Mode, dict[str, Value]] = {}
        for q in state.queues.values():
            decision = self.rules.decisions.get(q.name)
            if decision is not None and decision.mode != Mode.NONE:
                queues.setdefault(decision.mode, {})[decision.target_name] = q.next_pos - 1
        items: list[tuple[Mode, pc.Command]] = [
            (mode, pc.Switchover(to_cluster, pc.SwitchoverPhase.SWAP, time_us, names))
            for mode, names in sorted(queues.items())
        ] or [(Mode.WIRING, pc.Switchover(to_cluster, pc.SwitchoverPhase.SWAP, time_us))]
        self.last_seq = state.cseq - 1  # the stream starts here: nothing before it
        return self._event(state, items, time_us)

    def _event(
        self, state: SiteState, items: list[tuple[Mode, pc.Command]], time_us: int
    ) -> ReplEvent:
        for mode, _ in items:
            self.forwarded[mode.label] += 1
        modes = tuple(m for m, _ in items)
        commands = tuple(c for _, c in items)
        payload = encode_event(
            self.origin_cluster, state.incarnation, state.cseq, self.epoch, time_us, modes, commands
        )
        prev_seq, self.last_seq = self.last_seq, state.cseq
        return ReplEvent(
            state.cseq,
            time_us,
            payload,
            modes,
            tuple(c.key for c in commands),
            prev_seq,
        )

    # ------------------------------------------------------------------

    def _filtered(self, decision: Decision) -> None:
        self.filtered[(decision.mode.label, decision.rule_name)] += 1

    def _modes(self, state: SiteState) -> dict[str, Mode]:
        return {
            name: d.mode
            for name in state.queues
            if (d := self.rules.decisions.get(name)) is not None
        }

    def _mode_changes(
        self, state: SiteState, before: dict[str, Mode], items: list[tuple[Mode, pc.Command]]
    ) -> None:
        """Items that bring D up to date with queues whose mode changed."""
        for q in state.queues.values():
            decision = self.rules.decide_queue(q.name, q.args)
            self._queue_change(state, q, before.get(q.name, Mode.NONE), decision, items)

    def _queue_change(
        self,
        state: SiteState,
        q: Queue,
        old: Mode,
        decision: Decision,
        items: list[tuple[Mode, pc.Command]],
        *,
        resumed: bool = False,
    ) -> None:
        """One queue's mode went from ``old`` to ``decision.mode``: D gets the
        part of the queue's content it does not hold yet.  ``resumed``: the
        queue's replication was paused, so D holds a stale copy of it."""
        new = decision.mode
        if new in (old, Mode.NONE):
            return
        # enqueue -> full: D's own consumers have changed D's copy, and a full
        # replica must mirror P's queue, so D's copy is replaced; so is the
        # stale copy of a full queue whose replication resumes.
        replace = new == Mode.FULL and (old == Mode.ENQUEUE or resumed)
        if replace:
            items.append((new, pc.QueueDelete(decision.target_name)))
        content = queue_content(
            state,
            q,
            decision,
            binds=old == Mode.NONE or replace,
            messages=old not in MESSAGE_MODES or replace,
        )
        if (
            len(content.messages) > SWITCH_EVENT_MAX_MESSAGES
            or sum(len(m.body) for m in content.messages) > SWITCH_EVENT_MAX_BYTES
        ):
            self._resync_instead = True
            return
        items.extend((new, cmd) for cmd in content.commands(self.rules))

    def _declare(
        self, state: SiteState, effects: Sequence[Any], items: list[tuple[Mode, pc.Command]]
    ) -> None:
        for e in effects:
            if isinstance(e, st.QueueDeclared):
                previous = None if e.created else self.rules.decisions.get(e.queue)
                decision = self.rules.decide_queue(e.queue, e.args)
                q = state.queues.get(e.queue)
                if previous is not None and previous.mode != decision.mode and q is not None:
                    resumed = previous.rule_name == PAUSED
                    self._queue_change(state, q, previous.mode, decision, items, resumed=resumed)
                    continue
                if decision.mode == Mode.NONE:
                    self._filtered(decision)
                    continue
                items.append((decision.mode, pc.QueueDeclare(decision.target_name, dict(e.args))))

    def _verify(self, state: SiteState, items: list[tuple[Mode, pc.Command]]) -> None:
        """A verification point: what each queue D copies whole is, here and
        now (docs/operations.md, "Verifying the copies").  A queue some of
        whose messages the rules keep from D cannot be compared."""
        for q in state.queues.values():
            decision = self.rules.decisions.get(q.name)
            if decision is None or decision.mode not in MESSAGE_MODES:
                continue
            if not self.rules.forwards_every_message(q.name, q.args):
                continue
            if decision.mode == Mode.FULL:
                check = pc.Verify(decision.target_name, q.depth, digest=st.content_digest(q))
            else:
                newest = next(reversed(q.messages), 0)
                check = pc.Verify(decision.target_name, newest_pos=newest, last_pos=q.next_pos - 1)
            items.append((decision.mode, check))

    def _delete(self, effects: Sequence[Any], items: list[tuple[Mode, pc.Command]]) -> None:
        for e in effects:
            if isinstance(e, st.QueueDeleted):
                decision = self.rules.decisions.get(e.queue)
                self.rules.forget_queue(e.queue)
                if decision is not None and decision.mode != Mode.NONE:
                    items.append((decision.mode, pc.QueueDelete(decision.target_name)))

    def _publish(
        self,
        state: SiteState,
        cmd: pc.Publish,
        effects: Sequence[Any],
        items: list[tuple[Mode, pc.Command]],
    ) -> None:
        # The body and properties go into the event's bytes at once (the
        # encoding copies them), so they are not copied here.
        body = cmd.body
        for e in effects:
            if not isinstance(e, st.Enqueued):
                continue
            q = state.queues.get(e.queue)
            args = None if q is None else q.args
            decision = self.rules.decide_message(
                e.queue, args, cmd.exchange, cmd.routing_key, cmd.properties, len(body)
            )
            if isinstance(decision, Drop):
                self.dropped[decision.reason] += 1
                continue
            if decision.mode not in MESSAGE_MODES:
                self._filtered(decision)
                continue
            items.append(
                (
                    decision.mode,
                    pc.Enqueue(
                        decision.target_name,
                        e.pos,
                        body,
                        cmd.message_id,
                        cmd.properties,
                    ),
                )
            )

    def _dequeues(self, effects: Sequence[Any], items: list[tuple[Mode, pc.Command]]) -> None:
        for e in effects:
            if not isinstance(e, st.Dequeued):
                continue
            decision = self.rules.decisions.get(e.queue)
            if decision is None or decision.mode != Mode.FULL:
                continue
            items.append((Mode.FULL, pc.Dequeue(decision.target_name, e.positions)))

    def _switch(self, state: SiteState, cmd: pc.RulesSwitch) -> None:
        failure = f"rules switch at cseq {state.cseq} not applied"
        if self._take_rules(bytes(cmd.payload), state.cseq, failure):
            self._decide_all(state)

    def statistics(self) -> TapStatistics:
        return TapStatistics(
            commands_total=dict(self.commands),
            forwarded_total=dict(self.forwarded),
            filtered_total=dict(self.filtered),
            dropped_total=dict(self.dropped),
            paused=tuple(
                sorted(q for q, d in self.rules.decisions.items() if d.rule_name == PAUSED)
            ),
        )
