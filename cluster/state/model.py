"""The data a site's state is made of, and the small pure helpers around it.

Everything here is plain mutable objects with ``__slots__``, changed only by
:mod:`cluster.state.machine`.  Collections are ``dict`` (insertion ordered)
or ``list``; sets are used only for membership tests, never iterated, so that
the same history gives the same iteration order on every member and after a
snapshot round trip.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cluster.state.effects import Message
from protocol.cluster import Bind, ExchangeDeclare, ExchangeType, QueueDeclare
from protocol.modes import MAX_COUNT_ARGS, MAX_SIZE_ARG, Mode, Role, limit_value
from protocol.values import Value, ValueMap

# --------------------------------------------------------------------------
# Session ids
# --------------------------------------------------------------------------

SESSION_NODE_BITS = 24
SESSION_PID_BITS = 24
SESSION_LOCAL_BITS = 16


def session_id(node: int, pid: int, local: int) -> int:
    """The u64 session id ``node << 40 | pid << 16 | local``.

    ``node`` and ``pid`` identify the bus member that owns the session (so
    :func:`cluster.state.members_left` can release the sessions of a member
    that left the view); ``local`` is the member's own number for it, which
    may wrap as long as the member never reuses the number of a session that
    is still open.  Raises ``ValueError`` when a part does not fit.
    """
    if not 0 <= node < 1 << SESSION_NODE_BITS:
        raise ValueError(f"node id {node} does not fit in {SESSION_NODE_BITS} bits")
    if not 0 <= pid < 1 << SESSION_PID_BITS:
        raise ValueError(f"pid {pid} does not fit in {SESSION_PID_BITS} bits")
    if not 0 <= local < 1 << SESSION_LOCAL_BITS:
        raise ValueError(f"local session number {local} does not fit in {SESSION_LOCAL_BITS} bits")
    return (node << 40) | (pid << 16) | local


# The queue argument that makes a queue temporary (an AMQP dynamic node):
# the owning session, as ``0x...`` text.  The queue is deleted when that
# session closes (its connection ends, or its member leaves the view).
TEMPORARY_ARG = "drgate.temporary"


def session_owner(session: int) -> tuple[int, int]:
    """``(node, pid)`` of the member that owns ``session``."""
    return session >> 40, (session >> 16) & ((1 << SESSION_PID_BITS) - 1)


# --------------------------------------------------------------------------
# Topic matching
# --------------------------------------------------------------------------

_TOPIC_CACHE: dict[str, tuple[str, ...]] = {}


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic match: words separated by ``.``; ``*`` is exactly one word,
    ``#`` is zero or more words."""
    words = _TOPIC_CACHE.get(pattern)
    if words is None:
        if len(_TOPIC_CACHE) > 4096:
            _TOPIC_CACHE.clear()
        words = _TOPIC_CACHE[pattern] = tuple(pattern.split("."))
    if "#" not in words and "*" not in words:
        return pattern == key
    return _match(words, 0, key.split("."), 0)


def _match(p: tuple[str, ...], i: int, k: list[str], j: int) -> bool:
    while i < len(p):
        w = p[i]
        if w == "#":
            # Collapse runs of '#', then try every split point.
            while i + 1 < len(p) and p[i + 1] == "#":
                i += 1
            if i + 1 == len(p):
                return True
            return any(_match(p, i + 1, k, jj) for jj in range(j, len(k) + 1))
        if j >= len(k):
            return False
        if w != "*" and w != k[j]:
            return False
        i += 1
        j += 1
    return j == len(k)


# --------------------------------------------------------------------------
# Queues
# --------------------------------------------------------------------------


class Replica:
    """A queue that is a copy of ``origin``'s queue of the same name."""

    __slots__ = ("high_pos", "mode", "origin")

    def __init__(self, origin: str, mode: Mode, high_pos: int = 0) -> None:
        self.origin = origin
        self.mode = mode
        self.high_pos = high_pos  # highest origin pos received (resync mark)


