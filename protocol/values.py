"""Value maps (a queue's arguments, a message's properties): the one codec
the bus commands (:mod:`protocol.cluster`) and the state snapshots
(cluster/state/snapshots.py) share.  Pure; decoders are ``*_untrusted`` and
fail only with :class:`RemoteProtocolError`."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, TypeAlias

from construct import Construct, ConstructError

from protocol.errors import LocalProtocolError, RemoteProtocolError

Value: TypeAlias = None | bool | int | float | str | bytes
"""A value in an argument or property map."""
ValueMap: TypeAlias = Mapping[str, Value]

#   map   := count u16 | count x ( key_len u16 | key (UTF-8) | tag u8 | value )
#   value := by tag: 0 null (nothing) | 1 bool u8 | 2 int i64
#            | 3 str (u32 length + UTF-8) | 4 bytes (u32 length + bytes) | 5 float f64
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_EMPTY_MAP = _U16.pack(0)


def pack_value_map(values: ValueMap) -> bytes:
    """The encoding of ``values``.  Raises :class:`LocalProtocolError` for a
    value of another type, an int outside 64 bits or a key or map too long."""
    if not values:
        return _EMPTY_MAP
    if len(values) > 0xFFFF:
        raise LocalProtocolError(f"a map holds at most 65535 entries, got {len(values)}")
    out = [_U16.pack(len(values))]
    append = out.append
    for k, v in values.items():
        key = k.encode("utf-8")
        if len(key) > 0xFFFF:
            raise LocalProtocolError(f"map key of {len(key)} bytes is longer than 65535 bytes")
        append(_U16.pack(len(key)))
        append(key)
        if v is None:
            append(b"\x00")
        elif isinstance(v, bool):
            append(b"\x01\x01" if v else b"\x01\x00")
        elif isinstance(v, int):
            try:
                append(b"\x02" + _I64.pack(v))
            except struct.error as exc:
                raise LocalProtocolError(f"map value {k!r}={v} does not fit in 64 bits") from exc
        elif isinstance(v, str):
            raw = v.encode("utf-8")
            append(b"\x03" + _U32.pack(len(raw)))
            append(raw)
        elif isinstance(v, bytes | bytearray | memoryview):
            append(b"\x04" + _U32.pack(len(v)))
            append(bytes(v))
        elif isinstance(v, float):
            append(b"\x05" + _F64.pack(v))
        else:
            raise LocalProtocolError(
                f"map value for {k!r} has type {type(v).__name__}; "
                "only None, bool, int, float, str and bytes can be encoded"
            )
    return b"".join(out)


def unpack_value_map_untrusted(data: bytes, offset: int = 0) -> tuple[dict[str, Value], int]:
    """The map encoded at ``data[offset:]`` and the offset just past it.
    Fails only with :class:`RemoteProtocolError`."""
    try:
        (count,) = _U16.unpack_from(data, offset)
        off = offset + 2
        out: dict[str, Value] = {}
        for _ in range(count):
            (size,) = _U16.unpack_from(data, off)
            off += 2
            end = off + size
            key = data[off:end].decode("utf-8")
            tag = data[end]
            off = end + 1
            v: Value
            if tag == 0:
                v = None
            elif tag == 1:
                if data[off] > 1:
                    raise RemoteProtocolError(f"value map entry {key!r}: bool byte {data[off]}")
                v = data[off] == 1
                off += 1
            elif tag == 2:
                (v,) = _I64.unpack_from(data, off)
                off += 8
            elif tag in (3, 4):
                (size,) = _U32.unpack_from(data, off)
                off += 4
                end = off + size
                if end > len(data):
                    raise RemoteProtocolError(f"value map entry {key!r} goes past the end")
                v = data[off:end].decode("utf-8") if tag == 3 else data[off:end]
                off = end
            elif tag == 5:
                (v,) = _F64.unpack_from(data, off)
                off += 8
            else:
                raise RemoteProtocolError(f"value map entry {key!r} has unknown tag {tag}")
            out[key] = v
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"truncated or malformed value map at byte {offset}") from exc
    return out, off


class _ValueMapField(Construct):  # type: ignore[misc]
    """A value map as a field of a command's meta struct."""

    def _parse(self, stream: Any, context: Any, path: Any) -> dict[str, Value]:
        # The meta is always parsed from a BytesIO over bytes, whose getvalue()
        # hands back those bytes without a copy.
        try:
            values, end = unpack_value_map_untrusted(stream.getvalue(), stream.tell())
        except RemoteProtocolError as exc:
            raise ConstructError(str(exc)) from exc
        stream.seek(end)
        return values

    def _build(self, obj: ValueMap, stream: Any, context: Any, path: Any) -> ValueMap:
        stream.write(pack_value_map(obj))
        return obj


VALUE_MAP_FIELD = _ValueMapField()
"""A value map as a construct field (a command's meta struct)."""
