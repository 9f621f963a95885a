"""How a bus command kind is declared and laid out: the :class:`Kind` wire
numbers, the ``@_command`` decorator that registers a dataclass as a kind's
command (key, meta fields, tail), and the meta structs' fast path.
protocol/cluster.py declares every command with it and encodes and decodes
frames from the registry it fills (``_CODECS``); nothing else should need
this module directly.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, ClassVar, TypeAlias, TypeVar

from construct import (
    Flag,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64ub,
    PascalString,
    PrefixedArray,
    Struct,
    Terminated,
)

from protocol.errors import RemoteProtocolError
from protocol.quickinit import quick_init
from protocol.values import VALUE_MAP_FIELD as _MAP  # re-exported to protocol/cluster.py
from protocol.values import pack_value_map, unpack_value_map_untrusted

__all__ = [
    "_CODECS",
    "_CODEC_OF",
    "_MAP",
    "_MODES",
    "_POSITIONS",
    "_STR",
    "Body",
    "ExchangeType",
    "Kind",
    "MetaField",
    "_Codec",
    "_CommandBase",
    "_MetaPlan",
    "_command",
    "_tuple",
]
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
    RESYNC_STAGE = 25
    RESYNC_COMMIT = 26
    ACCEPT_PRIMARY = 27
    SET_EPOCH = 28
    SUPERSEDED = 29
    DURABLE = 30
    RECOVERING = 31
    RECOVERY_CHUNK = 32
    FORCE_RECOVERY = 33
    JOIN_HAVE = 34
    MODIFY = 35
    ACQUIRE_MATCHING = 36
    VERIFY_POINT = 37
    VERIFY = 38
    SWITCHOVER = 39
    KEEP = 40
    WITHDRAW = 41


class ExchangeType(enum.IntEnum):
    DIRECT = 0
    FANOUT = 1
    TOPIC = 2


_STR = PascalString(Int16ub, "utf8")
_POSITIONS = PrefixedArray(Int32ub, Int64ub)
_MODES = PrefixedArray(Int16ub, Int8ub)
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


# --------------------------------------------------------------------------
# The meta structs' fast path.  Each kind's meta is declared once, as
# construct fields (the ``@_command`` declarations below); building and
# parsing through construct costs several microseconds a command, and every
# member decodes every command, so encoding and decoding use a plan derived
# from the declaration: runs of fixed-size integers as one ``struct``, the
# other fields by a function per field type.  A test checks that the plan and
# the construct agree on every kind.
# --------------------------------------------------------------------------

_FIXED_CODES: dict[int, str] = {
    id(Int8ub): "B",
    id(Int16ub): "H",
    id(Int32ub): "I",
    id(Int64ub): "Q",
    id(Flag): "?",
}


def _pack_str(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def _unpack_str(data: bytes, offset: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(data, offset)
    end = offset + 2 + n
    if end > len(data):
        raise RemoteProtocolError(f"a string of {n} bytes runs past the meta")
    return data[offset + 2 : end].decode("utf-8"), end


def _pack_positions(values: Sequence[int]) -> bytes:
    return struct.pack(f">I{len(values)}Q", len(values), *values)


def _unpack_positions(data: bytes, offset: int) -> tuple[tuple[int, ...], int]:
    (n,) = _U32.unpack_from(data, offset)
    offset += 4
    if offset + 8 * n > len(data):
        raise RemoteProtocolError(f"{n} positions run past the meta")
    return struct.unpack_from(f">{n}Q", data, offset), offset + 8 * n


def _pack_modes(values: Sequence[int]) -> bytes:
    return _U16.pack(len(values)) + bytes(values)


def _unpack_modes(data: bytes, offset: int) -> tuple[list[int], int]:
    (n,) = _U16.unpack_from(data, offset)
    end = offset + 2 + n
    if end > len(data):
        raise RemoteProtocolError(f"{n} modes run past the meta")
    return list(data[offset + 2 : end]), end


_VARIABLE: dict[int, tuple[Callable[[Any], bytes], Callable[[bytes, int], tuple[Any, int]]]] = {
    id(_STR): (_pack_str, _unpack_str),
    id(_POSITIONS): (_pack_positions, _unpack_positions),
    id(_MODES): (_pack_modes, _unpack_modes),
    id(_MAP): (pack_value_map, unpack_value_map_untrusted),
}


def _packer(step: tuple[Any, ...]) -> Callable[[Any], bytes]:
    """``command -> bytes`` of one plan step."""
    if step[0] is None:
        read, pack_one = attrgetter(step[1]), step[2]
        return lambda cmd: pack_one(read(cmd))
    fixed, names = step[0], step[1]
    if len(names) == 1:
        read_one = attrgetter(names[0])
        return lambda cmd: fixed.pack(read_one(cmd))
    read_all = attrgetter(*names)
    return lambda cmd: fixed.pack(*read_all(cmd))


@dataclass(frozen=True, slots=True)
class _MetaPlan:
    """How one kind's meta is packed and unpacked: steps in wire order, each
    a ``struct`` over a run of fixed-size fields or one variable field."""

    kind: Kind
    steps: tuple[tuple[Any, ...], ...]
    names: tuple[str, ...]
    # One function per step, ``command -> bytes``: the attributes read by one
    # attrgetter, packed by one call (what every tap pays per event).
    packers: tuple[Callable[[Any], bytes], ...]

    @classmethod
    def of(cls, kind: Kind, meta: Sequence[MetaField]) -> _MetaPlan:
        steps: list[tuple[Any, ...]] = []
        fmt, names = "", list[str]()
        for field_ in meta:
            name, sub = field_[0], field_[1]
            code = _FIXED_CODES.get(id(sub))
            if code is not None:
                fmt, names = fmt + code, [*names, name]
                continue
            if fmt:
                steps.append((struct.Struct(">" + fmt), tuple(names)))
                fmt, names = "", []
            if id(sub) not in _VARIABLE:
                raise TypeError(f"{kind.name}: no meta codec for field {name} ({sub})")
            steps.append((None, name, *_VARIABLE[id(sub)]))
        if fmt:
            steps.append((struct.Struct(">" + fmt), tuple(names)))
        return cls(kind, tuple(steps), tuple(f[0] for f in meta), tuple(map(_packer, steps)))

    def pack(self, cmd: Any) -> bytes:
        packers = self.packers
        if len(packers) == 1:
            return packers[0](cmd)
        return b"".join([p(cmd) for p in packers])

    def unpack_untrusted(self, data: bytes) -> dict[str, Any]:
        """The meta ``data`` holds, by field name."""
        return dict(zip(self.names, self.unpack_values_untrusted(data, 0, len(data)), strict=True))

    def unpack_values_untrusted(self, data: bytes, offset: int, end: int) -> list[Any]:
        """The meta fields at ``data[offset:end]``, in wire order, read in
        place (the hot path: no copy of the meta, no dict).  A field that
        runs past ``end`` reads into what follows but leaves the offset past
        ``end``, which is refused as the meta's wrong length."""
        values: list[Any] = []
        for step in self.steps:
            if step[0] is not None:
                values += step[0].unpack_from(data, offset)
                offset += step[0].size
            else:
                value, offset = step[3](data, offset)
                values.append(value)
        if offset < end:
            raise RemoteProtocolError(
                f"{self.kind.name} command has {end - offset} trailing meta bytes"
            )
        if offset > end:
            raise RemoteProtocolError(
                f"{self.kind.name} command's fields run {offset - end} bytes past its meta"
            )
        return values