class Queue:
    """A FIFO queue.  ``messages`` is ordered by ``pos`` (append only; a
    released message stays in place).  ``acquired`` maps pos to
    ``(session, consumer)``.  ``waiting`` maps ``(session, consumer)`` to the
    messages its acquires asked for and did not get (its standing demand;
    cluster/state/demand.py), in the order the next message goes round.
    ``available`` is a min-heap of positions that may be available (entries
    of removed messages are skipped lazily): it is derived data, rebuilt on
    restore and never part of a snapshot."""

    __slots__ = (
        "acquired",
        "args",
        "available",
        "bytes",
        "max_count",
        "max_size",
        "messages",
        "name",
        "next_pos",
        "replica",
        "stale",
        "waiting",
    )

    def __init__(self, name: str, args: ValueMap, replica: Replica | None = None) -> None:
        self.name = name
        self.args: dict[str, Value] = dict(args)
        self.messages: dict[int, Message] = {}
        self.acquired: dict[int, tuple[int, int]] = {}
        self.waiting: dict[tuple[int, int], int] = {}
        self.available: list[int] = []
        self.stale = 0
        self.next_pos = 1
        self.bytes = 0
        self.replica = replica
        self.max_count: int | None = None
        self.max_size: int | None = None
        self.set_limits()

    def set_limits(self) -> None:
        self.max_count = None
        for key in MAX_COUNT_ARGS:
            if key in self.args:
                self.max_count = limit_value(self.args[key])
                break
        self.max_size = limit_value(self.args[MAX_SIZE_ARG]) if MAX_SIZE_ARG in self.args else None

    @property
    def depth(self) -> int:
        return len(self.messages)

    def append(self, msg: Message) -> None:
        self.messages[msg.pos] = msg
        self.bytes += len(msg.body)
        heapq.heappush(self.available, msg.pos)
        if msg.pos >= self.next_pos:
            self.next_pos = msg.pos + 1

    def extend(self, msgs: list[Message]) -> None:
        """Append ``msgs`` (ascending positions above every held one) at once:
        what a resync installs, at C speed rather than per message."""
        if not msgs:
            return
        self.messages.update((m.pos, m) for m in msgs)
        self.bytes += sum(len(m.body) for m in msgs)
        self.available.extend(m.pos for m in msgs)
        heapq.heapify(self.available)
        self.next_pos = max(self.next_pos, msgs[-1].pos + 1)

    def take(
        self,
        count: int,
        link: tuple[int, int] = (0, 0),
        match: Callable[[Message], bool] | None = None,
    ) -> list[int]:
        """Pop up to ``count`` available positions, lowest first, passing
        over the messages ``link`` (session, consumer) refused as
        undeliverable-here and, with ``match``, those it does not accept
        (they stay available to other links, in their place)."""
        out: list[int] = []
        heap = self.available
        messages = self.messages
        acquired = self.acquired
        passed: list[int] = []
        while heap and len(out) < count:
            pos = heapq.heappop(heap)
            msg = messages.get(pos)
            if msg is None or pos in acquired:
                self.stale -= 1
            elif (msg.refused and link in msg.refused) or (match is not None and not match(msg)):
                passed.append(pos)
            else:
                out.append(pos)
        for pos in passed:
            heapq.heappush(heap, pos)
        return out

    def make_available(self, pos: int) -> None:
        heapq.heappush(self.available, pos)

    def remove(self, pos: int) -> Message:
        """Remove a message (available or acquired).  The caller updates the
        owning session if it was acquired."""
        msg = self.messages.pop(pos)
        self.bytes -= len(msg.body)
        if self.acquired.pop(pos, None) is None:
            # Its heap entry is now stale; compact when stale entries dominate.
            self.stale += 1
            if self.stale > 1024 and self.stale * 2 > len(self.available):
                self.rebuild_available()
        return msg

    def rebuild_available(self) -> None:
        acquired = self.acquired
        self.available = [p for p in self.messages if p not in acquired]  # sorted: a heap
        self.stale = 0

    def available_count(self) -> int:
        return len(self.messages) - len(self.acquired)

    def held_after(self, after: int) -> Iterator[Message]:
        """The messages above position ``after``, lowest first.  Costs the
        positions walked, gaps included, except the gap below the first
        message held (``messages`` is in position order), which is skipped
        at once: a caller that remembers where it stopped pays each
        position once."""
        messages = self.messages
        if messages:
            after = max(after, next(iter(messages)) - 1)
        for pos in range(after + 1, self.next_pos):
            msg = messages.get(pos)
            if msg is not None:
                yield msg

    def browse(
        self, after: int, count: int, match: Callable[[Message], bool] | None = None
    ) -> tuple[list[Message], int]:
        """Up to ``count`` messages above position ``after``, lowest first,
        acquired or not (what a browsing consumer sees; nothing changes), and
        the position to continue after.  With ``match``, only those it
        accepts (the others are passed over for good)."""
        out: list[Message] = []
        for msg in self.held_after(after):
            if len(out) >= count:
                break
            after = msg.pos
            if match is None or match(msg):
                out.append(msg)
        if len(out) < count:
            after = max(after, self.next_pos - 1)  # every position is walked
        return out, after

    def count_matching(
        self, after: int, limit: int, match: Callable[[Message], bool]
    ) -> tuple[int, int]:
        """How many available messages above position ``after`` ``match``
        accepts, counting up to ``limit`` (read-only), and the position up to
        which none is: every message at or below it is acquired or not
        accepted, so a caller may start there next time, until a release
        makes one available again."""
        found = 0
        clear = after
        acquired = self.acquired
        for msg in self.held_after(after):
            if found >= limit:
                break
            if msg.pos not in acquired and match(msg):
                found += 1
            elif not found:
                clear = msg.pos
        if not found:
            clear = max(clear, self.next_pos - 1)
        return found, clear


