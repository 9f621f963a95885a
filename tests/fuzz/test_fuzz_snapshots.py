"""Mutation fuzzing of state-transfer snapshots (cluster/state/snapshots.py).

A snapshot comes from another member over the bus, in ``StateChunk`` pieces,
with no checksum of its own, so the damage reaches the parser as it is.  Only
``RemoteProtocolError`` may come out, and a snapshot that restores must
snapshot back to the same bytes (the encoding is canonical).
"""

from __future__ import annotations

import pytest

from cluster.state import SiteState, apply, restore_untrusted, session_id, snapshot
from protocol import cluster as pc
from protocol.errors import RemoteProtocolError
from protocol.modes import Mode, Role
from tests.support.mutate import fuzz
from tests.support.state import Member, genesis_state


def busy_state() -> SiteState:
    s = genesis_state("D", 12345)
    apply(s, pc.RulesSwitch(b"rules: yes"))
    apply(s, pc.MemberReady(Role.BROKER, 1, 11))
    apply(s, pc.AckWatermark("P", 1, 10, 20))
    apply(s, pc.QueueDeclare("local", {"qpid.max_count": 100, "f": 1.5, "b": b"\x01", "n": None}))
    apply(s, pc.ExchangeDeclare("ex", pc.ExchangeType.TOPIC, {"t": True}))
    apply(s, pc.Bind("ex", "local", "a.#", {"x-match": "all"}))
    apply(
        s,
        pc.Replicated(
            "P",
            7,
            1,
            1,
            99,
            (Mode.FULL, Mode.ENQUEUE, Mode.FULL),
            (
                pc.QueueDeclare("mirror"),
                pc.QueueDeclare("work"),
                pc.Enqueue("mirror", 5, b"m", "id", {"k": 1}),
            ),
        ),
    )
    sid = session_id(1, 11, 1)
    apply(s, pc.SessionOpen(sid), sender=Member(1, 11))
    for i in range(5):
        apply(s, pc.Publish("ex", "a.b", b"x" * i, f"m{i}", {"i": i} if i % 2 else {}, ref=i))
    apply(s, pc.Acquire("local", sid, 3, 2))
    apply(s, pc.Release("local", sid, (1,)))
    return s


SEEDS = [snapshot(genesis_state("P", 1)), snapshot(busy_state())]


def restore_canonical(data: bytes) -> None:
    state = restore_untrusted(data)
    assert snapshot(state) == data


def test_snapshot_restore_raises_only_remote_protocol_errors() -> None:
    result = fuzz(
        "state-snapshot",
        SEEDS,
        restore_canonical,
        allowed=RemoteProtocolError,
        default_iterations=3000,
    )
    assert result.outcomes["ok"] > 0


def _patched(blob: bytes, old: bytes, new: bytes, at: int = 0) -> bytes:
    """``blob`` with the byte ``at`` past the one match of ``old`` set to ``new``."""
    assert blob.count(old) == 1
    i = blob.index(old) + at
    return blob[:i] + new + blob[i + 1 :]


# queue "local": next_pos 6 | replica 0 | 5 messages | then the first message
_LOCAL = b"\x00" * 7 + b"\x06" + b"\x00" + b"\x00\x00\x00\x05"


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        (lambda b: b[:6] + b"\x00\x01" + b[8:], "reserved field"),
        (lambda b: _patched(b, b"amq.topic\x02\x01", b"\x05", 10), "predeclared flag is 5"),
        (lambda b: _patched(b, _LOCAL, b"\x02", 8), "replica flag is 2"),
        (lambda b: _patched(b, _LOCAL, b"\x10", 13 + 16), "message flags 0x10"),
        (lambda b: _patched(b, b"\x00\x01t\x01\x01", b"\x02", 4), "bool byte 2"),
    ],
    ids=["reserved", "predeclared", "replica", "message-flags", "map-bool"],
)
def test_a_flag_byte_other_than_0_or_1_is_refused(patch: object, words: str) -> None:
    """Such a snapshot restored, to a state that snapshots to other bytes."""
    with pytest.raises(RemoteProtocolError, match=words):
        restore_untrusted(patch(SEEDS[1]))  # type: ignore[operator]
