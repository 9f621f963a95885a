"""Bus commands: what brokers, sidecars and tools multicast on a site bus.

Theory of operation
-------------------
Every state change at a site is a *command*.  Members multicast commands on
the site bus in *frames* (one bus message = one frame = a list of commands)
and every member applies the delivered frames in the bus's agreed order.  Each
command a member applies gets the next ``cseq`` (section 5 of the design), so
the i-th command of the j-th frame has the same ``cseq`` everywhere.

A frame is laid out so that the hot path (the tap, the broker's dispatcher)
can learn each command's kind, primary name (queue or exchange) and size with
one ``struct.iter_unpack`` over a fixed-size index, without decoding the rest:

    frame  := header index data
    header := version u8 | flags u8 | count u16                     (4 bytes)
    index  := count x ( kind u8 | reserved u8 | key_len u16 | rest_len u32 )
    data   := for each command: key (key_len bytes, UTF-8) rest (rest_len bytes)
    rest   := meta_len u32 | meta (meta_len bytes, per-kind construct) | tail

``key`` is the command's primary name (a queue, an exchange, or empty).
``meta`` holds the other fields as a compiled construct struct.  ``tail`` is
the bulk payload (a message body, a snapshot chunk, a rules file) and is
handed out as a ``memoryview`` of the frame, never copied.  All integers are
big-endian.

Each kind is declared once, by the ``@_command`` decorator on its dataclass:
which attribute is the key, the meta fields in wire order, which attribute is
the tail.  Encoding, decoding and the frame scan all read that declaration
(the ``_CODECS`` registry); nothing else lists the kinds but :class:`Kind`,
the table of wire numbers.

Decoding network bytes is done only by the ``*_untrusted`` functions, which
fail only with :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from construct import (
    ConstructError,
    Flag,
    Int8ub,
    Int32ub,
    Int64ub,
)

# Re-exported: the kinds, the payload type and the registry (its users read
# them from here).
from protocol.commandcodec import _CODEC_OF as _CODEC_OF  # noqa: PLC0414
from protocol.commandcodec import _CODECS as _CODECS  # noqa: PLC0414
from protocol.commandcodec import (
    _MAP,
    _MODES,
    _POSITIONS,
    _STR,
    _Codec,
    _command,
    _CommandBase,
    _tuple,
)
from protocol.commandcodec import Body as Body  # noqa: PLC0414
from protocol.commandcodec import ExchangeType as ExchangeType  # noqa: PLC0414
from protocol.commandcodec import Kind as Kind  # noqa: PLC0414
from protocol.commandcodec import MetaField as MetaField  # noqa: PLC0414

# Re-exported: the commands of durable brokers (their journals, whole-site
# recovery, a joiner's delta transfer) live in protocol/durablecommands.py.
from protocol.durablecommands import Durable as Durable  # noqa: PLC0414
from protocol.durablecommands import ForceRecovery as ForceRecovery  # noqa: PLC0414
from protocol.durablecommands import JoinHave as JoinHave  # noqa: PLC0414
from protocol.durablecommands import Recovering as Recovering  # noqa: PLC0414
from protocol.durablecommands import RecoveryChunk as RecoveryChunk  # noqa: PLC0414
from protocol.durablecommands import have_ranges_untrusted as have_ranges_untrusted  # noqa: PLC0414
from protocol.durablecommands import pack_have_ranges as pack_have_ranges  # noqa: PLC0414
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.modes import Mode, Role
from protocol.resynccommands import Keep as Keep  # noqa: PLC0414
from protocol.resynccommands import ResyncApply as ResyncApply  # noqa: PLC0414
from protocol.resynccommands import ResyncCommit as ResyncCommit  # noqa: PLC0414
from protocol.resynccommands import ResyncStage as ResyncStage  # noqa: PLC0414
from protocol.switchovercommands import Switchover as Switchover  # noqa: PLC0414
from protocol.switchovercommands import SwitchoverPhase as SwitchoverPhase  # noqa: PLC0414
from protocol.values import ValueMap
from protocol.verifycommands import Verify as Verify  # noqa: PLC0414
from protocol.verifycommands import VerifyPoint as VerifyPoint  # noqa: PLC0414

VERSION = 1
"""The bus frame version this code writes and reads.  A frame of any other
version is refused: members of a site run the same drgate release."""

MAX_COMMANDS_PER_FRAME = 0xFFFF

#   version u8 | flags u8 | count u16
FRAME_HEADER = struct.Struct(">BBH")
#   kind u8 | reserved u8 | key_len u16 | rest_len u32
INDEX_ENTRY = struct.Struct(">BBHI")
#   meta_len u32
META_LEN = struct.Struct(">I")


# key=queue  meta: args map
@_command(Kind.QUEUE_DECLARE, key="queue", meta=[("args", _MAP)])
@dataclass(frozen=True, slots=True)
class QueueDeclare(_CommandBase):
    queue: str
    args: ValueMap = field(default_factory=dict)


# key=queue  meta: (empty)
@_command(Kind.QUEUE_DELETE, key="queue")
@dataclass(frozen=True, slots=True)
class QueueDelete(_CommandBase):
    queue: str


# key=exchange  meta: type u8 | args map
@_command(
    Kind.EXCHANGE_DECLARE, key="exchange", meta=[("type", Int8ub, ExchangeType), ("args", _MAP)]
)
@dataclass(frozen=True, slots=True)
class ExchangeDeclare(_CommandBase):
    exchange: str
    type: ExchangeType = ExchangeType.DIRECT
    args: ValueMap = field(default_factory=dict)


# key=exchange  meta: (empty)
@_command(Kind.EXCHANGE_DELETE, key="exchange")
@dataclass(frozen=True, slots=True)
class ExchangeDelete(_CommandBase):
    exchange: str


# key=exchange  meta: queue str16 | binding_key str16 | args map
@_command(Kind.BIND, key="exchange", meta=[("queue", _STR), ("binding_key", _STR), ("args", _MAP)])
@dataclass(frozen=True, slots=True)
class Bind(_CommandBase):
    exchange: str
    queue: str
    binding_key: str = ""
    args: ValueMap = field(default_factory=dict)


# key=exchange  meta: queue str16 | binding_key str16
@_command(Kind.UNBIND, key="exchange", meta=[("queue", _STR), ("binding_key", _STR)])
@dataclass(frozen=True, slots=True)
class Unbind(_CommandBase):
    exchange: str
    queue: str
    binding_key: str = ""


# The reserved key of Publish and Enqueue properties that carries the AMQP
# header's ``durable`` (true; absent: transient).  The broker sets it from the
# header and drops a client's application property of that name, so every
# member, the journal's replay and the other site see the same answer.
DURABLE_PROPERTY = "drgate.durable"


# key=exchange  meta: routing_key str16 | ref u64 | message_id str16 | properties map
#               tail: body
@_command(
    Kind.PUBLISH,
    key="exchange",
    meta=[
        ("routing_key", _STR),
        ("ref", Int64ub),
        ("message_id", _STR),
        ("properties", _MAP),
    ],
    tail="body",
)
@dataclass(frozen=True, slots=True)
class Publish(_CommandBase):
    """A client's message, routed through ``exchange`` by ``routing_key``.

    The default exchange ``""`` routes to the queue named by the routing key.
    ``ref`` is the publishing member's token for the client delivery, so that
    it can settle it when the command comes back on the bus.
    """

    exchange: str
    routing_key: str
    body: Body = b""
    message_id: str = ""
    properties: ValueMap = field(default_factory=dict)
    ref: int = 0


# key=queue  meta: session u64 | consumer u32 | count u32
@_command(
    Kind.ACQUIRE,
    key="queue",
    meta=[("session", Int64ub), ("consumer", Int32ub), ("count", Int32ub)],
)
@dataclass(frozen=True, slots=True)
class Acquire(_CommandBase):
    """Session ``session``'s consumer ``consumer`` takes the next ``count``
    available messages of ``queue`` (deterministic: the first in FIFO order);
    what it does not get stays asked for, and later messages go to it as they
    become available (its standing demand, until a :class:`Withdraw`)."""

    queue: str
    session: int
    consumer: int = 0
    count: int = 1


# key=queue  meta: session u64 | consumer u32
@_command(Kind.WITHDRAW, key="queue", meta=[("session", Int64ub), ("consumer", Int32ub)])
@dataclass(frozen=True, slots=True)
class Withdraw(_CommandBase):
    """Session ``session``'s consumer ``consumer`` no longer wants the
    messages its acquires asked for and did not get (its standing demand on
    ``queue``; docs/state.md "Standing demand"): its link closed, drained, or
    could not take a message."""

    queue: str
    session: int
    consumer: int = 0


# key=queue  meta: session u64 | consumer u32 | count u32 | selector str16
@_command(
    Kind.ACQUIRE_MATCHING,
    key="queue",
    meta=[("session", Int64ub), ("consumer", Int32ub), ("count", Int32ub), ("selector", _STR)],
)
@dataclass(frozen=True, slots=True)
class AcquireMatching(_CommandBase):
    """:class:`Acquire` of only the messages JMS selector ``selector``
    selects (cluster/selector.py), in FIFO order; the others stay for other
    consumers.  Every member evaluates the same selector on the same
    messages, so every member acquires the same ones."""

    queue: str
    session: int
    consumer: int = 0
    count: int = 1
    selector: str = ""


# key=queue  meta: session u64 | positions (u32 count + u64 each)
@_command(Kind.ACCEPT, key="queue", meta=[("session", Int64ub), ("positions", _POSITIONS, _tuple)])
@dataclass(frozen=True, slots=True)
class Accept(_CommandBase):
    """The messages at ``positions``, acquired by ``session``, are consumed."""

    queue: str
    session: int
    positions: tuple[int, ...]


# key=queue  meta: session u64 | redelivered u8 | positions
@_command(
    Kind.RELEASE,
    key="queue",
    meta=[("session", Int64ub), ("redelivered", Flag), ("positions", _POSITIONS, _tuple)],
)
@dataclass(frozen=True, slots=True)
class Release(_CommandBase):
    """The messages at ``positions`` go back to the queue, in their place."""

    queue: str
    session: int
    positions: tuple[int, ...]
    redelivered: bool = True


# key=queue  meta: session u64 | consumer u32 | delivery_failed u8
#                  | undeliverable_here u8 | positions
#            tail: annotations (an encoded AMQP map, or empty)
@_command(
    Kind.MODIFY,
    key="queue",
    meta=[
        ("session", Int64ub),
        ("consumer", Int32ub),
        ("delivery_failed", Flag),
        ("undeliverable_here", Flag),
        ("positions", _POSITIONS, _tuple),
    ],
    tail="annotations",
)
@dataclass(frozen=True, slots=True)
class Modify(_CommandBase):
    """A consumer settled the messages at ``positions`` with AMQP's
    ``modified`` outcome: they go back to the queue, in their place, like a
    :class:`Release`; ``delivery_failed`` raises each one's delivery count,
    ``undeliverable_here`` keeps them from ``session``'s ``consumer`` for
    good, and ``annotations`` (an encoded AMQP map, as the client sent it)
    is merged over their message annotations."""

    queue: str
    session: int
    consumer: int
    positions: tuple[int, ...]
    delivery_failed: bool = False
    undeliverable_here: bool = False
    annotations: Body = b""


# key=queue  meta: (empty)
@_command(Kind.PURGE, key="queue")
@dataclass(frozen=True, slots=True)
class Purge(_CommandBase):
    queue: str


# key=""  meta: session u64
@_command(Kind.SESSION_OPEN, meta=[("session", Int64ub)])
@dataclass(frozen=True, slots=True)
class SessionOpen(_CommandBase):
    session: int


# key=""  meta: session u64
@_command(Kind.SESSION_CLOSE, meta=[("session", Int64ub)])
@dataclass(frozen=True, slots=True)
class SessionClose(_CommandBase):
    """The session ended: everything it had acquired is released."""

    session: int


# key=""  meta: target_node u32 | target_pid u32 | transfer u32 | index u32 | final u8
#         tail: snapshot bytes
@_command(
    Kind.STATE_CHUNK,
    meta=[
        ("target_node", Int32ub),
        ("target_pid", Int32ub),
        ("transfer", Int32ub),
        ("index", Int32ub),
        ("final", Flag),
    ],
    tail="data",
)
@dataclass(frozen=True, slots=True)
class StateChunk(_CommandBase):
    """One piece of a snapshot sent by a donor to the joining member
    ``(target_node, target_pid)``; ``final`` marks the last piece."""

    target_node: int
    target_pid: int
    transfer: int
    index: int
    final: bool
    data: Body


# key=""  meta: (empty)  tail: the switch payload (filters/)
@_command(Kind.RULES_SWITCH, tail="payload")
@dataclass(frozen=True, slots=True)
class RulesSwitch(_CommandBase):
    """New replication rules, applied by every tap at this command's cseq.
    ``payload`` is opaque here: filters/ defines it."""

    payload: Body


# key=queue  meta: pos u64 | message_id str16 | properties map | redelivered u8
#            tail: body
@_command(
    Kind.ENQUEUE,
    key="queue",
    meta=[("pos", Int64ub), ("message_id", _STR), ("properties", _MAP), ("redelivered", Flag)],
    tail="body",
)
@dataclass(frozen=True, slots=True)
class Enqueue(_CommandBase):
    """Put a message on ``queue`` directly at origin position ``pos`` (used
    inside :class:`Replicated`, and by resync)."""

    queue: str
    pos: int
    body: Body = b""
    message_id: str = ""
    properties: ValueMap = field(default_factory=dict)
    redelivered: bool = False


# key=queue  meta: positions
@_command(Kind.DEQUEUE, key="queue", meta=[("positions", _POSITIONS, _tuple)])
@dataclass(frozen=True, slots=True)
class Dequeue(_CommandBase):
    """Remove the messages of origin positions ``positions`` from ``queue``."""

    queue: str
    positions: tuple[int, ...]


# key=origin cluster  meta: epoch u32 | time_us u64
@_command(Kind.PROMOTE, key="origin_cluster", meta=[("epoch", Int32ub), ("time_us", Int64ub)])
@dataclass(frozen=True, slots=True)
class Promote(_CommandBase):
    """D stops accepting ``origin_cluster``'s stream and raises its epoch."""

    origin_cluster: str
    epoch: int
    time_us: int


