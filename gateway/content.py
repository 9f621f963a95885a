"""A queue's replication content: what D needs to hold one of P's queues.

Both ways P brings D up to date with a whole queue read it from here: a
resync snapshot (gateway/resync.py) takes it for every replicated queue, and
the tap (gateway/tap.py) for each queue whose mode a rules switch or a
re-declare changed.  The content is, in the queue's mode and D's name for the
queue (the rules' decision):

* its declare, with the queue's arguments;
* its bindings (the default exchange's implicit ones excepted), in binding
  order;
* for ``full`` and ``enqueue`` queues, its messages in FIFO order with P's
  positions, minus those the per-message rules would not forward.

Pure: it reads the state and the rules, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cluster.state.effects import Message
from cluster.state.model import Queue, SiteState
from filters.matcher import Decision, Drop, RuleSet
from protocol import cluster as pc
from protocol.modes import Mode
from protocol.values import Value

MESSAGE_MODES = (Mode.FULL, Mode.ENQUEUE)
"""The modes that forward messages."""


@dataclass(slots=True)
class QueueContent:
    """One queue's content as of the cseq it was taken at.

    It holds references (the messages are immutable), so taking it costs a
    list copy and the state may move on while it is encoded.  ``name`` is the
    queue at P, ``target`` its name at D.
    """

    name: str
    target: str
    mode: Mode
    args: dict[str, Value]
    binds: list[pc.Bind]
    messages: list[Message]
    replica_of: str = ""
    """The site it is a replica of here ("": a queue of this site's own)."""

    def wiring(self) -> list[pc.Command]:
        """The declare, then the bindings."""
        return [pc.QueueDeclare(self.target, self.args), *self.binds]

    def enqueue(self, rules: RuleSet, m: Message) -> pc.Enqueue | None:
        """The ``Enqueue`` of one of :attr:`messages`, or None when the
        per-message rules of ``rules`` would not forward it."""
        # The publish's exchange and routing key are not kept with a message:
        # message rules are judged as for the default exchange.
        decision = rules.decide_message(
            self.name, self.args, "", self.name, m.properties, len(m.body)
        )
        if isinstance(decision, Drop) or decision.mode not in MESSAGE_MODES:
            return None
        return pc.Enqueue(
            self.target, m.pos, m.body, m.message_id, dict(m.properties or {}), m.redelivered
        )

    def commands(self, rules: RuleSet) -> Iterator[pc.Command]:
        """All of it, in order: :meth:`wiring`, then the forwarded enqueues."""
        yield from self.wiring()
        for m in self.messages:
            enqueue = self.enqueue(rules, m)
            if enqueue is not None:
                yield enqueue


def queue_content(
    state: SiteState, q: Queue, decision: Decision, *, binds: bool = True, messages: bool = True
) -> QueueContent:
    """The content of ``q`` in ``decision``'s mode and target name, as of
    ``state.cseq``.  ``binds=False`` leaves the bindings out; ``messages=False``
    the messages (a mode that does not forward messages has none anyway)."""
    bound = (
        [
            pc.Bind(x.name, decision.target_name, key, dict(args))
            for x in state.exchanges.values()
            if x.name != ""
            for (queue, key), args in x.bindings.items()
            if queue == q.name
        ]
        if binds
        else []
    )
    held = list(q.messages.values()) if messages and decision.mode in MESSAGE_MODES else []
    origin = "" if q.replica is None else q.replica.origin
    return QueueContent(
        q.name, decision.target_name, decision.mode, dict(q.args), bound, held, origin
    )
