"""An encoded AMQP 1.0 message, split into its sections without decoding it.

Theory of operation
-------------------
AMQP 1.0 (part 3, section 3.2) makes the *bare message* (properties,
application-properties and the body sections) immutable between sender and
receiver, and a footer computed over it must survive too.  The broker
therefore stores what a client sent as it was sent and never re-encodes it;
it owns only the header (the delivery count of a redelivery) and the
message annotations (those a consumer's ``modified`` outcome adds).

:func:`split_message_untrusted` walks the encoding once -- every value's
width follows from its constructor byte (AMQP 1.0 part 1, section 1.6:
fixed widths, variable 8/32, compound 8/32, array 8/32, described types) --
checks that the sections come in the order and with the types the standard
gives them, and returns their bytes as they were.  The walk is strict: a
size that runs past its container, a compound whose items do not fill it
exactly, an odd map, a string that is not UTF-8, an unknown constructor or a
section out of place is a :class:`RemoteProtocolError` naming what and
where.  :func:`with_broker_state` builds what the broker sends: a header with
the delivery count raised, message annotations with the broker's merged
over the client's, and every other section's bytes unchanged.

A message with no body section is accepted (Proton's client sends one for a
``Message()`` with no body); everything else follows the standard.

Pure: no I/O; stdlib only.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.errors import RemoteProtocolError
from protocol.values import Value

__all__ = [
    "MessageSections",
    "PublishFields",
    "annotations_map_untrusted",
    "encode_annotations_map",
    "header_delivery_count_untrusted",
    "merge_annotations_untrusted",
    "publish_fields_untrusted",
    "split_message_untrusted",
    "with_broker_state",
]

# Constructor byte -> width of a fixed-width value (part 1, 1.6: null,
# booleans, uint0, ulong0, list0 have no bytes; ubyte..uuid 1 to 16).
_FIXED: dict[int, int] = {
    0x40: 0, 0x41: 0, 0x42: 0, 0x43: 0, 0x44: 0, 0x45: 0,
    0x50: 1, 0x51: 1, 0x52: 1, 0x53: 1, 0x54: 1, 0x55: 1, 0x56: 1,
    0x60: 2, 0x61: 2,
    0x70: 4, 0x71: 4, 0x72: 4, 0x73: 4, 0x74: 4,
    0x80: 8, 0x81: 8, 0x82: 8, 0x83: 8, 0x84: 8,
    0x94: 16, 0x98: 16,
}  # fmt: skip
# Variable width: size u8 (0xa_) or u32 (0xb_), then that many bytes.
#   vbin8/32: binary; str8/32-utf8: UTF-8; sym8/32: ASCII.
_VBIN = (0xA0, 0xB0)
_STR = (0xA1, 0xB1)
_SYM = (0xA3, 0xB3)
# Compound: size u8 | count u8 (0xc_) or size u32 | count u32 (0xd_), then
# count values; size counts the count field and the values.
_LIST = (0xC0, 0xD0)
_MAP = (0xC1, 0xD1)
# Array: size | count | element constructor | count values without constructor.
_ARRAY = (0xE0, 0xF0)
_DESCRIBED = 0x00
_VARIABLE_WIDTH = frozenset((*_VBIN, *_STR, *_SYM))
# vbin8, str8-utf8, sym8: walked inline in a compound.
_SHORT_VARIABLE = frozenset({0xA0, 0xA1, 0xA3})

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

# Section descriptors (part 3, 3.2), as codes and as symbolic names.
HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
AMQP_SEQUENCE = 0x76
AMQP_VALUE = 0x77
FOOTER = 0x78
_SECTION_NAMES: dict[bytes, int] = {
    b"amqp:header:list": HEADER,
    b"amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    b"amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    b"amqp:properties:list": PROPERTIES,
    b"amqp:application-properties:map": APPLICATION_PROPERTIES,
    b"amqp:data:binary": DATA,
    b"amqp:amqp-sequence:list": AMQP_SEQUENCE,
    b"amqp:amqp-value:*": AMQP_VALUE,
    b"amqp:footer:map": FOOTER,
}
_LABEL = {code: name.decode().split(":")[1] for name, code in _SECTION_NAMES.items()}
# The constructors each section's value may have (amqp-value: any).
_SECTION_TYPES: dict[int, tuple[int, ...]] = {
    HEADER: (0x45, *_LIST),
    DELIVERY_ANNOTATIONS: _MAP,
    MESSAGE_ANNOTATIONS: _MAP,
    PROPERTIES: (0x45, *_LIST),
    APPLICATION_PROPERTIES: _MAP,
    DATA: _VBIN,
    AMQP_SEQUENCE: (0x45, *_LIST),
    FOOTER: _MAP,
}
# Where each section may stand: a section may follow only one of a lower
# rank; data and amqp-sequence sections may repeat.
_RANK = {
    HEADER: 0,
    DELIVERY_ANNOTATIONS: 1,
    MESSAGE_ANNOTATIONS: 2,
    PROPERTIES: 3,
    APPLICATION_PROPERTIES: 4,
    DATA: 5,
    AMQP_SEQUENCE: 5,
    AMQP_VALUE: 5,
    FOOTER: 6,
}
# The header's fields (part 3, 3.2.1): durable, priority, ttl,
# first-acquirer, delivery-count.
_HEADER_DELIVERY_COUNT = 4
# Deepest nesting accepted: deeper is refused rather than risking the stack.
MAX_DEPTH = 64


class _Walker:
    """Walks values of ``data`` from ``pos``; every method returns the end."""

    __slots__ = ("data", "end")

    def __init__(self, data: bytes, end: int) -> None:
        self.data = data
        self.end = end

    def fail(self, pos: int, what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"malformed AMQP message at byte {pos}: {what}")

    def need(self, pos: int, n: int, what: str, end: int) -> int:
        if pos + n > end:
            raise self.fail(pos, f"{what} of {n} bytes runs past its end at byte {end}")
        return pos + n

    def constructor(self, pos: int, end: int, depth: int) -> tuple[int, int]:
        """``(primitive code, position after the constructor)``."""
        if pos >= end:
            raise self.fail(pos, "a value is missing")
        code = self.data[pos]
        if code != _DESCRIBED:
            return code, pos + 1
        if depth > MAX_DEPTH:
            raise self.fail(pos, f"values nested deeper than {MAX_DEPTH}")
        after = self.value(pos + 1, end, depth + 1)  # the descriptor
        if self.data[pos + 1] == _DESCRIBED:
            raise self.fail(pos + 1, "a descriptor that is itself described")
        return self.constructor(after, end, depth + 1)

    def value(self, pos: int, end: int, depth: int = 0) -> int:
        if pos < end:
            # The common case first: a fixed-width value, no call for it.
            width = _FIXED.get(self.data[pos])
            if width is not None and pos + 1 + width <= end:
                return pos + 1 + width
        code, pos = self.constructor(pos, end, depth)
        return self.body(code, pos, end, depth)

    def items_end(self, pos: int, stop: int, count: int, depth: int) -> int:
        """The end of ``count`` values from ``pos`` inside ``stop``: fixed
        widths and small binaries and strings inline, the rest by
        :meth:`value` (every member walks every publish: this is its loop)."""
        data = self.data
        fixed = _FIXED
        for _ in range(count):
            if pos >= stop:
                raise self.fail(pos, "a value is missing")
            code = data[pos]
            width = fixed.get(code)
            if width is not None:
                pos += 1 + width
            elif code in _SHORT_VARIABLE:
                if pos + 2 > stop or pos + 2 + data[pos + 1] > stop:
                    raise self.fail(pos, "a value runs past its end")
                after = pos + 2 + data[pos + 1]
                if code != 0xA0:
                    try:
                        data[pos + 2 : after].decode("utf-8" if code == 0xA1 else "ascii")
                    except UnicodeDecodeError as exc:
                        raise self.fail(pos, f"a string that is not valid text: {exc}") from None
                pos = after
            else:
                pos = self.value(pos, stop, depth)
        if pos > stop:
            raise self.fail(stop, "a value runs past its end")
        return pos

    def body(self, code: int, pos: int, end: int, depth: int) -> int:
        """The end of a value of primitive ``code`` whose bytes start at ``pos``."""
        data = self.data
        width = _FIXED.get(code)
        if width is not None:
            return self.need(pos, width, f"a value of type 0x{code:02x}", end)
        high = code & 0xF0
        if high in (0xA0, 0xB0):
            if code not in _VARIABLE_WIDTH:
                raise self.fail(pos - 1, f"unknown type 0x{code:02x}")
            if high == 0xA0:
                self.need(pos, 1, "a size", end)
                size, pos = data[pos], pos + 1
            else:
                self.need(pos, 4, "a size", end)
                (size,) = _U32.unpack_from(data, pos)
                pos += 4
            stop = self.need(pos, size, f"a value of type 0x{code:02x}", end)
            if code in _STR or code in _SYM:
                try:
                    data[pos:stop].decode("utf-8" if code in _STR else "ascii")
                except UnicodeDecodeError as exc:
                    raise self.fail(pos, f"a string that is not valid text: {exc}") from None
            return stop
        if code in _LIST or code in _MAP or code in _ARRAY:
            small = code in (0xC0, 0xC1, 0xE0)
            sw = 1 if small else 4
            self.need(pos, 2 * sw, "a size and count", end)
            if small:
                size, count = data[pos], data[pos + 1]
            else:
                (size,) = _U32.unpack_from(data, pos)
                (count,) = _U32.unpack_from(data, pos + 4)
            if size < sw:
                raise self.fail(pos, f"a size of {size} cannot hold its count")
            stop = self.need(pos + sw, size, f"a compound of type 0x{code:02x}", end)
            pos += 2 * sw
            if depth > MAX_DEPTH:
                raise self.fail(pos, f"values nested deeper than {MAX_DEPTH}")
            if code in _MAP and count % 2:
                raise self.fail(pos, f"a map of {count} items (not key/value pairs)")
            if code in _ARRAY:
                if count:
                    element, pos = self.constructor(pos, stop, depth + 1)
                    width = _FIXED.get(element)
                    if width is not None:
                        pos = self.need(pos, width * count, "array elements", stop)
                    else:
                        for _ in range(count):
                            pos = self.body(element, pos, stop, depth + 1)
                elif pos < stop:
                    _element, pos = self.constructor(pos, stop, depth + 1)
            else:
                pos = self.items_end(pos, stop, count, depth + 1)
            if pos != stop:
                raise self.fail(pos, f"{stop - pos} bytes left over in a compound")
            return stop
        raise self.fail(pos - 1, f"unknown type 0x{code:02x}")

    def items(self, pos: int, end: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each item of the list or map at ``pos``."""
        code = self.data[pos]
        if code == 0x45:
            return []
        sw = 1 if code in (0xC0, 0xC1) else 4
        count = self.data[pos + 1 + sw] if sw == 1 else _U32.unpack_from(self.data, pos + 5)[0]
        at = pos + 1 + 2 * sw
        out = []
        for _ in range(count):
            stop = self.value(at, end, 1)
            out.append((at, stop))
            at = stop
        return out


