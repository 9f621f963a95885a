"""protocol/amqpsections.py: an encoded AMQP message split into its sections,
byte for byte, and the broker's header and annotations put over it."""

from __future__ import annotations

import contextlib
import struct

import proton
import pytest
from hypothesis import given
from hypothesis import strategies as hs
from proton import Message

from protocol.amqpsections import (
    MessageSections,
    annotations_map_untrusted,
    header_delivery_count_untrusted,
    merge_annotations_untrusted,
    split_message_untrusted,
    with_broker_state,
)
from protocol.errors import RemoteProtocolError


def list8(*items: bytes) -> bytes:
    payload = b"".join(items)
    return bytes((0xC0, len(payload) + 1, len(items))) + payload


def list32(*items: bytes) -> bytes:
    payload = b"".join(items)
    return b"\xd0" + struct.pack(">II", len(payload) + 4, len(items)) + payload


def map8(*items: bytes) -> bytes:
    payload = b"".join(items)
    return bytes((0xC1, len(payload) + 1, len(items))) + payload


def sym(text: str) -> bytes:
    return b"\xa3" + bytes((len(text),)) + text.encode()


def string(text: str) -> bytes:
    raw = text.encode()
    return b"\xa1" + bytes((len(raw),)) + raw


def section(code: int, value: bytes) -> bytes:
    return b"\x00\x53" + bytes((code,)) + value


HEADER = section(0x70, list8(b"\x41", b"\x40"))  # durable true, priority null
DELIVERY_ANN = section(0x71, map8(sym("x"), b"\x40"))
MESSAGE_ANN = section(0x72, map8(sym("a"), string("z")))
PROPERTIES_LIST8 = section(0x73, list8(string("i")))  # message-id "i"
# The same properties as a list32: what the broker re-encoded as list8.
PROPERTIES_LIST32 = section(0x73, list32(string("i")))
APP_PROPERTIES = section(0x74, map8(string("color"), b"\x54\x0c"))
DATA_AB = section(0x75, b"\xa0\x02ab")
DATA_CD = section(0x75, b"\xb0\x00\x00\x00\x02cd")
SEQUENCE = section(0x76, list8(b"\x52\x07"))
VALUE_NULL = section(0x77, b"\x40")
VALUE_STR = section(0x77, string("hi"))
FOOTER = section(0x78, map8(sym("hash"), b"\xa0\x00"))
SYMBOLIC_VALUE = b"\x00" + sym("amqp:amqp-value:*") + b"\x52\x05"


def sections(*parts: bytes) -> bytes:
    return b"".join(parts)


VALID = {
    "two data sections": sections(PROPERTIES_LIST8, DATA_AB, DATA_CD),
    "null amqp-value": VALUE_NULL,
    "footer": sections(HEADER, VALUE_STR, FOOTER),
    "everything": sections(
        HEADER, DELIVERY_ANN, MESSAGE_ANN, PROPERTIES_LIST32, APP_PROPERTIES, DATA_AB, FOOTER
    ),
    "amqp-sequence twice": sections(APP_PROPERTIES, SEQUENCE, SEQUENCE),
    "list32 properties": sections(PROPERTIES_LIST32, VALUE_STR),
    "no body (Proton's Message())": bytes(Message().encode()),
    "symbolic descriptor": sections(MESSAGE_ANN, SYMBOLIC_VALUE),
    "ulong descriptor": b"\x00\x80" + struct.pack(">Q", 0x77) + b"\x41",
}


@pytest.mark.parametrize("name", list(VALID))
def test_a_valid_message_splits_and_joins_byte_identical(name: str) -> None:
    data = VALID[name]
    split = split_message_untrusted(data)
    assert split.encode() == data


def test_the_bare_message_and_footer_are_what_was_sent() -> None:
    split = split_message_untrusted(VALID["everything"])
    assert split == MessageSections(
        header=HEADER,
        delivery_annotations=DELIVERY_ANN,
        message_annotations=MESSAGE_ANN,
        bare=PROPERTIES_LIST32 + APP_PROPERTIES + DATA_AB,
        footer=FOOTER,
    )


