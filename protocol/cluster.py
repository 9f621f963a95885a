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
``meta`` holds the other fields, declared once per kind as a compiled
construct struct.  ``tail`` is the bulk payload (a message body, a snapshot
chunk, a rules file) and is handed out as a ``memoryview`` of the frame,
never copied.  All integers are big-endian.

Decoding network bytes is done only by the ``*_untrusted`` functions, which
fail only with :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

from construct import (
    ConstructError,
    Error,
    Flag,
    Float64b,
    GreedyBytes,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64sb,
    Int64ub,
    PascalString,
    Prefixed,
    PrefixedArray,
    Struct,
    Switch,
    Terminated,
    this,
)

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.modes import Mode, Role

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

Value: TypeAlias = None | bool | int | float | str | bytes
"""A value in an argument or property map."""
ValueMap: TypeAlias = Mapping[str, Value]
Body: TypeAlias = bytes | memoryview


class Kind(enum.IntEnum):
    """Command kinds.  Wire values: never renumber, only add."""

    QUEUE_DECLARE = 1
    QUEUE_DELETE = 2
    EXCHANGE_DECLARE = 3
    EXCHANGE_DELETE = 4
    BIND = 5
    UNBIND = 6
    PUBLISH = 7
    ACQUIRE = 8
    ACCEPT = 9
    RELEASE = 10
    PURGE = 11
    SESSION_OPEN = 12
    SESSION_CLOSE = 13
    STATE_CHUNK = 14
    RULES_SWITCH = 15
    REPLICATED = 16
    ENQUEUE = 17
    DEQUEUE = 18
    PROMOTE = 19
    ACCEPT_INCARNATION = 20
    ACK_WATERMARK = 21
    MEMBER_READY = 22
    GENESIS = 23
    RESYNC_APPLY = 24


class ExchangeType(enum.IntEnum):
    DIRECT = 0
    FANOUT = 1
    TOPIC = 2


# --------------------------------------------------------------------------
# Per-kind meta formats (construct, compiled once at import).
# --------------------------------------------------------------------------

# value := tag u8 | payload
#   tag 0 null | 1 bool (u8) | 2 int (i64) | 3 str (u32 len + UTF-8)
#   | 4 bytes (u32 len + bytes) | 5 float (f64)
_VALUE = Struct(
    "tag" / Int8ub,
    "v"
    / Switch(
        this.tag,
        {
            0: Struct(),
            1: Flag,
            2: Int64sb,
            3: PascalString(Int32ub, "utf8"),
            4: Prefixed(Int32ub, GreedyBytes),
            5: Float64b,
        },
        default=Error,
    ),
)
# map := count u16 | count x ( key: u16 len + UTF-8 | value )
_MAP = PrefixedArray(Int16ub, Struct("k" / PascalString(Int16ub, "utf8"), "value" / _VALUE))
_STR = PascalString(Int16ub, "utf8")
_POSITIONS = PrefixedArray(Int32ub, Int64ub)


def _meta(*fields: Any) -> Any:
    """A per-kind meta struct that refuses trailing bytes, compiled once."""
    return Struct(*fields, Terminated).compile()