# key=origin cluster  meta: incarnation u64
@_command(Kind.ACCEPT_INCARNATION, key="origin_cluster", meta=[("incarnation", Int64ub)])
@dataclass(frozen=True, slots=True)
class AcceptIncarnation(_CommandBase):
    """The operator accepts a restarted primary's new incarnation."""

    origin_cluster: str
    incarnation: int


# key=origin cluster  meta: epoch u32
@_command(Kind.ACCEPT_PRIMARY, key="origin_cluster", meta=[("epoch", Int32ub)])
@dataclass(frozen=True, slots=True)
class AcceptPrimary(_CommandBase):
    """At a DR site promoted over ``origin_cluster``: the operator accepts its
    stream again, from ``epoch`` on (above the promotion's).  D's replicas of
    it are then replaced by a resync."""

    origin_cluster: str
    epoch: int


# key=""  meta: epoch u32
@_command(Kind.SET_EPOCH, meta=[("epoch", Int32ub)])
@dataclass(frozen=True, slots=True)
class SetEpoch(_CommandBase):
    """At a primary: its stream's epoch from now on (above the current one),
    as the DR site that accepts it again names it; lifts the zombie guard."""

    epoch: int


FAILBACK_ONLY = "failback"
"""A ``Superseded`` queue's value: open to publishes (the zombie guard does
not cover it), yet after a failback its consumers wait for the DR site like
the guarded queues'."""