# --------------------------------------------------------------------------
# Commands: frozen dataclasses, one per kind, each with its one wire
# declaration (the @_command above it) that encoding and decoding both read.
# --------------------------------------------------------------------------


class _CommandBase:
    """What every command has: its ``KIND`` and its ``key`` (the primary name
    carried in the frame's index; ``""`` for kinds without one)."""

    __slots__ = ()
    KIND: ClassVar[Kind]

    @property
    def key(self) -> str:
        return ""


MetaField: TypeAlias = tuple[str, Any] | tuple[str, Any, Callable[[Any], Any]]
"""``(attribute, construct)`` or ``(attribute, construct, from_wire)``: one
meta field, named as the dataclass attribute it carries; ``from_wire`` turns
the parsed value into the attribute's type (an enum, a tuple)."""


@dataclass(frozen=True, slots=True)
class _Codec:
    """How one kind is laid out; built by :func:`_command` from its declaration."""

    kind: Kind
    named: bool
    meta: Any  # the construct declaration (the fast path is ``plan``)
    plan: _MetaPlan
    meta_out: Callable[[Any], dict[str, Any]]
    tail_out: Callable[[Any], Body]
    build: Callable[[str, list[Any], memoryview], Any]
    meta_in: Callable[[Any], dict[str, Any]]