_META = {
    # QUEUE_DECLARE  key=queue     meta: args map
    Kind.QUEUE_DECLARE: _meta("args" / _MAP),
    # QUEUE_DELETE   key=queue     meta: (empty)
    Kind.QUEUE_DELETE: _meta(),
    # EXCHANGE_DECLARE key=exchange meta: type u8 | args map
    Kind.EXCHANGE_DECLARE: _meta("type" / Int8ub, "args" / _MAP),
    # EXCHANGE_DELETE key=exchange meta: (empty)
    Kind.EXCHANGE_DELETE: _meta(),
    # BIND   key=exchange  meta: queue str16 | binding_key str16 | args map
    Kind.BIND: _meta("queue" / _STR, "binding_key" / _STR, "args" / _MAP),
    # UNBIND key=exchange  meta: queue str16 | binding_key str16
    Kind.UNBIND: _meta("queue" / _STR, "binding_key" / _STR),
    # PUBLISH key=exchange meta: routing_key str16 | ref u64 | message_id str16
    #                            | properties map           tail: body
    Kind.PUBLISH: _meta(
        "routing_key" / _STR, "ref" / Int64ub, "message_id" / _STR, "properties" / _MAP
    ),
    # ACQUIRE key=queue  meta: session u64 | consumer u32 | count u32
    Kind.ACQUIRE: _meta("session" / Int64ub, "consumer" / Int32ub, "count" / Int32ub),
    # ACCEPT  key=queue  meta: session u64 | positions (u32 count + u64 each)
    Kind.ACCEPT: _meta("session" / Int64ub, "positions" / _POSITIONS),
    # RELEASE key=queue  meta: session u64 | redelivered u8 | positions
    Kind.RELEASE: _meta("session" / Int64ub, "redelivered" / Flag, "positions" / _POSITIONS),
    # PURGE   key=queue  meta: (empty)
    Kind.PURGE: _meta(),
    # SESSION_OPEN / SESSION_CLOSE key="" meta: session u64
    Kind.SESSION_OPEN: _meta("session" / Int64ub),
    Kind.SESSION_CLOSE: _meta("session" / Int64ub),
    # STATE_CHUNK key="" meta: target_node u32 | target_pid u32 | transfer u32
    #                          | index u32 | final u8      tail: snapshot bytes
    Kind.STATE_CHUNK: _meta(
        "target_node" / Int32ub,
        "target_pid" / Int32ub,
        "transfer" / Int32ub,
        "index" / Int32ub,
        "final" / Flag,
    ),
    # RULES_SWITCH key="" meta: (empty)   tail: the switch payload (filters/)
    Kind.RULES_SWITCH: _meta(),
    # REPLICATED key=origin cluster  meta: incarnation u64 | origin_cseq u64
    #     | epoch u32 | origin_time_us u64 | modes (u16 count + u8 each)
    #                                       tail: a bus frame of the inner commands
    Kind.REPLICATED: _meta(
        "incarnation" / Int64ub,
        "origin_cseq" / Int64ub,
        "epoch" / Int32ub,
        "origin_time_us" / Int64ub,
        "modes" / PrefixedArray(Int16ub, Int8ub),
    ),
    # ENQUEUE key=queue meta: pos u64 | message_id str16 | properties map
    #                         | redelivered u8            tail: body
    Kind.ENQUEUE: _meta(
        "pos" / Int64ub, "message_id" / _STR, "properties" / _MAP, "redelivered" / Flag
    ),
    # DEQUEUE key=queue meta: positions
    Kind.DEQUEUE: _meta("positions" / _POSITIONS),
    # PROMOTE key=origin cluster meta: epoch u32 | time_us u64
    Kind.PROMOTE: _meta("epoch" / Int32ub, "time_us" / Int64ub),
    # ACCEPT_INCARNATION key=origin cluster meta: incarnation u64
    Kind.ACCEPT_INCARNATION: _meta("incarnation" / Int64ub),
    # ACK_WATERMARK key=origin cluster meta: incarnation u64 | cseq u64 | time_us u64
    Kind.ACK_WATERMARK: _meta("incarnation" / Int64ub, "cseq" / Int64ub, "time_us" / Int64ub),
    # MEMBER_READY key="" meta: role u8 | node u32 | pid u32
    Kind.MEMBER_READY: _meta("role" / Int8ub, "node" / Int32ub, "pid" / Int32ub),
    # GENESIS key=cluster id meta: incarnation u64
    Kind.GENESIS: _meta("incarnation" / Int64ub),
    # RESYNC_APPLY key=origin cluster meta: incarnation u64 | cut u64 | epoch u32
    #     | origin_time_us u64          tail: the snapshot (see encode_snapshot)
    Kind.RESYNC_APPLY: _meta(
        "incarnation" / Int64ub, "cut" / Int64ub, "epoch" / Int32ub, "origin_time_us" / Int64ub
    ),
}