# key=the site that superseded this one  meta: time_us u64 | guarded map
@_command(
    Kind.SUPERSEDED,
    key="by_cluster",
    meta=[("time_us", Int64ub), ("guarded", _MAP)],
)
@dataclass(frozen=True, slots=True)
class Superseded(_CommandBase):
    """At a primary: ``by_cluster`` was promoted over this site (its egress was
    refused with STALE_EPOCH).  Publishes to the queues named in ``guarded``
    with the value None are refused from now on: they could never reach the
    site that took over.  Every queue named, also those with the value
    :data:`FAILBACK_ONLY`, gives consumers nothing after a failback until the
    DR site holds this site's state again."""

    by_cluster: str
    time_us: int
    guarded: ValueMap = field(default_factory=dict)


# key=origin cluster  meta: incarnation u64 | cseq u64 | time_us u64
@_command(
    Kind.ACK_WATERMARK,
    key="origin_cluster",
    meta=[("incarnation", Int64ub), ("cseq", Int64ub), ("time_us", Int64ub)],
)
@dataclass(frozen=True, slots=True)
class AckWatermark(_CommandBase):
    """The active egress announces how far D has acknowledged, so standby
    taps can trim their spools."""

    origin_cluster: str
    incarnation: int
    cseq: int
    time_us: int


