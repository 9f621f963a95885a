"""What the broker reads of a publish (durable, id, to, subject, application
properties) is the same whether read from the bytes
(protocol.amqpsections.publish_fields_untrusted) or from Proton's decoding
(cluster.amqp.fields_of_message), which it falls back to for the types it
does not read."""

from __future__ import annotations

import proton
from hypothesis import given
from hypothesis import strategies as hs
from proton import Message

from cluster.amqpvalues import fields_of_message
from protocol.amqpsections import publish_fields_untrusted, split_message_untrusted

_INT = hs.integers(-(2**63), 2**63 - 1)
# Values the fast reading reads: what clients send as properties.
_READ = hs.one_of(
    hs.none(),
    hs.booleans(),
    _INT,
    hs.floats(allow_nan=False),
    hs.text(max_size=300),
    hs.binary(max_size=300),
    hs.integers(0, 255).map(proton.ubyte),
    hs.integers(0, 2**16 - 1).map(proton.ushort),
    hs.integers(0, 2**32 - 1).map(proton.uint),
    hs.integers(0, 2**64 - 1).map(proton.ulong),
    hs.integers(-128, 127).map(proton.byte),
    hs.integers(-(2**15), 2**15 - 1).map(proton.short),
    hs.integers(-(2**31), 2**31 - 1).map(proton.int32),
    hs.floats(width=32, allow_nan=False).map(proton.float32),
    _INT.map(proton.timestamp),
    hs.text(hs.characters(max_codepoint=127), max_size=20).map(proton.symbol),
)
# Values left to Proton.
_LEFT = hs.one_of(
    hs.characters().map(proton.char),
    hs.uuids(),
    hs.integers(0, 2**32 - 1).map(proton.decimal32),
    hs.lists(_INT, max_size=3),
    hs.dictionaries(hs.text(max_size=3), _INT, max_size=2),
)
_IDS = hs.one_of(
    hs.none(),
    hs.text(max_size=40),
    hs.integers(0, 2**64 - 1).map(proton.ulong),
    hs.uuids(),
    hs.binary(max_size=8),
)


def _fields_both_ways(message: Message) -> tuple[object, object]:
    data = bytes(message.encode())
    decoded = Message()
    decoded.decode(data)
    return publish_fields_untrusted(split_message_untrusted(data)), fields_of_message(decoded)


@given(
    properties=hs.dictionaries(hs.text(min_size=1, max_size=8), _READ, max_size=6),
    message_id=hs.one_of(hs.none(), hs.text(max_size=40)),
    to=hs.one_of(hs.none(), hs.text(max_size=20)),
    subject=hs.one_of(hs.none(), hs.text(max_size=20)),
    durable=hs.booleans(),
    body=hs.one_of(hs.text(max_size=50), hs.binary(max_size=50).map(memoryview)),
)
def test_the_bytes_give_what_proton_gives(
    properties: dict[str, object],
    message_id: str | None,
    to: str | None,
    subject: str | None,
    durable: bool,
    body: object,
) -> None:
    message = Message(body=body, durable=durable, id=message_id, address=to, subject=subject)
    message.properties = properties or None
    fast, proton_fields = _fields_both_ways(message)
    assert fast is not None
    assert fast == proton_fields


@given(
    properties=hs.dictionaries(hs.text(min_size=1, max_size=8), _READ, max_size=3),
    left=hs.dictionaries(hs.text(min_size=1, max_size=8), _LEFT, min_size=1, max_size=2),
    message_id=_IDS,
)
def test_a_type_left_to_proton_makes_the_broker_ask_proton(
    properties: dict[str, object], left: dict[str, object], message_id: object
) -> None:
    message = Message(body="x", id=message_id)
    message.properties = {**properties, **left}
    fast, _proton_fields = _fields_both_ways(message)
    assert fast is None


@given(message_id=_IDS)
def test_message_ids_of_every_type_read_the_same(message_id: object) -> None:
    fast, proton_fields = _fields_both_ways(Message(body="x", id=message_id))
    assert fast is None or fast == proton_fields
    # Only string ids (and none) are read from the bytes: a ulong id's text
    # is Proton's "ulong(5)", which the bus has always carried.
    assert (fast is not None) == (message_id is None or isinstance(message_id, str))


def test_a_binary_property_is_its_bytes_both_ways() -> None:
    # Proton decodes a binary as a memoryview, which the broker once put on
    # the bus as the text "<memory at 0x...>".
    message = Message(body="x")
    message.properties = {"k": b"\x00\x01"}
    fast, proton_fields = _fields_both_ways(message)
    assert fast is not None and fast.properties == {"k": b"\x00\x01"}
    assert proton_fields == fast
