"""Effects: what :func:`cluster.state.apply` tells the node (and the tap) to do.

Every effect is a frozen slotted dataclass.  ``apply`` returns them in a
deterministic order; every member of a site gets the same list for the same
command, and each member acts only on the ones that concern it (its own
sessions, its own publishes: compare ``sender`` with the member's own id, or
``session_owner(session)`` with ``(node, pid)``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from protocol.modes import Mode
from protocol.quickinit import quick_init
from protocol.values import ValueMap

if TYPE_CHECKING:
    from cluster.state.model import SiteState


class Sender(Protocol):
    """Who multicast a command: anything with ``node`` and ``pid`` (the bus's
    ``MemberId`` fits).  Read-only attributes, so frozen dataclasses match."""

    @property
    def node(self) -> int: ...

    @property
    def pid(self) -> int: ...


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class Message:
    """One message on a queue (immutable; a release makes a new one).

    ``pos`` is the position on this site's queue.  ``origin_pos`` is the
    position on the origin site's queue for a message that arrived by
    replication (0 for a message published here).  The message's identity
    across sites is ``(origin incarnation, queue, identity_pos)``.

    ``body`` is the encoded AMQP message as its publisher sent it, never
    changed.  What the site's brokers own is kept beside it and put over it
    when the message goes out (protocol/amqpsections.py):
    ``delivery_count`` is added to the header's delivery count (failed
    deliveries: ``modified`` with delivery-failed, a consumer gone with the
    message unsettled), ``annotations`` is an encoded AMQP map merged over
    the message annotations (from ``modified`` outcomes), and ``refused``
    holds the ``(session, consumer)`` links that called it
    undeliverable-here, which never acquire it again.
    """

    pos: int
    body: bytes
    message_id: str = ""
    properties: ValueMap | None = None
    delivery_count: int = 0
    origin_pos: int = 0
    annotations: bytes = b""
    refused: tuple[tuple[int, int], ...] = ()

    @property
    def identity_pos(self) -> int:
        return self.origin_pos or self.pos

    @property
    def redelivered(self) -> bool:
        """It went out before: the client may have seen it."""
        return self.delivery_count > 0


class Reason(enum.StrEnum):
    """Why a local command was refused (``Refused.reason``) -- stable strings
    used in counters and metrics."""

    READ_ONLY = "read_only"  # R3: full replica while replication is active
    UNKNOWN_QUEUE = "unknown_queue"
    UNKNOWN_EXCHANGE = "unknown_exchange"
    UNKNOWN_SESSION = "unknown_session"
    MAX_DEPTH = "max_depth"
    INVALID_ARGUMENT = "invalid_argument"
    PREDECLARED = "predeclared"
    TYPE_MISMATCH = "type_mismatch"
    NOT_OWNER = "not_owner"
    SUPERSEDED = "superseded"  # another site was promoted over this one
    SWITCHOVER = "switchover"  # a planned switchover closed the queue


CONDITIONS: dict[Reason, str] = {
    Reason.READ_ONLY: "amqp:not-allowed",
    Reason.SUPERSEDED: "amqp:precondition-failed",
    Reason.SWITCHOVER: "amqp:precondition-failed",
    Reason.UNKNOWN_QUEUE: "amqp:not-found",
    Reason.UNKNOWN_EXCHANGE: "amqp:not-found",
    Reason.UNKNOWN_SESSION: "amqp:illegal-state",
    Reason.MAX_DEPTH: "amqp:resource-limit-exceeded",
    Reason.INVALID_ARGUMENT: "amqp:invalid-field",
    Reason.PREDECLARED: "amqp:not-allowed",
    Reason.TYPE_MISMATCH: "amqp:precondition-failed",
    Reason.NOT_OWNER: "amqp:not-allowed",
}
"""The AMQP 1.0 error condition sent to a client for each refusal reason."""


class Outcome(enum.StrEnum):
    """What became of one ``Replicated`` command (``ReplicatedOutcome``)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # R1: origin_cseq at or below applied[incarnation]
    FENCED = "fenced"  # R7: older epoch, or this site promoted itself
    INCARNATION = "incarnation"  # an incarnation the operator has not accepted
    OWN_ORIGIN = "own_origin"  # the command came from this very site


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class Delivered:
    """``message`` was acquired by ``session``'s ``consumer``: the member that
    owns the session sends it to its client."""

    queue: str
    session: int
    consumer: int
    message: Message


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class Enqueued:
    """A message landed on ``queue`` at ``pos`` (a local publish, one effect
    per target queue; or a replicated enqueue, ``origin_pos`` set).  The tap
    uses it to learn the pos each target queue assigned."""

    queue: str
    pos: int
    origin_pos: int = 0


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class Dequeued:
    """Messages left ``queue`` for good.  ``reason``: ``"accept"`` (a local
    consumer accepted), ``"purge"``, ``"dequeue"`` (a replicated dequeue).
    Positions are this site's positions, in the order removed."""

    queue: str
    positions: tuple[int, ...]
    reason: str


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class Released:
    """Messages acquired by ``session`` are available again (in place).
    ``reason``: ``"release"``, ``"session_close"``, ``"member_left"``,
    ``"site_restart"``."""

    queue: str
    session: int
    positions: tuple[int, ...]
    reason: str


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class Settled:
    """The publish ``ref`` of member ``sender`` was applied: settle it.
    ``queues`` are the queues it was routed to (may be empty: unroutable
    messages are dropped, as Qpid does)."""

    ref: int
    sender: Any
    queues: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Refused:
    """A local command was not applied.  ``ref`` is the publish ref (0 for
    other commands), ``session`` the session (0 if none), ``condition`` the
    AMQP error condition, ``description`` a sentence for a person naming the
    queue or exchange and the reason (and the way out, if there is one)."""

    sender: Any
    ref: int
    session: int
    name: str
    reason: Reason
    condition: str
    description: str