# --------------------------------------------------------------------------
# Commands: frozen dataclasses, one per kind.
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueDeclare:
    KIND: ClassVar[Kind] = Kind.QUEUE_DECLARE
    queue: str
    args: ValueMap = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class QueueDelete:
    KIND: ClassVar[Kind] = Kind.QUEUE_DELETE
    queue: str

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class ExchangeDeclare:
    KIND: ClassVar[Kind] = Kind.EXCHANGE_DECLARE
    exchange: str
    type: ExchangeType = ExchangeType.DIRECT
    args: ValueMap = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.exchange


@dataclass(frozen=True, slots=True)
class ExchangeDelete:
    KIND: ClassVar[Kind] = Kind.EXCHANGE_DELETE
    exchange: str

    @property
    def key(self) -> str:
        return self.exchange


@dataclass(frozen=True, slots=True)
class Bind:
    KIND: ClassVar[Kind] = Kind.BIND
    exchange: str
    queue: str
    binding_key: str = ""
    args: ValueMap = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.exchange


@dataclass(frozen=True, slots=True)
class Unbind:
    KIND: ClassVar[Kind] = Kind.UNBIND
    exchange: str
    queue: str
    binding_key: str = ""

    @property
    def key(self) -> str:
        return self.exchange


@dataclass(frozen=True, slots=True)
class Publish:
    """A client's message, routed through ``exchange`` by ``routing_key``.

    The default exchange ``""`` routes to the queue named by the routing key.
    ``ref`` is the publishing member's token for the client delivery, so that
    it can settle it when the command comes back on the bus.
    """

    KIND: ClassVar[Kind] = Kind.PUBLISH
    exchange: str
    routing_key: str
    body: Body = b""
    message_id: str = ""
    properties: ValueMap = field(default_factory=dict)
    ref: int = 0

    @property
    def key(self) -> str:
        return self.exchange


@dataclass(frozen=True, slots=True)
class Acquire:
    """Session ``session``'s consumer ``consumer`` takes the next ``count``
    available messages of ``queue`` (deterministic: the first in FIFO order)."""

    KIND: ClassVar[Kind] = Kind.ACQUIRE
    queue: str
    session: int
    consumer: int = 0
    count: int = 1

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class Accept:
    """The messages at ``positions``, acquired by ``session``, are consumed."""

    KIND: ClassVar[Kind] = Kind.ACCEPT
    queue: str
    session: int
    positions: tuple[int, ...]

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class Release:
    """The messages at ``positions`` go back to the queue, in their place."""

    KIND: ClassVar[Kind] = Kind.RELEASE
    queue: str
    session: int
    positions: tuple[int, ...]
    redelivered: bool = True

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class Purge:
    KIND: ClassVar[Kind] = Kind.PURGE
    queue: str

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class SessionOpen:
    KIND: ClassVar[Kind] = Kind.SESSION_OPEN
    session: int
    key: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class SessionClose:
    """The session ended: everything it had acquired is released."""

    KIND: ClassVar[Kind] = Kind.SESSION_CLOSE
    session: int
    key: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class StateChunk:
    """One piece of a snapshot sent by a donor to the joining member
    ``(target_node, target_pid)``; ``final`` marks the last piece."""

    KIND: ClassVar[Kind] = Kind.STATE_CHUNK
    target_node: int
    target_pid: int
    transfer: int
    index: int
    final: bool
    data: Body
    key: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class RulesSwitch:
    """New replication rules, applied by every tap at this command's cseq.
    ``payload`` is opaque here: filters/ defines it."""

    KIND: ClassVar[Kind] = Kind.RULES_SWITCH
    payload: Body
    key: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Enqueue:
    """Put a message on ``queue`` directly at origin position ``pos`` (used
    inside :class:`Replicated`, and by resync)."""

    KIND: ClassVar[Kind] = Kind.ENQUEUE
    queue: str
    pos: int
    body: Body = b""
    message_id: str = ""
    properties: ValueMap = field(default_factory=dict)
    redelivered: bool = False

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class Dequeue:
    """Remove the messages of origin positions ``positions`` from ``queue``."""

    KIND: ClassVar[Kind] = Kind.DEQUEUE
    queue: str
    positions: tuple[int, ...]

    @property
    def key(self) -> str:
        return self.queue