@dataclass(frozen=True, slots=True)
class MessageSections:
    """An encoded message's sections, each as the bytes it arrived as (``b""``
    when absent).  ``bare`` is the bare message: properties,
    application-properties and the body sections, as one run of bytes.
    Their concatenation in field order is the message."""

    header: bytes = b""
    delivery_annotations: bytes = b""
    message_annotations: bytes = b""
    bare: bytes = b""
    footer: bytes = b""

    def encode(self) -> bytes:
        return b"".join(
            (
                self.header,
                self.delivery_annotations,
                self.message_annotations,
                self.bare,
                self.footer,
            )
        )


def _section_code(w: _Walker, pos: int) -> tuple[int, int]:
    """``(section code, position of its value)`` of the section at ``pos``."""
    data = w.data
    if data[pos] != _DESCRIBED:
        raise w.fail(pos, f"expected a section (a described value), found type 0x{data[pos]:02x}")
    d = pos + 1
    after = w.value(d, w.end, 1)
    code = data[d]
    if code == 0x53:
        number = data[d + 1]
    elif code == 0x80:
        (number,) = _U64.unpack_from(data, d + 1)
    elif code in _SYM:
        start = d + 2 if code == 0xA3 else d + 5
        number = _SECTION_NAMES.get(bytes(data[start:after]), -1)
    else:
        raise w.fail(d, f"a section descriptor of type 0x{code:02x}")
    if number not in _RANK:
        raise w.fail(d, f"unknown section descriptor {number:#x}")
    return number, after


