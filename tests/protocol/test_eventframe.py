"""The tap's fast event encoding (protocol/eventframe.py) writes exactly the
bytes of the generic one, for every kind of inner command, and refuses what
the generic one refuses; the fast decoding of a ``Replicated`` gives the
generic decoder's commands, and refuses, with a protocol error only, the
damaged events the generic one refuses."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import cluster as c
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.eventframe import encode_event
from protocol.modes import Mode
from protocol.values import pack_value_map
from tests.protocol.test_cluster import (
    _frame_of,
    bodies,
    names,
    simple_commands,
    u32,
    u64,
    value_maps,
)
from tests.support.mutate import NO_SHRINK, mutated

enqueues = st.builds(c.Enqueue, names, u64, bodies, names, value_maps, st.booleans())
inner = st.lists(st.one_of(enqueues, simple_commands), max_size=4)


@given(names, u64, u64, u32, u64, inner, st.data())
def test_the_fast_event_is_the_generic_frame(
    origin: str,
    incarnation: int,
    cseq: int,
    epoch: int,
    time_us: int,
    commands: list[c.Command],
    data: st.DataObject,
) -> None:
    modes = tuple(data.draw(st.sampled_from(Mode)) for _ in commands)
    generic = c.encode_frame(
        [c.Replicated(origin, incarnation, cseq, epoch, time_us, modes, tuple(commands))]
    )
    assert encode_event(origin, incarnation, cseq, epoch, time_us, modes, commands) == generic
    assert c.decode_frame_untrusted(generic) == c.decode_frame_untrusted(
        encode_event(origin, incarnation, cseq, epoch, time_us, modes, commands)
    )


def test_what_the_generic_encoding_refuses_the_fast_one_refuses() -> None:
    enqueue = c.Enqueue("q", 1, b"b", "m", {"k": object()})  # type: ignore[dict-item]
    with pytest.raises(LocalProtocolError):
        encode_event("p", 1, 1, 1, 1, (Mode.FULL,), (enqueue,))
    with pytest.raises(LocalProtocolError, match="1 modes for 0 commands"):
        encode_event("p", 1, 1, 1, 1, (Mode.FULL,), ())
    nested = c.Replicated("p", 1, 1, 1, 1, (), ())
    with pytest.raises(LocalProtocolError, match="cannot be nested"):
        encode_event("p", 1, 1, 1, 1, (Mode.FULL,), (nested,))
    with pytest.raises(LocalProtocolError):
        encode_event("p", 2**64, 1, 1, 1, (), ())
    with pytest.raises(LocalProtocolError):
        encode_event("x" * 70_000, 1, 1, 1, 1, (), ())


@contextlib.contextmanager
def generic_decoding() -> Iterator[None]:
    """The generic decoder only, as before the fast one was registered."""
    saved = dict(c.FAST_DECODERS)
    c.FAST_DECODERS.clear()
    try:
        yield
    finally:
        c.FAST_DECODERS.update(saved)


def outcome(frame: bytes) -> list[c.Command] | str:
    try:
        return c.decode_frame_untrusted(frame)
    except RemoteProtocolError:
        return "refused"


@st.composite
def events(draw: st.DrawFn) -> bytes:
    """A frame of one or two events (a nested one now and then), valid, or
    damaged anywhere (the framing's lengths kept right or not)."""
    commands = draw(inner)
    modes = tuple(draw(st.sampled_from(Mode)) for _ in commands)
    event = c.Replicated(
        draw(names), draw(u64), draw(u64), draw(u32), draw(u64), modes, tuple(commands)
    )
    frame = c.encode_frame([event] * draw(st.integers(1, 2)))
    if draw(st.booleans()):
        return frame
    return mutated(draw, frame, fields=((2, 2), (8, 4)))


def test_the_fast_decoder_gives_the_generic_decoders_commands_and_refusals() -> None:
    @NO_SHRINK
    @given(events())
    def same(frame: bytes) -> None:
        fast = outcome(frame)
        with generic_decoding():
            generic = outcome(frame)
        assert fast == generic

    same()


def _event_frame(
    enqueue_rest: bytes, *, modes: bytes = b"\x02", extra: bytes = b"", trailing: bytes = b""
) -> bytes:
    """One event of one Enqueue whose rest is ``enqueue_rest``, by hand."""
    inner = _frame_of([(int(c.Kind.ENQUEUE), b"q", enqueue_rest)]) + trailing
    head = struct.pack(">QQIQH", 1, 2, 3, 4, len(modes)) + modes + extra
    rest = c.META_LEN.pack(len(head)) + head + inner
    return _frame_of([(int(c.Kind.REPLICATED), b"site-p", rest)])


def _nested_event() -> bytes:
    """An event whose inner frame holds an event."""
    event = c.Replicated("site-p", 1, 2, 3, 4, (Mode.FULL,), (c.QueueDeclare("q"),))
    kind, key, rest = c.encode_command(event)
    (meta_len,) = c.META_LEN.unpack_from(rest)
    nested = rest[: c.META_LEN.size + meta_len] + c.encode_frame([event])
    return _frame_of([(kind, key, nested)])


def _enqueue_rest(*, flag: bytes = b"\x00", extra_meta: bytes = b"") -> bytes:
    meta = struct.pack(">QH", 7, 2) + b"m1" + pack_value_map({"k": 1}) + flag + extra_meta
    return c.META_LEN.pack(len(meta)) + meta + b"body"


@pytest.mark.parametrize(
    "frame",
    [
        _event_frame(_enqueue_rest()),
        _event_frame(_enqueue_rest(flag=b"\x02")),  # any byte but 0 is redelivered
        _event_frame(_enqueue_rest(extra_meta=b"\x00")),  # a meta byte too many
        _event_frame(_enqueue_rest(), modes=b"\x02\x00"),  # one mode too many
        _event_frame(_enqueue_rest(), extra=b"\x00"),  # a byte after the modes
        _event_frame(_enqueue_rest(), modes=b"\x63"),  # no such mode
        _event_frame(_enqueue_rest(), trailing=b"\x00"),  # bytes after the inner frame
        _event_frame(c.META_LEN.pack(200) + b"\x00" * 8),  # a meta past the command
        _event_frame(b"\x00\x00"),  # no meta length
        _nested_event(),  # an event inside an event
    ],
)
def test_edge_cases_decode_as_the_generic_decoder_does(frame: bytes) -> None:
    fast = outcome(frame)
    with generic_decoding():
        assert fast == outcome(frame)