# key=""  meta: role u8 | node u32 | pid u32
@_command(Kind.MEMBER_READY, meta=[("role", Int8ub, Role), ("node", Int32ub), ("pid", Int32ub)])
@dataclass(frozen=True, slots=True)
class MemberReady(_CommandBase):
    """A member has its state and takes part (donor choice, roles)."""

    role: Role
    node: int
    pid: int


# key=cluster id  meta: incarnation u64
@_command(Kind.GENESIS, key="cluster", meta=[("incarnation", Int64ub)])
@dataclass(frozen=True, slots=True)
class Genesis(_CommandBase):
    """The first member of an empty site names the site's incarnation."""

    cluster: str
    incarnation: int


def _inner_out(cmd: Replicated) -> bytes:
    if len(cmd.modes) != len(cmd.commands):
        raise LocalProtocolError(
            f"Replicated has {len(cmd.modes)} modes for {len(cmd.commands)} commands"
        )
    if any(isinstance(c, Replicated) for c in cmd.commands):
        raise LocalProtocolError("Replicated commands cannot be nested")
    return encode_frame(cmd.commands)


def _inner_in(m: Any, tail: memoryview) -> tuple[Command, ...]:
    inner = decode_frame_untrusted(tail)
    if len(inner) != len(m["modes"]):
        raise RemoteProtocolError(
            f"Replicated command has {len(m['modes'])} modes for {len(inner)} commands"
        )
    if Replicated in map(type, inner):
        raise RemoteProtocolError("nested Replicated command")
    return tuple(inner)