def split_message_untrusted(data: bytes) -> MessageSections:
    """The sections of the encoded message ``data`` (the payload of one
    whole transfer), each as its bytes.  Raises :class:`RemoteProtocolError`
    for anything that is not a well-formed AMQP 1.0 message."""
    data = bytes(data)
    w = _Walker(data, len(data))
    if not data:
        raise w.fail(0, "an empty message (no sections)")
    spans: dict[int, tuple[int, int]] = {}  # head sections and the footer: where each is
    pos, rank, body_kind = 0, -1, -1
    bare_start = bare_end = -1
    while pos < len(data):
        code, value_at = _section_code(w, pos)
        vcode = data[value_at] if value_at < len(data) else -1
        allowed = _SECTION_TYPES.get(code)
        if allowed is not None and vcode not in allowed:
            raise w.fail(value_at, f"section {_LABEL[code]} holding type 0x{vcode:02x}")
        end = w.value(value_at, len(data), 1)
        r = _RANK[code]
        if r == 5 and body_kind not in (-1, code):
            raise w.fail(pos, "body sections of two kinds")
        repeat = r == rank and r == 5 and code == body_kind and code != AMQP_VALUE
        if r < rank or (r == rank and not repeat):
            raise w.fail(pos, f"section {_LABEL[code]} out of order")
        if r == 5:
            body_kind = code
        if code in _BARE:
            bare_start = pos if bare_start < 0 else bare_start
            bare_end = end
        else:
            spans[code] = (pos, end)
        rank = r
        pos = end
    if not spans:  # the common publish: a bare message, nothing else to cut
        return MessageSections(bare=data[bare_start:bare_end] if bare_start >= 0 else b"")
    return MessageSections(
        header=_cut(data, spans.get(HEADER)),
        delivery_annotations=_cut(data, spans.get(DELIVERY_ANNOTATIONS)),
        message_annotations=_cut(data, spans.get(MESSAGE_ANNOTATIONS)),
        bare=b"" if bare_start < 0 else data[bare_start:bare_end],
        footer=_cut(data, spans.get(FOOTER)),
    )