# --------------------------------------------------------------------------
# Exchanges
# --------------------------------------------------------------------------

PREDECLARED: tuple[tuple[str, ExchangeType], ...] = (
    ("", ExchangeType.DIRECT),
    ("amq.direct", ExchangeType.DIRECT),
    ("amq.fanout", ExchangeType.FANOUT),
    ("amq.topic", ExchangeType.TOPIC),
)


class Exchange:
    """An exchange and its bindings.  ``bindings`` maps ``(queue, key)`` to the
    binding arguments, in binding order."""

    __slots__ = ("args", "bindings", "name", "predeclared", "replica_origin", "type")

    def __init__(
        self,
        name: str,
        type_: ExchangeType,
        args: ValueMap,
        *,
        predeclared: bool = False,
        replica_origin: str = "",
    ) -> None:
        self.name = name
        self.type = type_
        self.args: dict[str, Value] = dict(args)
        self.bindings: dict[tuple[str, str], dict[str, Value]] = {}
        self.predeclared = predeclared
        self.replica_origin = replica_origin

    def route(self, routing_key: str) -> Iterator[str]:
        """Bound queue names matching ``routing_key``, in binding order
        (duplicates possible: the caller dedups)."""
        if self.type == ExchangeType.FANOUT:
            for queue, _key in self.bindings:
                yield queue
        elif self.type == ExchangeType.DIRECT:
            for queue, key in self.bindings:
                if key == routing_key:
                    yield queue
        else:
            for queue, key in self.bindings:
                if topic_matches(key, routing_key):
                    yield queue


# --------------------------------------------------------------------------
# Sessions, origins, the site
# --------------------------------------------------------------------------


class Session:
    """An open session and what it holds: queue -> pos -> consumer, in
    acquisition order."""

    __slots__ = ("acquired", "id")

    def __init__(self, id_: int) -> None:
        self.id = id_
        self.acquired: dict[str, dict[int, int]] = {}