# Mode(x) costs a microsecond; a dict lookup a tenth of that (every member
# decodes every Replicated's modes).  A value not in it is a KeyError: refused.
_MODE_OF: dict[int, Mode] = {int(m): m for m in Mode}


def _modes(values: Iterable[int]) -> tuple[Mode, ...]:
    return tuple([_MODE_OF[x] for x in values])


# key=origin cluster  meta: incarnation u64 | origin_cseq u64 | epoch u32
#     | origin_time_us u64 | modes (u16 count + u8 each)
#                       tail: a bus frame of the inner commands
@_command(
    Kind.REPLICATED,
    key="origin_cluster",
    meta=[
        ("incarnation", Int64ub),
        ("origin_cseq", Int64ub),
        ("epoch", Int32ub),
        ("origin_time_us", Int64ub),
        ("modes", _MODES, _modes),
    ],
    tail="commands",
    tail_out=_inner_out,
    tail_in=_inner_in,
)
@dataclass(frozen=True, slots=True)
class Replicated(_CommandBase):
    """Commands forwarded from another site's stream.

    ``commands[i]`` is replicated in mode ``modes[i]``; all come from the
    origin command ``origin_cseq`` of ``origin_cluster``'s incarnation
    ``incarnation``, sent under ``epoch``.
    """

    origin_cluster: str
    incarnation: int
    origin_cseq: int
    epoch: int
    origin_time_us: int
    modes: tuple[Mode, ...]
    commands: tuple[Command, ...]