# The sections of the bare message (part 3, 2.1): properties,
# application-properties and the body.
_BARE = frozenset({PROPERTIES, APPLICATION_PROPERTIES, DATA, AMQP_SEQUENCE, AMQP_VALUE})


def _cut(data: bytes, span: tuple[int, int] | None) -> bytes:
    return b"" if span is None else data[span[0] : span[1]]


# --------------------------------------------------------------------------
# The fields a publish is routed and stored by
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublishFields:
    """What the broker reads of a publish: the header's durable, the
    properties' message-id (as its text), to and subject, and the
    application properties as bus values."""

    durable: bool
    message_id: str
    to: str | None
    subject: str | None
    properties: dict[str, Value]


# Application-property value constructors read here, by how: the rest
# (char, uuid, decimals, described and compound values) is left to Proton.
# byte, short, int, smallint, long, smalllong; timestamp (ms since the epoch)
_SIGNED = {0x51: ">b", 0x61: ">h", 0x71: ">i", 0x54: ">b", 0x81: ">q", 0x55: ">b", 0x83: ">q"}
# ubyte, ushort, uint, smalluint, ulong, smallulong
_UNSIGNED = {0x50: ">B", 0x60: ">H", 0x70: ">I", 0x52: ">B", 0x80: ">Q", 0x53: ">B"}
_FLOATS = {0x72: ">f", 0x82: ">d"}
_NO_VALUE = object()


def _simple(data: bytes, start: int, stop: int) -> object:
    """The value at ``data[start:stop]`` as a bus value, or ``_NO_VALUE``
    when its type is not one read here."""
    code = data[start]
    if code == 0x40:
        return None
    if code in (0x41, 0x42):
        return code == 0x41
    if code == 0x56:
        return data[start + 1] != 0
    if code in (0x43, 0x44):
        return 0
    fmt = _SIGNED.get(code) or _UNSIGNED.get(code) or _FLOATS.get(code)
    if fmt is not None:
        return struct.unpack_from(fmt, data, start + 1)[0]
    if code in _STR or code in _SYM:
        return data[start + (2 if code in (0xA1, 0xA3) else 5) : stop].decode()
    if code in _VBIN:
        return data[start + (2 if code == 0xA0 else 5) : stop]
    return _NO_VALUE


def _text(data: bytes, start: int, stop: int) -> str | None | object:
    """A string (or null) field; ``_NO_VALUE`` for any other type."""
    code = data[start]
    if code == 0x40:
        return None
    if code in _STR:
        return data[start + (2 if code == 0xA1 else 5) : stop].decode()
    return _NO_VALUE