@dataclass(frozen=True, slots=True)
class Promote:
    """D stops accepting ``origin_cluster``'s stream and raises its epoch."""

    KIND: ClassVar[Kind] = Kind.PROMOTE
    origin_cluster: str
    epoch: int
    time_us: int

    @property
    def key(self) -> str:
        return self.origin_cluster


@dataclass(frozen=True, slots=True)
class AcceptIncarnation:
    """The operator accepts a restarted primary's new incarnation."""

    KIND: ClassVar[Kind] = Kind.ACCEPT_INCARNATION
    origin_cluster: str
    incarnation: int

    @property
    def key(self) -> str:
        return self.origin_cluster


@dataclass(frozen=True, slots=True)
class AckWatermark:
    """The active egress announces how far D has acknowledged, so standby
    taps can trim their spools."""

    KIND: ClassVar[Kind] = Kind.ACK_WATERMARK
    origin_cluster: str
    incarnation: int
    cseq: int
    time_us: int

    @property
    def key(self) -> str:
        return self.origin_cluster


@dataclass(frozen=True, slots=True)
class MemberReady:
    """A member has its state and takes part (donor choice, roles)."""

    KIND: ClassVar[Kind] = Kind.MEMBER_READY
    role: Role
    node: int
    pid: int
    key: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Genesis:
    """The first member of an empty site names the site's incarnation."""

    KIND: ClassVar[Kind] = Kind.GENESIS
    cluster: str
    incarnation: int

    @property
    def key(self) -> str:
        return self.cluster


@dataclass(frozen=True, slots=True)
class Replicated:
    """Commands forwarded from another site's stream.

    ``commands[i]`` is replicated in mode ``modes[i]``; all come from the
    origin command ``origin_cseq`` of ``origin_cluster``'s incarnation
    ``incarnation``, sent under ``epoch``.
    """

    KIND: ClassVar[Kind] = Kind.REPLICATED
    origin_cluster: str
    incarnation: int
    origin_cseq: int
    epoch: int
    origin_time_us: int
    modes: tuple[Mode, ...]
    commands: tuple[Command, ...]

    @property
    def key(self) -> str:
        return self.origin_cluster


@dataclass(frozen=True, slots=True)
class ResyncApply:
    """A resync snapshot of ``origin_cluster``'s replicated queues, cut at its
    ``cut`` cseq, applied by every member at this one point of the stream.

    ``snapshot`` is a sequence of ``u32 length | bus frame`` records (see
    :func:`encode_snapshot`); each frame holds ``Replicated`` commands whose
    inner commands (exchange and queue declares, binds, enqueues) describe
    the origin's state at the cut.  It stays opaque bytes until applied.
    """

    KIND: ClassVar[Kind] = Kind.RESYNC_APPLY
    origin_cluster: str
    incarnation: int
    cut: int
    epoch: int
    origin_time_us: int
    snapshot: Body = b""

    @property
    def key(self) -> str:
        return self.origin_cluster


Command: TypeAlias = (
    QueueDeclare
    | QueueDelete
    | ExchangeDeclare
    | ExchangeDelete
    | Bind
    | Unbind
    | Publish
    | Acquire
    | Accept
    | Release
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
)


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------