class Origin:
    """What this site knows of a site that replicates into it.

    ``incarnation`` is the accepted incarnation (0: none yet; the first
    ``Replicated`` command seen is accepted).  ``applied`` maps incarnation to
    the highest origin cseq applied (R1).  ``epoch`` is the accepted epoch
    (R7); ``promoted`` is set by :class:`~protocol.cluster.Promote` and
    cleared by a ``Replicated`` command of a higher epoch than the promotion's.
    """

    __slots__ = (
        "applied",
        "epoch",
        "incarnation",
        "last_cseq",
        "last_time_us",
        "name",
        "promoted",
        "promoted_time_us",
        "refused_incarnation",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.incarnation = 0
        self.applied: dict[int, int] = {}
        self.epoch = 0
        self.promoted = False
        self.promoted_time_us = 0
        self.last_time_us = 0  # origin time of the last applied command (RPO)
        self.last_cseq = 0  # this site's cseq when it was applied
        self.refused_incarnation = 0  # last incarnation refused, for the operator


COUNTERS: tuple[str, ...] = (
    # merge rules at D
    "r1_duplicates",
    "r3_refused",
    "r4_dequeues_ignored",
    "r5_conflicts",
    "r6_conflicts",
    "r7_fenced",
    "incarnation_refused",
    "own_origin_refused",
    "replicated_applied",
    "replicated_stale_enqueues",
    "replicated_unsupported",
    "replicated_missing_queue",
    "replicated_over_limit",
    "resync_pieces_staged",
    "resync_pieces_refused",
    "resync_commits_refused",
    # a failback by delta: snapshot bytes staged, messages kept instead of
    # shipped and what they would have taken, Keeps that did not match
    "resync_bytes_staged",
    "resync_kept_messages",
    "resync_kept_bytes",
    "resync_keep_refused",
    # local commands
    "refused",
    "max_depth_refused",
    "stale_settlements",
    "ignored",
)
"""Counter names, in the fixed order of ``statistics()`` and snapshots."""


class StagedQueue:
    """A queue of a resync being staged: its declare, and the origin's
    messages at the cut (``pos`` and ``origin_pos`` are the origin's)."""

    __slots__ = ("declare", "messages", "mode")

    def __init__(self, mode: Mode, declare: QueueDeclare) -> None:
        self.mode = mode
        self.declare = declare
        self.messages: list[Message] = []


class StagedResync:
    """What the ``ResyncStage`` pieces of one resync carried so far: decoded,
    held apart from the queues until the ``ResyncCommit`` installs it."""

    __slots__ = ("binds", "cut", "epoch", "exchanges", "incarnation", "pieces", "queues")

    def __init__(self, incarnation: int, cut: int, epoch: int) -> None:
        self.incarnation = incarnation
        self.cut = cut
        self.epoch = epoch
        self.pieces = 0
        self.exchanges: dict[str, ExchangeDeclare] = {}
        self.queues: dict[str, StagedQueue] = {}
        self.binds: list[Bind] = []

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.incarnation, self.cut, self.epoch, self.pieces)


@dataclass(frozen=True, slots=True)
class Recovery:
    """A whole-site recovery (cluster/state/persistence.py ``take_recovery``):
    the site's ``count``-th, which continued from a broker journal's cseq
    ``cseq``; ``dropped`` says whether it dropped transient state.  Events
    a sidecar spooled above ``cseq`` before it never happened in the site's
    history, and D may hold transient state the site lost when ``dropped``."""

    count: int
    cseq: int
    dropped: bool