Command: TypeAlias = (
    QueueDeclare
    | QueueDelete
    | ExchangeDeclare
    | ExchangeDelete
    | Bind
    | Unbind
    | Publish
    | Acquire
    | AcquireMatching
    | Withdraw
    | Accept
    | Release
    | Modify
    | Purge
    | SessionOpen
    | SessionClose
    | StateChunk
    | RulesSwitch
    | Replicated
    | Enqueue
    | Dequeue
    | Promote
    | AcceptIncarnation
    | AckWatermark
    | MemberReady
    | Genesis
    | ResyncApply
    | ResyncStage
    | ResyncCommit
    | AcceptPrimary
    | SetEpoch
    | Superseded
    | Durable
    | Recovering
    | RecoveryChunk
    | ForceRecovery
    | JoinHave
    | VerifyPoint
    | Verify
    | Switchover
    | Keep
)

if set(_CODECS) != {int(k) for k in Kind}:  # pragma: no cover - a kind without a command
    raise TypeError(f"kinds without a command: {set(Kind) - set(_CODECS)}")


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------


def encode_command(cmd: Command) -> tuple[int, bytes, bytes]:
    """``(kind, key bytes, rest bytes)`` of one command."""
    codec = _CODEC_OF.get(type(cmd))
    if codec is None:
        raise LocalProtocolError(f"not a bus command: {cmd!r}")
    tail = codec.tail_out(cmd)
    try:
        meta = codec.plan.pack(cmd)
    except (ConstructError, OverflowError, ValueError, TypeError, struct.error) as exc:
        raise LocalProtocolError(f"cannot encode {type(cmd).__name__}: {exc}") from exc
    key = cmd.key.encode("utf-8")
    if len(key) > 0xFFFF:
        raise LocalProtocolError(f"name of {len(key)} bytes is longer than 65535 bytes")
    return int(codec.kind), key, META_LEN.pack(len(meta)) + meta + bytes(tail)


def join_frames(
    frames: Sequence[bytes], *, max_commands: int = MAX_COMMANDS_PER_FRAME, max_bytes: int = 0
) -> list[bytes]:
    """``frames`` joined, in order, into as few frames as hold at most
    ``max_commands`` commands and (unless 0) ``max_bytes`` bytes each, without
    decoding a command: the headers are added up and the indexes and data
    concatenated.  A frame over the limits by itself is passed as it is.

    The frames must be well formed (from :func:`encode_frame`, or checked by
    :func:`scan_frame_untrusted`); raises :class:`LocalProtocolError` for one
    whose header or index is cut short."""
    joined: list[bytes] = []
    indexes: list[bytes] = []
    datas: list[bytes] = []
    count = size = 0

    def flush() -> None:
        if indexes:
            header = FRAME_HEADER.pack(VERSION, 0, count)
            joined.append(b"".join([header, *indexes, *datas]))
            indexes.clear()
            datas.clear()

    for frame in frames:
        if len(frame) < FRAME_HEADER.size:
            raise LocalProtocolError(f"not a bus frame: {len(frame)} bytes")
        n = FRAME_HEADER.unpack_from(frame)[2]
        index_end = FRAME_HEADER.size + n * INDEX_ENTRY.size
        if len(frame) < index_end:
            raise LocalProtocolError(f"bus frame of {n} commands cut short at {len(frame)} bytes")
        body = len(frame) - FRAME_HEADER.size
        if indexes and (count + n > max_commands or (max_bytes and size + body > max_bytes)):
            flush()
            count = size = 0
        indexes.append(frame[FRAME_HEADER.size : index_end])
        datas.append(frame[index_end:])
        count += n
        size += body
    flush()
    return joined


def encode_frame(commands: Sequence[Command]) -> bytes:
    """One bus frame carrying ``commands`` in order."""
    if len(commands) > MAX_COMMANDS_PER_FRAME:
        raise LocalProtocolError(
            f"a frame holds at most {MAX_COMMANDS_PER_FRAME} commands, got {len(commands)}"
        )
    index = []
    data = []
    for cmd in commands:
        kind, key, rest = encode_command(cmd)
        index.append(INDEX_ENTRY.pack(kind, 0, len(key), len(rest)))
        data.append(key)
        data.append(rest)
    return b"".join([FRAME_HEADER.pack(VERSION, 0, len(commands)), *index, *data])