@dataclass(frozen=True, slots=True)
class QueueDeclared:
    """A queue was created (``created``) or re-declared with new arguments."""

    queue: str
    created: bool
    args: ValueMap
    replica_mode: Mode | None


@dataclass(frozen=True, slots=True)
class QueueDeleted:
    """A queue is gone; ``discarded`` messages went with it.  The node detaches
    the consumers of the queue."""

    queue: str
    discarded: int


@dataclass(frozen=True, slots=True)
class Conflict:
    """R6: a remote declare (or delete) hit a name that exists here and is not
    a replica of that origin.  Reported once per (origin, name) until the local
    object is deleted; counted every time.  ``local`` and ``remote`` are the
    two definitions, as text."""

    rule: str
    origin_cluster: str
    name: str
    local: str
    remote: str
    description: str


@quick_init  # one or more per message at every member
@dataclass(frozen=True, slots=True)
class ReplicatedOutcome:
    """What became of a ``Replicated`` command.  The ingress acks by it; the
    node and metrics count it."""

    origin_cluster: str
    incarnation: int
    origin_cseq: int
    epoch: int
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Promoted:
    """This site stopped accepting ``origin_cluster`` below ``epoch``; its
    replicas of that origin are writable."""

    origin_cluster: str
    epoch: int


@dataclass(frozen=True, slots=True)
class IncarnationAccepted:
    origin_cluster: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class GenesisApplied:
    """A Genesis command: ``accepted`` is False when the site already had an
    incarnation (later Genesis commands are ignored)."""

    cluster: str
    incarnation: int
    accepted: bool


@dataclass(frozen=True, slots=True)
class Verified:
    """A ``Verify`` of ``origin``'s stream compared this site's replica
    ``queue`` (``mode``) with the origin's queue at origin cseq
    ``origin_cseq``: ``ok``, or ``detail`` says what differs."""

    origin: str
    queue: str
    mode: Mode
    origin_cseq: int
    ok: bool
    detail: str


Effect: TypeAlias = (
    Delivered
    | Enqueued
    | Dequeued
    | Released
    | Settled
    | Refused
    | QueueDeclared
    | QueueDeleted
    | Conflict
    | ReplicatedOutcome
    | Promoted
    | IncarnationAccepted
    | GenesisApplied
    | Verified
)

Effects: TypeAlias = list[Effect]
"""What applying one command produced, in order (every handler appends to one)."""


def refuse(
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
    """Refuse a command (or a waiting consumer's demand) on ``name``: count
    it in ``state``'s counters and append the ``Refused`` for ``sender``."""
    state.count("refused")
    if reason is Reason.READ_ONLY:
        state.count("r3_refused")
    elif reason is Reason.MAX_DEPTH:
        state.count("max_depth_refused")
    eff.append(Refused(sender, ref, session, name, reason, CONDITIONS[reason], description))