class SiteState:
    """The whole state of a site, as every member holds it.

    Build with :func:`cluster.state.new_state`; change only with
    :func:`cluster.state.apply` and :func:`cluster.state.members_left`.
    """

    __slots__ = (
        "candidates",
        "cluster",
        "counters",
        "cseq",
        "demand",
        "durable_cseq",
        "epoch",
        "exchanges",
        "failback_cseq",
        "failback_queues",
        "guarded",
        "handed_to",
        "handover_cseq",
        "handovers",
        "incarnation",
        "origins",
        "queues",
        "ready",
        "recoveries",
        "recovery_expect",
        "recovery_winner",
        "rejoining",
        "reported",
        "rules",
        "rules_cseq",
        "sessions",
        "staged",
        "superseded_by",
        "superseded_time_us",
        "swapped",
        "switchover_time_us",
        "switchover_to",
        "watermarks",
    )

    def __init__(self) -> None:
        self.cluster = ""
        self.incarnation = 0
        self.cseq = 0
        self.queues: dict[str, Queue] = {}
        self.exchanges: dict[str, Exchange] = {}
        self.sessions: dict[int, Session] = {}
        # The queues whose ``waiting`` is not empty (derived: rebuilt on
        # restore), so that a command finds at once whether any consumer
        # waits for what it made available (cluster/state/demand.py).
        self.demand: dict[str, None] = {}
        self.origins: dict[str, Origin] = {}
        self.ready: dict[tuple[int, int], Role] = {}
        self.rules = b""
        self.rules_cseq = 0
        self.watermarks: dict[str, tuple[int, int, int]] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.reported: dict[tuple[str, str], None] = {}
        self.staged: dict[str, StagedResync] = {}  # per origin, a resync being staged
        # This site's own stream: its epoch (SetEpoch), and the site promoted
        # over it (Superseded) with the queues whose publishes are refused.
        self.epoch = 1
        self.superseded_by = ""
        self.superseded_time_us = 0
        self.guarded: dict[str, None] = {}
        # A planned switchover under way (Switchover QUIESCE): the DR site it
        # hands over to and since when; ``guarded`` holds the quiesced queues.
        self.switchover_to = ""
        self.switchover_time_us = 0
        # Its HANDOVER's cseq once sent: the guarded queues are frozen from
        # there (a settlement after it could never reach the DR site).
        self.handover_cseq = 0
        # The sites swapped roles in place (a planned switchover): this site
        # runs in the role opposite to its sidecars' configured one, the
        # primary of a DR site that handed over to it, or the DR site of the
        # one it handed over to (cluster/state/switchover.py).
        self.swapped = False
        # The primary this site handed over to and is the DR site of now (a
        # swap): ``guarded`` stays closed to publishes, whose clients belong
        # at that primary, until this site is the primary again.
        self.handed_to = ""
        # A failback by delta here (Switchover REJOIN): the primary this site
        # becomes the DR site of, until that site's resync is installed;
        # ``guarded`` is frozen meanwhile, and this site's ingress tells that
        # primary what it holds (cluster/state/switchover.py).
        self.rejoining = ""
        # At a DR site: the origins promoted over by their own handover (not a
        # split brain when they knock), until a failback.
        self.handovers: dict[str, None] = {}
        # After a failback here (SetEpoch while superseded): its cseq, until
        # the DR site acknowledged P's stream up to it (AckWatermark); the
        # ``failback_queues`` take publishes again but give consumers nothing
        # until then (cluster/state/switchover.py).  0: none.
        self.failback_cseq = 0
        # The queues that wait for it: those the rules replicate with messages
        # (Superseded names them all; ``guarded`` only those the guard closed).
        self.failback_queues: dict[str, None] = {}
        # Journals (cluster/journal.py): the highest cseq a broker has on disk
        # (Durable), and, while a site that started with no member alive waits
        # for its brokers, what each recovered: node -> (pid, cseq,
        # incarnation, proposal), how many it waits for, and the broker chosen.
        self.durable_cseq = 0
        self.candidates: dict[int, tuple[int, int, int, int]] = {}
        self.recovery_expect = 0
        self.recovery_winner: tuple[int, int] | None = None
        # Every whole-site recovery of this site, oldest first.
        self.recoveries: list[Recovery] = []

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n


def new_state() -> SiteState:
    """An empty site: no incarnation yet, cseq 0, the predeclared exchanges."""
    state = SiteState()
    for name, type_ in PREDECLARED:
        state.exchanges[name] = Exchange(name, type_, {}, predeclared=True)
    return state


def describe_args(args: ValueMap) -> str:
    """Arguments as ``{k=v, ...}`` text for messages to people."""
    return "{" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + "}"