# --------------------------------------------------------------------------
# Decoding (untrusted bytes)
# --------------------------------------------------------------------------


CommandRef: TypeAlias = tuple[int, str, int, int]
"""A command located in a frame, not yet decoded: ``(kind, key, size, offset)``.

What the hot path needs: the kind, the primary name (queue or exchange) and
the size of the rest; ``offset`` is where the rest starts in the frame.  A
plain tuple, because a frame of 100 commands is scanned several times faster
than with a dataclass (bench/protocol_bench.py).  :func:`decode_ref_untrusted`
decodes the whole command.
"""


def decode_ref_untrusted(frame: bytes | memoryview, ref: CommandRef) -> Command:
    """The whole command that ``ref`` (from :func:`scan_frame_untrusted`) locates."""
    kind, key, size, offset = ref
    data = frame if isinstance(frame, bytes) else bytes(frame)
    return _decode_at(kind, key, data, memoryview(data), offset, min(offset + size, len(data)))


def decode_head_untrusted(
    frame: bytes | memoryview, ref: CommandRef
) -> tuple[dict[str, Any], memoryview]:
    """The meta fields (by attribute name, typed as the command's) and the
    tail, undecoded, of the command ``ref`` locates: what a relay checks
    without building the command's bulk (a ``Replicated``'s inner commands,
    a body).  Fails only with :class:`RemoteProtocolError`."""
    kind, key, size, offset = ref
    data = frame if isinstance(frame, bytes) else bytes(frame)
    end = min(offset + size, len(data))
    codec, meta_at, meta_end = _locate_meta_untrusted(kind, key, data, offset, end)
    try:
        values = codec.plan.unpack_values_untrusted(data, meta_at, meta_end)
        meta = codec.meta_in(dict(zip(codec.plan.names, values, strict=True)))
        return meta, memoryview(data)[meta_end:end]
    except _DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed {Kind(kind).name} command: {exc}") from exc


def _check_header(view: memoryview) -> int:
    if len(view) < FRAME_HEADER.size:
        raise RemoteProtocolError(
            f"truncated bus frame: {len(view)} bytes, the header alone is {FRAME_HEADER.size}"
        )
    version, flags, count = FRAME_HEADER.unpack_from(view)
    if version != VERSION:
        raise RemoteProtocolError(
            f"bus frame version {version} is not supported (this member speaks {VERSION}); "
            "run the same drgate release on every member of a site"
        )
    if flags != 0:
        raise RemoteProtocolError(f"bus frame has unknown flags 0x{flags:02x}")
    return int(count)


def scan_frame_untrusted(
    frame: bytes | memoryview, start: int = 0, end: int | None = None
) -> list[CommandRef]:
    """Locate every command of a frame, decoding only kinds and keys.
    ``start`` and ``end``: the frame is ``frame[start:end]`` (one nested in
    another's bytes, read where it lies); the offsets are into ``frame``.

    Raises :class:`RemoteProtocolError` for an unknown version, a truncated
    frame, trailing bytes, an unknown command kind or a key that is not UTF-8.
    """
    data = frame if isinstance(frame, bytes) else bytes(frame)
    end = len(data) if end is None else end
    count = _check_header(memoryview(data)[start:end])
    index_end = start + FRAME_HEADER.size + count * INDEX_ENTRY.size
    if end < index_end:
        raise RemoteProtocolError(
            f"truncated bus frame: index of {count} commands needs {index_end - start} bytes, "
            f"frame has {end - start}"
        )
    refs: list[CommandRef] = []
    append = refs.append
    offset = index_end
    kinds = _KINDS
    # Names repeat within a frame (one queue, many publishes): decode each once.
    names: dict[bytes, str] = {}
    try:
        for kind, _reserved, key_len, rest_len in INDEX_ENTRY.iter_unpack(
            data[start + FRAME_HEADER.size : index_end]
        ):
            if kind not in kinds:
                raise RemoteProtocolError(f"unknown bus command kind {kind} in command {len(refs)}")
            rest_at = offset + key_len
            raw = data[offset:rest_at]
            key = names.get(raw)
            if key is None:
                key = names[raw] = raw.decode("utf-8")
            append((kind, key, rest_len, rest_at))
            offset = rest_at + rest_len
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"command {len(refs)} has a name that is not UTF-8") from exc
    if offset > end:
        raise RemoteProtocolError(
            f"truncated bus frame: its {count} commands need {offset - start} bytes, "
            f"frame has {end - start}"
        )
    if offset != end:
        raise RemoteProtocolError(f"bus frame has {end - offset} trailing bytes after its commands")
    return refs