def _map_out(values: ValueMap) -> list[dict[str, Any]]:
    out = []
    for k, v in values.items():
        if v is None:
            out.append({"k": k, "value": {"tag": 0, "v": {}}})
        elif isinstance(v, bool):
            out.append({"k": k, "value": {"tag": 1, "v": v}})
        elif isinstance(v, int):
            out.append({"k": k, "value": {"tag": 2, "v": v}})
        elif isinstance(v, str):
            out.append({"k": k, "value": {"tag": 3, "v": v}})
        elif isinstance(v, bytes | bytearray | memoryview):
            out.append({"k": k, "value": {"tag": 4, "v": bytes(v)}})
        elif isinstance(v, float):
            out.append({"k": k, "value": {"tag": 5, "v": v}})
        else:
            raise LocalProtocolError(
                f"map value for {k!r} has type {type(v).__name__}; "
                "only None, bool, int, float, str and bytes can be encoded"
            )
    return out


def _map_in(items: Iterable[Any]) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for item in items:
        value = item.value
        out[item.k] = None if value.tag == 0 else value.v
    return out


def _meta_fields(cmd: Command) -> tuple[dict[str, Any], Body]:
    """The meta fields to build and the tail, for one command."""
    if isinstance(cmd, QueueDeclare):
        return {"args": _map_out(cmd.args)}, b""
    if isinstance(cmd, QueueDelete | ExchangeDelete | Purge):
        return {}, b""
    if isinstance(cmd, ExchangeDeclare):
        return {"type": int(cmd.type), "args": _map_out(cmd.args)}, b""
    if isinstance(cmd, Bind):
        return {
            "queue": cmd.queue,
            "binding_key": cmd.binding_key,
            "args": _map_out(cmd.args),
        }, b""
    if isinstance(cmd, Unbind):
        return {"queue": cmd.queue, "binding_key": cmd.binding_key}, b""
    if isinstance(cmd, Publish):
        return {
            "routing_key": cmd.routing_key,
            "ref": cmd.ref,
            "message_id": cmd.message_id,
            "properties": _map_out(cmd.properties),
        }, cmd.body
    if isinstance(cmd, Acquire):
        return {"session": cmd.session, "consumer": cmd.consumer, "count": cmd.count}, b""
    if isinstance(cmd, Accept):
        return {"session": cmd.session, "positions": list(cmd.positions)}, b""
    if isinstance(cmd, Release):
        return {
            "session": cmd.session,
            "redelivered": cmd.redelivered,
            "positions": list(cmd.positions),
        }, b""
    if isinstance(cmd, SessionOpen | SessionClose):
        return {"session": cmd.session}, b""
    if isinstance(cmd, StateChunk):
        return {
            "target_node": cmd.target_node,
            "target_pid": cmd.target_pid,
            "transfer": cmd.transfer,
            "index": cmd.index,
            "final": cmd.final,
        }, cmd.data
    if isinstance(cmd, RulesSwitch):
        return {}, cmd.payload
    if isinstance(cmd, Replicated):
        if len(cmd.modes) != len(cmd.commands):
            raise LocalProtocolError(
                f"Replicated has {len(cmd.modes)} modes for {len(cmd.commands)} commands"
            )
        if any(isinstance(c, Replicated) for c in cmd.commands):
            raise LocalProtocolError("Replicated commands cannot be nested")
        return {
            "incarnation": cmd.incarnation,
            "origin_cseq": cmd.origin_cseq,
            "epoch": cmd.epoch,
            "origin_time_us": cmd.origin_time_us,
            "modes": [int(m) for m in cmd.modes],
        }, encode_frame(cmd.commands)
    if isinstance(cmd, Enqueue):
        return {
            "pos": cmd.pos,
            "message_id": cmd.message_id,
            "properties": _map_out(cmd.properties),
            "redelivered": cmd.redelivered,
        }, cmd.body
    if isinstance(cmd, Dequeue):
        return {"positions": list(cmd.positions)}, b""
    if isinstance(cmd, Promote):
        return {"epoch": cmd.epoch, "time_us": cmd.time_us}, b""
    if isinstance(cmd, AcceptIncarnation):
        return {"incarnation": cmd.incarnation}, b""
    if isinstance(cmd, AckWatermark):
        return {"incarnation": cmd.incarnation, "cseq": cmd.cseq, "time_us": cmd.time_us}, b""
    if isinstance(cmd, MemberReady):
        return {"role": int(cmd.role), "node": cmd.node, "pid": cmd.pid}, b""
    if isinstance(cmd, Genesis):
        return {"incarnation": cmd.incarnation}, b""
    if isinstance(cmd, ResyncApply):
        return {
            "incarnation": cmd.incarnation,
            "cut": cmd.cut,
            "epoch": cmd.epoch,
            "origin_time_us": cmd.origin_time_us,
        }, cmd.snapshot
    raise LocalProtocolError(f"not a bus command: {cmd!r}")


