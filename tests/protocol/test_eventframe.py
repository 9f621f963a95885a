"""The tap's fast event encoding (protocol/eventframe.py) writes exactly the
bytes of the generic one, for every kind of inner command, and refuses what
the generic one refuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import cluster as c
from protocol.errors import LocalProtocolError
from protocol.eventframe import encode_event
from protocol.modes import Mode
from tests.protocol.test_cluster import bodies, names, simple_commands, u32, u64, value_maps

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