def _end(data: bytes, pos: int) -> int:
    """The end of the (already walked) value at ``pos``; -1 for a described
    value.  No checks: :func:`split_message_untrusted` made them."""
    code = data[pos]
    width = _FIXED.get(code)
    if width is not None:
        return pos + 1 + width
    high = code & 0xF0
    if high in (0xA0, 0xC0, 0xE0):
        return pos + 2 + data[pos + 1]
    if high in (0xB0, 0xD0, 0xF0):
        return pos + 5 + _U32.unpack_from(data, pos + 1)[0]
    return -1


def _items(data: bytes, pos: int, most: int) -> list[tuple[int, int]] | None:
    """``(start, end)`` of the first ``most`` items of the list or map at
    ``pos``; None when one is a described value."""
    code = data[pos]
    if code == 0x45:
        return []
    if code in (0xC0, 0xC1):
        count, at = data[pos + 2], pos + 3
    else:
        count, at = _U32.unpack_from(data, pos + 5)[0], pos + 9
    out = []
    for _ in range(min(count, most)):
        stop = _end(data, at)
        if stop < 0:
            return None
        out.append((at, stop))
        at = stop
    return out


def publish_fields_untrusted(sections: MessageSections) -> PublishFields | None:
    """The :class:`PublishFields` of a message :func:`split_message_untrusted`
    split, read from its bytes; ``None`` when a field has a type this does
    not read (a message-id that is not a string, a header durable that is
    not a boolean, an application property that is a char, uuid, decimal,
    described or compound value, a key that is not a string): the caller
    decodes that message with Proton instead, so the fields are the same
    either way (tests/cluster/test_publish_fields.py compares them)."""
    durable = False
    header = sections.header
    if header:
        if header[1] != 0x53:
            return None  # a descriptor in its long or symbolic form
        items = _items(header, 3, 1)  # after the descriptor 0x00 0x53 0x70
        if items is None:
            return None
        if items:
            value = _simple(header, *items[0])
            if not (value is None or isinstance(value, bool)):
                return None
            durable = bool(value)
    fields: list[object] = [None, None, None]
    properties: dict[str, Value] = {}
    bare = sections.bare
    at = 0
    # The bare message's sections, each ``0x00 0x53 code value`` (split
    # refused any other descriptor form here but the symbolic one).
    while at < len(bare) and bare[at + 1] == 0x53:
        code, value_at = bare[at + 2], at + 3
        if code == PROPERTIES:
            items = _items(bare, value_at, 4)
            if items is None:
                return None
            for i, field in enumerate((0, 2, 3)):
                if field < len(items):
                    fields[i] = _text(bare, *items[field])
            if _NO_VALUE in fields:
                return None
        elif code == APPLICATION_PROPERTIES:
            items = _items(bare, value_at, 2**32)
            if items is None:
                return None
            for (k0, k1), (v0, v1) in zip(items[0::2], items[1::2], strict=True):
                key = _text(bare, k0, k1)
                value = _simple(bare, v0, v1)
                if not isinstance(key, str) or value is _NO_VALUE:
                    return None
                properties[key] = value  # type: ignore[assignment]
        else:
            break  # the body: nothing more the broker reads
        at = _end(bare, value_at)
    else:
        if at < len(bare):
            return None  # a section named by its symbol
    message_id, to, subject = fields
    return PublishFields(
        durable,
        "" if message_id is None else str(message_id),
        to,  # type: ignore[arg-type]
        subject,  # type: ignore[arg-type]
        properties,
    )


# --------------------------------------------------------------------------
# The parts the broker owns: the header's delivery count, the annotations
# --------------------------------------------------------------------------


def _section_value(section: bytes) -> tuple[_Walker, int]:
    w = _Walker(section, len(section))
    _code, at = _section_code(w, 0)
    return w, at


def header_delivery_count_untrusted(header: bytes) -> int:
    """The delivery count a header section carries (0 when absent or null)."""
    if not header:
        return 0
    w, at = _section_value(header)
    items = w.items(at, len(header))
    if len(items) <= _HEADER_DELIVERY_COUNT:
        return 0
    start, _stop = items[_HEADER_DELIVERY_COUNT]
    code = header[start]
    if code in (0x40, 0x43):
        return 0
    if code == 0x52:
        return header[start + 1]
    if code == 0x70:
        return int(_U32.unpack_from(header, start + 1)[0])
    raise w.fail(start, f"a delivery-count of type 0x{code:02x} (not a uint)")