def encode_command(cmd: Command) -> tuple[int, bytes, bytes]:
    """``(kind, key bytes, rest bytes)`` of one command."""
    fields, tail = _meta_fields(cmd)
    try:
        meta = _META[cmd.KIND].build(fields)
    except (ConstructError, OverflowError, ValueError, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode {type(cmd).__name__}: {exc}") from exc
    key = cmd.key.encode("utf-8")
    if len(key) > 0xFFFF:
        raise LocalProtocolError(f"name of {len(key)} bytes is longer than 65535 bytes")
    return int(cmd.KIND), key, META_LEN.pack(len(meta)) + meta + bytes(tail)


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
    return _decode_one(kind, key, memoryview(frame)[offset : offset + size])


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


def scan_frame_untrusted(frame: bytes | memoryview) -> list[CommandRef]:
    """Locate every command of a frame, decoding only kinds and keys.

    Raises :class:`RemoteProtocolError` for an unknown version, a truncated
    frame, trailing bytes, an unknown command kind or a key that is not UTF-8.
    """
    data = frame if isinstance(frame, bytes) else bytes(frame)
    count = _check_header(memoryview(data))
    index_end = FRAME_HEADER.size + count * INDEX_ENTRY.size
    if len(data) < index_end:
        raise RemoteProtocolError(
            f"truncated bus frame: index of {count} commands needs {index_end} bytes, "
            f"frame has {len(data)}"
        )
    refs: list[CommandRef] = []
    append = refs.append
    offset = index_end
    kinds = _KINDS
    # Names repeat within a frame (one queue, many publishes): decode each once.
    names: dict[bytes, str] = {}
    try:
        for kind, _reserved, key_len, rest_len in INDEX_ENTRY.iter_unpack(
            data[FRAME_HEADER.size : index_end]
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
    if offset > len(data):
        raise RemoteProtocolError(
            f"truncated bus frame: its {count} commands need {offset} bytes, frame has {len(data)}"
        )
    if offset != len(data):
        raise RemoteProtocolError(
            f"bus frame has {len(data) - offset} trailing bytes after its commands"
        )
    return refs


def decode_frame_untrusted(frame: bytes | memoryview) -> list[Command]:
    """Every command of a frame, fully decoded; bodies are memoryviews of ``frame``."""
    view = memoryview(frame)
    return [
        _decode_one(kind, key, view[offset : offset + size])
        for kind, key, size, offset in scan_frame_untrusted(frame)
    ]


def iter_frame_untrusted(frame: bytes | memoryview) -> Iterator[Command]:
    view = memoryview(frame)
    for kind, key, size, offset in scan_frame_untrusted(frame):
        yield _decode_one(kind, key, view[offset : offset + size])


_KINDS = frozenset(int(k) for k in Kind)


# Kinds whose key is always "": a frame that gives them a name is refused, so
# that each command has exactly one encoding.
_EMPTY_KEY_KINDS = frozenset(
    {Kind.SESSION_OPEN, Kind.SESSION_CLOSE, Kind.STATE_CHUNK, Kind.RULES_SWITCH, Kind.MEMBER_READY}
)


def _decode_one(kind: int, key: str, rest: memoryview) -> Command:
    if key and kind in _EMPTY_KEY_KINDS:
        raise RemoteProtocolError(f"{Kind(kind).name} command must have an empty name, got {key!r}")
    if len(rest) < META_LEN.size:
        raise RemoteProtocolError(f"truncated {Kind(kind).name} command: no meta length")
    (meta_len,) = META_LEN.unpack_from(rest)
    meta_end = META_LEN.size + meta_len
    if meta_end > len(rest):
        raise RemoteProtocolError(
            f"truncated {Kind(kind).name} command: meta of {meta_len} bytes, "
            f"{len(rest) - META_LEN.size} present"
        )
    tail = rest[meta_end:]
    try:
        m = _META[Kind(kind)].parse(bytes(rest[META_LEN.size : meta_end]))
        return _BUILD[kind](key, m, tail)
    except RemoteProtocolError:
        raise
    except (
        ConstructError,
        struct.error,
        UnicodeDecodeError,
        ValueError,
        KeyError,
        IndexError,
        OverflowError,
    ) as exc:
        raise RemoteProtocolError(f"malformed {Kind(kind).name} command: {exc}") from exc


def _no_tail(kind: Kind, tail: memoryview) -> None:
    if len(tail):
        raise RemoteProtocolError(f"{kind.name} command has {len(tail)} unexpected trailing bytes")


def _positions(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _build_replicated(key: str, m: Any, tail: memoryview) -> Replicated:
    inner = decode_frame_untrusted(tail)
    if len(inner) != len(m.modes):
        raise RemoteProtocolError(
            f"Replicated command has {len(m.modes)} modes for {len(inner)} commands"
        )
    if any(isinstance(c, Replicated) for c in inner):
        raise RemoteProtocolError("nested Replicated command")
    return Replicated(
        key,
        m.incarnation,
        m.origin_cseq,
        m.epoch,
        m.origin_time_us,
        tuple(Mode(x) for x in m.modes),
        tuple(inner),
    )


def _tailless(kind: Kind, build: Any) -> Any:
    def run(key: str, m: Any, tail: memoryview) -> Command:
        _no_tail(kind, tail)
        result: Command = build(key, m)
        return result

    return run


_BUILD: dict[int, Any] = {
    Kind.QUEUE_DECLARE: _tailless(
        Kind.QUEUE_DECLARE, lambda k, m: QueueDeclare(k, _map_in(m.args))
    ),
    Kind.QUEUE_DELETE: _tailless(Kind.QUEUE_DELETE, lambda k, m: QueueDelete(k)),
    Kind.EXCHANGE_DECLARE: _tailless(
        Kind.EXCHANGE_DECLARE,
        lambda k, m: ExchangeDeclare(k, ExchangeType(m.type), _map_in(m.args)),
    ),
    Kind.EXCHANGE_DELETE: _tailless(Kind.EXCHANGE_DELETE, lambda k, m: ExchangeDelete(k)),
    Kind.BIND: _tailless(Kind.BIND, lambda k, m: Bind(k, m.queue, m.binding_key, _map_in(m.args))),
    Kind.UNBIND: _tailless(Kind.UNBIND, lambda k, m: Unbind(k, m.queue, m.binding_key)),
    Kind.PUBLISH: lambda k, m, tail: Publish(
        k, m.routing_key, tail, m.message_id, _map_in(m.properties), m.ref
    ),
    Kind.ACQUIRE: _tailless(Kind.ACQUIRE, lambda k, m: Acquire(k, m.session, m.consumer, m.count)),
    Kind.ACCEPT: _tailless(Kind.ACCEPT, lambda k, m: Accept(k, m.session, _positions(m.positions))),
    Kind.RELEASE: _tailless(
        Kind.RELEASE,
        lambda k, m: Release(k, m.session, _positions(m.positions), m.redelivered),
    ),
    Kind.PURGE: _tailless(Kind.PURGE, lambda k, m: Purge(k)),
    Kind.SESSION_OPEN: _tailless(Kind.SESSION_OPEN, lambda k, m: SessionOpen(m.session)),
    Kind.SESSION_CLOSE: _tailless(Kind.SESSION_CLOSE, lambda k, m: SessionClose(m.session)),
    Kind.STATE_CHUNK: lambda k, m, tail: StateChunk(
        m.target_node, m.target_pid, m.transfer, m.index, m.final, tail
    ),
    Kind.RULES_SWITCH: lambda k, m, tail: RulesSwitch(tail),
    Kind.REPLICATED: _build_replicated,
    Kind.ENQUEUE: lambda k, m, tail: Enqueue(
        k, m.pos, tail, m.message_id, _map_in(m.properties), m.redelivered
    ),
    Kind.DEQUEUE: _tailless(Kind.DEQUEUE, lambda k, m: Dequeue(k, _positions(m.positions))),
    Kind.PROMOTE: _tailless(Kind.PROMOTE, lambda k, m: Promote(k, m.epoch, m.time_us)),
    Kind.ACCEPT_INCARNATION: _tailless(
        Kind.ACCEPT_INCARNATION, lambda k, m: AcceptIncarnation(k, m.incarnation)
    ),
    Kind.ACK_WATERMARK: _tailless(
        Kind.ACK_WATERMARK, lambda k, m: AckWatermark(k, m.incarnation, m.cseq, m.time_us)
    ),
    Kind.MEMBER_READY: _tailless(
        Kind.MEMBER_READY, lambda k, m: MemberReady(Role(m.role), m.node, m.pid)
    ),
    Kind.GENESIS: _tailless(Kind.GENESIS, lambda k, m: Genesis(k, m.incarnation)),
    Kind.RESYNC_APPLY: lambda k, m, tail: ResyncApply(
        k, m.incarnation, m.cut, m.epoch, m.origin_time_us, tail
    ),
}


# --------------------------------------------------------------------------
# Resync snapshots (the tail of ResyncApply)
# --------------------------------------------------------------------------

#   length u32 (of the bus frame that follows)
SNAPSHOT_RECORD = struct.Struct(">I")


def encode_snapshot_record(commands: Sequence[Replicated]) -> bytes:
    """One snapshot record: ``u32 length | bus frame`` of ``commands``.

    A snapshot is the concatenation of records, so it can be cut into link
    chunks at record boundaries and joined again by plain concatenation."""
    frame = encode_frame(commands)
    return SNAPSHOT_RECORD.pack(len(frame)) + frame


def iter_snapshot_untrusted(snapshot: bytes | memoryview) -> Iterator[Replicated]:
    """The ``Replicated`` commands of a snapshot, in order.  Fails only with
    :class:`RemoteProtocolError` (a truncated record, a bad frame, a command
    that is not ``Replicated``)."""
    view = memoryview(snapshot)
    offset = 0
    while offset < len(view):
        if offset + SNAPSHOT_RECORD.size > len(view):
            raise RemoteProtocolError(f"snapshot truncated at byte {offset}: no record length")
        (length,) = SNAPSHOT_RECORD.unpack_from(view, offset)
        offset += SNAPSHOT_RECORD.size
        if offset + length > len(view):
            raise RemoteProtocolError(
                f"snapshot record at byte {offset} of {length} bytes goes past the end"
            )
        for cmd in decode_frame_untrusted(view[offset : offset + length]):
            if not isinstance(cmd, Replicated):
                raise RemoteProtocolError(
                    f"snapshot holds a {type(cmd).__name__} command; only Replicated may appear"
                )
            yield cmd
        offset += length