MALFORMED = {
    "empty": b"",
    "not a section": b"\x41",
    "cut short": VALUE_STR[:-1],
    "size past the end": bytes.fromhex("005375a00561"),
    "compound with bytes left over": section(0x76, b"\xc0\x03\x01\x40\x40"),
    "odd map": section(0x74, map8(string("k"))),
    "unknown type": section(0x77, b"\xff"),
    "unknown section": section(0x79, b"\x40"),
    "header after body": sections(VALUE_STR, HEADER),
    "two amqp-values": sections(VALUE_STR, VALUE_STR),
    "data then sequence": sections(DATA_AB, SEQUENCE),
    "section after footer": sections(VALUE_STR, FOOTER, FOOTER),
    "data section holding a string": section(0x75, string("hi")),
    "string not UTF-8": section(0x77, b"\xa1\x02\xc3\x28"),
    "properties as a map": section(0x73, map8()),
    "trailing garbage": VALUE_STR + b"\x40",
    "size smaller than its count": section(0x77, b"\xd0\x00\x00\x00\x02\x00\x00\x00\x00"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_is_refused_saying_where(name: str) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed AMQP message at byte"):
        split_message_untrusted(MALFORMED[name])


def test_values_nested_too_deep_are_refused() -> None:
    value = b"\x40"
    for _ in range(100):
        value = b"\xd0" + struct.pack(">II", len(value) + 4, 1) + value
    with pytest.raises(RemoteProtocolError, match="nested deeper"):
        split_message_untrusted(b"\x00\x53\x77" + value)


def _proton_message(
    body: object, properties: dict[str, object], durable: bool, annotations: dict[str, object]
) -> bytes:
    m = Message(body=body, durable=durable)
    m.properties = properties or None
    m.annotations = {proton.symbol(k): v for k, v in annotations.items()} or None
    m.id = "id-1"
    m.subject = "s"
    return bytes(m.encode())


_SCALARS = hs.one_of(
    hs.none(),
    hs.booleans(),
    hs.integers(-(2**63), 2**63 - 1),
    hs.text(max_size=20),
    hs.binary(max_size=20),
    hs.floats(allow_nan=False),
)
_BODIES = hs.one_of(
    _SCALARS,
    hs.lists(_SCALARS, max_size=5),
    hs.dictionaries(hs.text(max_size=5), _SCALARS, max_size=5),
    hs.binary(max_size=300).map(memoryview),
)


@given(
    body=_BODIES,
    properties=hs.dictionaries(hs.text(min_size=1, max_size=8), _SCALARS, max_size=5),
    durable=hs.booleans(),
    annotations=hs.dictionaries(
        hs.text(hs.characters(max_codepoint=127), min_size=1, max_size=8), _SCALARS, max_size=3
    ),
    # Every section is at least 4 bytes: a cut of 1 to 3 ends inside the last.
    cut=hs.integers(min_value=1, max_value=3),
)
def test_what_proton_encodes_splits_byte_identical_and_every_cut_is_refused(
    body: object,
    properties: dict[str, object],
    durable: bool,
    annotations: dict[str, object],
    cut: int,
) -> None:
    data = _proton_message(body, properties, durable, annotations)
    assert split_message_untrusted(data).encode() == data
    with pytest.raises(RemoteProtocolError):
        split_message_untrusted(data[:-cut])


@given(data=hs.binary(max_size=64))
def test_random_bytes_fail_only_with_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        split_message_untrusted(b"\x00\x53\x77" + data)


def _decoded(data: bytes) -> Message:
    m = Message()
    m.decode(data)
    return m


def test_the_broker_raises_the_delivery_count_and_keeps_the_rest() -> None:
    data = VALID["everything"]
    out = with_broker_state(data, 2, b"")
    split = split_message_untrusted(out)
    assert header_delivery_count_untrusted(split.header) == 2
    assert _decoded(out).durable is True  # the header's other fields are kept
    original = split_message_untrusted(data)
    assert (split.delivery_annotations, split.message_annotations) == (
        original.delivery_annotations,
        original.message_annotations,
    )
    assert (split.bare, split.footer) == (original.bare, original.footer)
    # Raised again from a count the publisher set.
    again = split_message_untrusted(with_broker_state(out, 1, b""))
    assert header_delivery_count_untrusted(again.header) == 3


def test_a_message_without_header_gets_one_with_the_count() -> None:
    out = with_broker_state(VALUE_NULL, 1, b"")
    assert out.endswith(VALUE_NULL)
    assert _decoded(out).delivery_count == 1


def test_annotations_merge_over_the_clients() -> None:
    d = proton.Data()
    d.put_dict({proton.symbol("a"): "y", proton.symbol("b"): 7})
    overlay = bytes(d.encode())
    out = with_broker_state(VALID["everything"], 0, overlay)
    assert _decoded(out).annotations == {proton.symbol("a"): "y", proton.symbol("b"): 7}
    assert split_message_untrusted(out).bare == split_message_untrusted(VALID["everything"]).bare
    # A message with no annotations of its own gets the broker's.
    assert _decoded(with_broker_state(VALUE_STR, 0, overlay)).annotations == {
        proton.symbol("a"): "y",
        proton.symbol("b"): 7,
    }


def test_merging_annotations_keeps_keys_once_sym8_or_sym32() -> None:
    base = map8(sym("a"), string("z"))
    sym32_a = b"\xb3\x00\x00\x00\x01a"
    overlay = b"\xd1" + struct.pack(">II", 4 + 6 + 3, 2) + sym32_a + string("y")
    merged = merge_annotations_untrusted(base, overlay)
    assert annotations_map_untrusted(merged) == [(b"\xa3\x01a", b"\xa1\x01y")]
    assert merge_annotations_untrusted(b"", b"") == b""


def test_annotations_that_are_not_a_map_are_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="not a map"):
        annotations_map_untrusted(b"\x45")
