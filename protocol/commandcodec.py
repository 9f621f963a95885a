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


@dataclass(frozen=True, slots=True)
class _MetaPlan:
    """How one kind's meta is packed and unpacked: steps in wire order, each
    a ``struct`` over a run of fixed-size fields or one variable field."""

    kind: Kind
    steps: tuple[tuple[Any, ...], ...]

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
        return cls(kind, tuple(steps))

    def pack(self, cmd: Any) -> bytes:
        parts = []
        for step in self.steps:
            if step[0] is not None:
                parts.append(step[0].pack(*[getattr(cmd, n) for n in step[1]]))
            else:
                parts.append(step[2](getattr(cmd, step[1])))
        return b"".join(parts)

    def unpack_untrusted(self, data: bytes) -> dict[str, Any]:
        m: dict[str, Any] = {}
        offset = 0
        for step in self.steps:
            if step[0] is not None:
                m.update(zip(step[1], step[0].unpack_from(data, offset), strict=True))
                offset += step[0].size
            else:
                m[step[1]], offset = step[3](data, offset)
        if offset != len(data):
            raise RemoteProtocolError(
                f"{self.kind.name} command has {len(data) - offset} trailing meta bytes"
            )
        return m


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
    build: Callable[[str, Any, memoryview], Any]
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
        # Where each constructor argument comes from, in dataclass order.
        sources = tuple((a, convert.get(a)) for a in attrs)

        def build(k: str, m: Any, t: memoryview) -> Any:
            if tail is None and len(t):
                raise RemoteProtocolError(
                    f"{kind.name} command has {len(t)} unexpected trailing bytes"
                )
            tail_value = t if tail_in is None else tail_in(m, t)
            return cls(
                *[
                    k if a == key else tail_value if a == tail else m[a] if f is None else f(m[a])
                    for a, f in sources
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
        cls.KIND = kind
        if key is not None:
            cls.key = property(attrgetter(key))  # type: ignore[assignment]
        _CODECS[int(kind)] = _CODEC_OF[cls] = codec
        return cls

    return register


def _tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)
