"""Mutation fuzzing of the site bus's decoders: bus frames and their commands
(protocol/cluster.py), resync snapshots (``iter_snapshot_untrusted``) and the
value-map codec (protocol/values.py).

The bus carries no checksum of ours (corosync checks its own), so the damage
reaches the parsers as it is.  Only ``RemoteProtocolError`` may come out.
"""

from __future__ import annotations

from pathlib import Path

from protocol import cluster as pc
from protocol import snapshotrecords as sr
from protocol.errors import RemoteProtocolError
from protocol.modes import Mode
from protocol.values import pack_value_map, unpack_value_map_untrusted
from tests.support.mutate import Mutator, fuzz

VECTORS = Path(__file__).resolve().parent.parent / "vectors" / "cluster"

_REPLICATED = pc.Replicated(
    "P",
    7,
    41,
    2,
    99,
    (Mode.FULL, Mode.ENQUEUE, Mode.WIRING),
    (
        pc.Enqueue("mirror", 5, b"body", "id-5", {"k": 1, "s": "v", "f": 0.5, "n": None}),
        pc.QueueDeclare("work", {"qpid.max_count": 10, "b": True, "raw": b"\x00"}),
        pc.Bind("ex", "work", "a.#", {"x-match": "all"}),
    ),
)
FRAMES = [bytes.fromhex(p.read_text()) for p in sorted(VECTORS.glob("*.hex"))] + [
    pc.encode_frame([_REPLICATED, pc.AckWatermark("P", 7, 41, 99)]),
    pc.encode_frame([pc.ResyncApply("P", 7, 41, 2, 99, sr.encode_snapshot_record([_REPLICATED]))]),
]


def _index_fields(frame: bytes) -> list[tuple[int, int]]:
    """(offset, width) of the frame's count, every key_len and rest_len, and
    every command's meta_len."""
    count = int.from_bytes(frame[2:4], "big")
    fields = [(2, 2)]
    offset = 4 + 8 * count
    for i in range(min(count, 64)):
        at = 4 + 8 * i
        fields += [(at + 2, 2), (at + 4, 4)]
        key_len = int.from_bytes(frame[at + 2 : at + 4], "big")
        rest_len = int.from_bytes(frame[at + 4 : at + 8], "big")
        fields.append((offset + key_len, 4))
        offset += key_len + rest_len
    return [(at, width) for at, width in fields if at + width <= len(frame)]


def _rebuilt(m: Mutator, frame: bytes) -> bytes:
    """``frame`` (a valid one) with one command's key, meta or tail damaged
    and every length around it made to agree, so the damage reaches the
    command's own parser."""
    parts = []
    for kind, key, size, offset in pc.scan_frame_untrusted(frame):
        meta_len = int.from_bytes(frame[offset : offset + 4], "big")
        meta = frame[offset + 4 : offset + 4 + meta_len]
        parts.append([kind, key.encode(), meta, frame[offset + 4 + meta_len : offset + size]])
    victim = m.rng.choice(parts)
    which = m.rng.choice((1, 2, 2, 2, 3))
    victim[which] = m.mutate(victim[which])
    index = b"".join(
        pc.INDEX_ENTRY.pack(kind, 0, len(key), 4 + len(meta) + len(tail))
        for kind, key, meta, tail in parts
    )
    data = b"".join(
        key + len(meta).to_bytes(4, "big") + meta + tail for _, key, meta, tail in parts
    )
    return frame[:4] + index + data


def damaged_frame(m: Mutator, frame: bytes) -> bytes:
    if m.rng.random() < 0.6:
        return _rebuilt(m, frame)
    return m.mutate(frame, fields=_index_fields(frame))


def decode_three_ways(frame: bytes) -> None:
    """Whole, iterated and by reference: the same commands or the same refusal."""
    commands = pc.decode_frame_untrusted(frame)
    assert list(pc.iter_frame_untrusted(frame)) == commands
    refs = pc.scan_frame_untrusted(frame)
    assert [pc.decode_ref_untrusted(frame, ref) for ref in refs] == commands


def test_bus_frame_decoders_raise_only_remote_protocol_errors() -> None:
    result = fuzz(
        "bus-frame",
        FRAMES,
        decode_three_ways,
        allowed=RemoteProtocolError,
        default_iterations=3000,
        make_input=damaged_frame,
    )
    assert result.outcomes["ok"] > 0


SNAPSHOTS = [
    sr.encode_snapshot_record([_REPLICATED])
    + sr.encode_snapshot_record([_REPLICATED, _REPLICATED]),
]


def test_resync_snapshot_decoder_raises_only_remote_protocol_errors() -> None:
    def damaged(m: Mutator, data: bytes) -> bytes:
        return m.mutate(data, fields=[(0, 4), (4 + 2, 2), (4 + 8, 2), (4 + 10, 4)])

    result = fuzz(
        "resync-snapshot",
        SNAPSHOTS,
        lambda data: list(sr.iter_snapshot_untrusted(data)),
        allowed=RemoteProtocolError,
        default_iterations=1500,
        make_input=damaged,
    )
    assert result.outcomes["ok"] > 0


MAPS = [
    pack_value_map({}),
    pack_value_map({"n": None, "t": True, "f": False, "i": -(2**63), "s": "ünï", "b": b"\xff"}),
    pack_value_map({"x": 1.5, "qpid.max_count": 2**63 - 1, "": ""}),
]


def decode_map(data: bytes) -> None:
    for offset in (0, 1):
        try:
            values, end = unpack_value_map_untrusted(data, offset)
        except RemoteProtocolError:
            continue
        assert offset < end <= len(data)
        assert all(isinstance(k, str) for k in values)


def test_value_map_decoder_raises_only_remote_protocol_errors() -> None:
    result = fuzz(
        "value-map",
        MAPS,
        decode_map,
        allowed=RemoteProtocolError,
        default_iterations=3000,
        make_input=lambda m, data: m.mutate(data, fields=[(0, 2), (2, 2)]),
    )
    assert result.outcomes["ok"] > 0