def decode_frame_untrusted(frame: bytes | memoryview) -> list[Command]:
    """Every command of a frame, fully decoded; bodies are memoryviews of
    ``frame`` (of a copy when ``frame`` is a view)."""
    data = frame if isinstance(frame, bytes) else bytes(frame)
    view = memoryview(data)
    return [
        _decode_at(kind, key, data, view, offset, offset + size)
        for kind, key, size, offset in scan_frame_untrusted(data)
    ]


def iter_frame_untrusted(frame: bytes | memoryview) -> Iterator[Command]:
    data = frame if isinstance(frame, bytes) else bytes(frame)
    view = memoryview(data)
    for kind, key, size, offset in scan_frame_untrusted(data):
        yield _decode_at(kind, key, data, view, offset, offset + size)


_KINDS = frozenset(_CODECS)


# Decoders by kind that replace the generic one on the hot path (the same
# commands from the same bytes, the same errors): protocol/eventframe.py.
FAST_DECODERS: dict[int, Callable[[str, bytes, memoryview, int, int], Command]] = {}


def _decode_at(kind: int, key: str, data: bytes, view: memoryview, start: int, end: int) -> Command:
    """The command whose rest is ``data[start:end]`` (``view`` is ``data``'s
    memoryview, which the tail is cut from)."""
    fast = FAST_DECODERS.get(kind)
    if fast is not None:
        return fast(key, data, view, start, end)
    codec, meta_at, meta_end = _locate_meta_untrusted(kind, key, data, start, end)
    try:
        values = codec.plan.unpack_values_untrusted(data, meta_at, meta_end)
    except (RemoteProtocolError, *_DECODE_ERRORS) as exc:
        raise RemoteProtocolError(f"malformed {Kind(kind).name} command: {exc}") from exc
    try:
        result: Command = codec.build(key, values, view[meta_end:end])
        return result
    except RemoteProtocolError:
        raise
    except _DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed {Kind(kind).name} command: {exc}") from exc


# What parsing a meta struct or building a command from it may raise on bad bytes.
_DECODE_ERRORS = (
    ConstructError,
    struct.error,
    UnicodeDecodeError,
    ValueError,
    KeyError,
    IndexError,
    OverflowError,
    TypeError,
)


def _locate_meta_untrusted(
    kind: int, key: str, data: bytes, start: int, end: int
) -> tuple[_Codec, int, int]:
    """The codec of a command whose rest is ``data[start:end]``, and where
    its meta starts and ends."""
    codec = _CODECS.get(kind)
    if codec is None:
        raise RemoteProtocolError(f"unknown bus command kind {kind}")
    if key and not codec.named:
        # Kinds without a name must not carry one, so that each command has
        # exactly one encoding.
        raise RemoteProtocolError(f"{Kind(kind).name} command must have an empty name, got {key!r}")
    meta_at = start + META_LEN.size
    if meta_at > end:
        raise RemoteProtocolError(f"truncated {Kind(kind).name} command: no meta length")
    (meta_len,) = META_LEN.unpack_from(data, start)
    meta_end = meta_at + meta_len
    if meta_end > end:
        raise RemoteProtocolError(
            f"truncated {Kind(kind).name} command: meta of {meta_len} bytes, "
            f"{end - meta_at} present"
        )
    return codec, meta_at, meta_end


# Registers the fast decoders; last, since it builds on this module (either
# may be imported first).
import protocol.eventframe  # noqa: E402, F401