_CODECS: dict[int, _Codec] = {}
_CODEC_OF: dict[type, _Codec] = {}
_C = TypeVar("_C", bound=type[_CommandBase])


def _command(
    kind: Kind,
    *,
    key: str | None = None,
    meta: Sequence[MetaField] = (),
    tail: str | None = None,
    tail_out: Callable[[Any], Body] | None = None,
    tail_in: Callable[[Any, memoryview], Any] | None = None,
) -> Callable[[_C], _C]:
    """Declare a dataclass as the command of ``kind``.

    ``key`` names the attribute carried as the frame's key (none: the key is
    always ``""``), ``meta`` the fields of the meta struct in wire order, and
    ``tail`` the attribute carried as the tail (none: the command has no tail).
    The tail is the attribute's bytes, handed out on decode as a view of the
    frame, unless ``tail_out(command) -> bytes`` and ``tail_in(meta, view) ->
    value`` say otherwise.  Every dataclass field must be carried exactly once.
    """

    def register(cls: _C) -> _C:
        names = tuple(f[0] for f in meta)
        carried = [key, *names, tail]
        attrs = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        if sorted(a for a in carried if a is not None) != sorted(attrs):
            raise TypeError(f"{cls.__name__}: key, meta and tail must carry {attrs}")
        convert = {f[0]: f[2] for f in meta if len(f) == 3}
        # Where each constructor argument comes from, in dataclass order: the
        # key, the tail, or the meta value at an index (wire order), converted.
        key_at, tail_at = -1, -2
        sources = tuple(
            (key_at if a == key else tail_at if a == tail else names.index(a), convert.get(a))
            for a in attrs
        )
        # Most kinds are laid out as their dataclass: key, meta in order, tail,
        # nothing to convert; they are built with one call, no choice per field.
        as_declared = [key_at] if key is not None else []
        as_declared += range(len(names))
        as_declared += [tail_at] if tail is not None else []
        plain = not convert and [at for at, _ in sources] == as_declared

        def build(k: str, values: list[Any], t: memoryview) -> Any:
            """The command from its key, its meta ``values`` in wire order
            (:meth:`_MetaPlan.unpack_values_untrusted`) and its tail."""
            tail_value: Any = t
            if tail is None:
                if len(t):
                    raise RemoteProtocolError(
                        f"{kind.name} command has {len(t)} unexpected trailing bytes"
                    )
            elif tail_in is not None:
                tail_value = tail_in(dict(zip(names, values, strict=True)), t)
            if plain:
                if key is not None:
                    values.insert(0, k)
                if tail is not None:
                    values.append(tail_value)
                return cls(*values)
            return cls(
                *[
                    k
                    if at == key_at
                    else tail_value
                    if at == tail_at
                    else values[at]
                    if f is None
                    else f(values[at])
                    for at, f in sources
                ]
            )

        def meta_out(cmd: Any) -> dict[str, Any]:
            return {n: getattr(cmd, n) for n in names}

        def meta_in(m: Any) -> dict[str, Any]:
            return {n: m[n] if n not in convert else convert[n](m[n]) for n in names}

        def raw_tail(cmd: Any) -> Body:
            return b"" if tail is None else getattr(cmd, tail)

        codec = _Codec(
            kind,
            key is not None,
            Struct(*(f[0] / f[1] for f in meta), Terminated).compile(),
            _MetaPlan.of(kind, meta),
            meta_out,
            raw_tail if tail_out is None else tail_out,
            build,
            meta_in,
        )
        quick_init(cls)  # every member builds every command it decodes
        cls.KIND = kind
        if key is not None:
            cls.key = property(attrgetter(key))  # type: ignore[assignment]
        _CODECS[int(kind)] = _CODEC_OF[cls] = codec
        return cls

    return register


def _tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)