def _encode_uint(n: int) -> bytes:
    if n == 0:
        return b"\x43"
    if n < 256:
        return b"\x52" + bytes((n,))
    return b"\x70" + _U32.pack(min(n, 0xFFFFFFFF))


def _encode_compound(list_code: int, items: Sequence[bytes]) -> bytes:
    """A list (``0xc0``) or map (``0xc1``) of encoded ``items``, in its
    smallest form."""
    payload = b"".join(items)
    if len(payload) + 1 <= 0xFF and len(items) <= 0xFF:
        return bytes((list_code, len(payload) + 1, len(items))) + payload
    big = list_code + 0x10
    return bytes((big,)) + _U32.pack(len(payload) + 4) + _U32.pack(len(items)) + payload


def _with_delivery_count(header: bytes, count: int) -> bytes:
    fields: list[bytes] = []
    if header:
        w, at = _section_value(header)
        fields = [header[a:b] for a, b in w.items(at, len(header))]
    fields += [b"\x40"] * (_HEADER_DELIVERY_COUNT + 1 - len(fields))
    fields[_HEADER_DELIVERY_COUNT] = _encode_uint(count)
    return b"\x00\x53\x70" + _encode_compound(0xC0, fields)


def _key_identity(raw: bytes) -> bytes:
    """What makes two encoded annotation keys the same key: a symbol's text
    (sym8 and sym32 alike), an ulong's value; otherwise the bytes."""
    code = raw[0]
    if code == 0xA3:
        return b"s" + raw[2:]
    if code == 0xB3:
        return b"s" + raw[5:]
    if code in (0x44, 0x53, 0x80):
        value = 0 if code == 0x44 else raw[1] if code == 0x53 else _U64.unpack_from(raw, 1)[0]
        return b"u" + _U64.pack(value)
    return b"r" + raw


def annotations_map_untrusted(encoded: bytes) -> list[tuple[bytes, bytes]]:
    """The ``(key, value)`` pairs, as encoded, of an encoded AMQP map."""
    if not encoded:
        return []
    w = _Walker(encoded, len(encoded))
    code = encoded[0]
    if code not in _MAP:
        raise w.fail(0, f"annotations of type 0x{code:02x} (not a map)")
    if w.value(0, len(encoded)) != len(encoded):
        raise w.fail(0, "bytes after the annotations map")
    items = w.items(0, len(encoded))
    return [
        (encoded[k0:k1], encoded[v0:v1])
        for (k0, k1), (v0, v1) in zip(items[0::2], items[1::2], strict=True)
    ]


def encode_annotations_map(pairs: Sequence[tuple[bytes, bytes]]) -> bytes:
    """An AMQP map of the encoded ``(key, value)`` pairs."""
    return _encode_compound(0xC1, [part for pair in pairs for part in pair])


def merge_annotations_untrusted(base: bytes, overlay: bytes) -> bytes:
    """The encoded map ``base`` with every entry of the encoded map
    ``overlay`` set over it (a key of both takes ``overlay``'s value, in
    ``base``'s place); ``b""`` when both are empty."""
    merged: dict[bytes, tuple[bytes, bytes]] = {}
    for key, value in annotations_map_untrusted(base) + annotations_map_untrusted(overlay):
        identity = _key_identity(key)
        merged[identity] = (merged[identity][0] if identity in merged else key, value)
    return encode_annotations_map(list(merged.values())) if merged else b""


def with_broker_state(data: bytes, delivery_count: int, annotations: bytes) -> bytes:
    """The message ``data`` as the broker sends it: the header's delivery
    count raised by ``delivery_count``, the encoded map ``annotations``
    merged over its message annotations, every other section unchanged."""
    s = split_message_untrusted(data)
    header = s.header
    if delivery_count:
        header = _with_delivery_count(
            header, header_delivery_count_untrusted(header) + delivery_count
        )
    ma = s.message_annotations
    if annotations:
        base = b""
        if ma:
            _w, at = _section_value(ma)
            base = ma[at:]
        ma = b"\x00\x53\x72" + merge_annotations_untrusted(base, annotations)
    return b"".join((header, s.delivery_annotations, ma, s.bare, s.footer))
